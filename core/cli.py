"""Command line: `python -m core generate ...` and `python -m core compare ...`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from core.config import GenerationConfig, TriForceError
from core.engine import Engine
from core.events import Finished, Stats, Tokens

COLOURS = {"draft": "\033[32m", "copy": "\033[36m", "level2": "\033[33m", "level3": "\033[35m", "target": ""}
RESET = "\033[0m"
LEGEND = "green: level-1 draft accepted  cyan: level-1 copy accepted  yellow: level-2 sample  magenta: level-3 " \
    "correction/bonus"


def _reselect(value: str):
    return int(value) if value.isdigit() else value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m core", description="TriForce long-context generation")
    sub = p.add_subparsers(dest="command", required=True)
    for name, help_ in (("generate", "generate an answer"), ("compare", "run AR and TriForce on the same input")):
        s = sub.add_parser(name, help=help_)
        s.add_argument("--doc", required=True, help="document file (UTF-8 text)")
        s.add_argument("--prompt", required=True, help="instruction or question")
        if name == "generate":
            s.add_argument("--method", choices=["triforce", "ar"], default="triforce")
        s.add_argument("--greedy", action="store_true")
        s.add_argument("--max-new-tokens", type=int, default=128)
        s.add_argument("--budget", type=int, default=4096)
        s.add_argument("--chunk-size", type=int, default=8)
        s.add_argument("--gamma1", type=int, default=2)
        s.add_argument("--gamma2", type=int, default=6)
        s.add_argument("--drafter", choices=["model", "ngram", "none"])
        s.add_argument("--draft-confidence", type=float, default=0.0,
                       help="the model drafter stops proposing below this top probability (0: never)")
        s.add_argument("--lookup-min", type=int, default=GenerationConfig.lookup_min,
                       help="the model drafter copies the document's continuation after a match of this many "
                            "tokens (0: never)")
        s.add_argument("--no-draft-fusion", dest="draft_fusion", action="store_false",
                       help="a draft with a fusion module proposes without the target's hidden states")
        s.add_argument("--reselect", type=_reselect, default="once", help="once, every_verify or every N rounds")
        s.add_argument("--temperature", type=float, default=0.6)
        s.add_argument("--top-p", type=float, default=0.9)
        s.add_argument("--top-k", type=int, default=0)
        s.add_argument("--seed", type=int, default=0)
        s.add_argument("--draft", help="draft model: hub id, directory or .gguf")
        s.add_argument("--target", help="target model: hub id, directory or .gguf (default: embedded SmolLM2)")
        s.add_argument("--device")
        s.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
        s.add_argument("--overflow", choices=["truncate", "refuse"], default="truncate")
        s.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
        s.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def _config(args, method: str) -> GenerationConfig:
    return GenerationConfig(
        method=method, greedy=args.greedy, max_new_tokens=args.max_new_tokens, budget=args.budget,
        chunk_size=args.chunk_size, gamma1=args.gamma1, gamma2=args.gamma2, drafter=args.drafter,
        reselect=args.reselect, draft_confidence=args.draft_confidence, lookup_min=args.lookup_min,
        draft_fusion=args.draft_fusion, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
        overflow=args.overflow, stop=args.stop).validate()


def _run(engine: Engine, document: str, args, cfg: GenerationConfig, show: bool) -> Finished:
    """Generate, streaming coloured tokens to stdout when `show`; return the Finished event."""
    for event in engine.generate(document, args.prompt, cfg):
        if show and isinstance(event, Tokens):
            colour = sys.stdout.isatty()
            for text, prov in zip(event.texts, event.provenance):
                sys.stdout.write(f"{COLOURS[prov]}{text}{RESET}" if colour and COLOURS[prov] else text)
            sys.stdout.flush()
        if isinstance(event, Finished):
            return event
    raise RuntimeError("generation ended without a result")


def _stats_line(s: Stats) -> str:
    line = (f"{s.method}: {s.new_tokens} tokens, {s.tokens_per_s:.2f} tok/s, prefill {s.prefill_s:.1f}s "
            f"({s.prompt_tokens} prompt tokens, {s.dropped_tokens} dropped), {s.tokens_per_target_forward:.2f} "
            "tokens/target forward")
    if s.method == "triforce":
        line += f", acceptance L1 {s.level1_acceptance:.2f} L2 {s.level2_acceptance:.2f}"
    return line


def _summary(f: Finished) -> dict:
    return {"text": f.text, "prompt_ids": f.prompt_ids, "token_ids": f.token_ids, "stats": f.stats.to_dict()}


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        document = Path(args.doc).read_text(encoding="utf-8")
        methods = [args.method] if args.command == "generate" else ["ar", "triforce"]
        configs = [_config(args, m) for m in methods]
        engine = Engine.load(args.target, args.draft, args.device, args.dtype)
        if args.command == "generate":
            result = _run(engine, document, args, configs[0], show=not args.json)
            if args.json:
                print(json.dumps(_summary(result)))
            else:
                print(f"\n\n{_stats_line(result.stats)}" + (f"\n{LEGEND}" if sys.stdout.isatty() else ""))
            return 0
        ar, tf = (_run(engine, document, args, cfg, show=False) for cfg in configs)
        same = ar.token_ids == tf.token_ids
        if args.json:
            print(json.dumps({"ar": _summary(ar), "triforce": _summary(tf), "identical": same,
                              "speedup": tf.stats.tokens_per_s / ar.stats.tokens_per_s}))
        else:
            print(f"{_stats_line(ar.stats)}\n{_stats_line(tf.stats)}\n"
                  f"speedup {tf.stats.tokens_per_s / ar.stats.tokens_per_s:.2f}x, outputs "
                  + ("token-identical" if same else "differ") + f"\n\n{tf.text}")
        return 1 if args.greedy and not same else 0
    except (TriForceError, OSError, UnicodeDecodeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
