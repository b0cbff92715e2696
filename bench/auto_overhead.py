"""What method auto costs where its plan is autoregressive decoding: AR and auto alternated through Engine.generate
on one engine (random weights at a shape; a document short enough, or a budget large enough, that auto decodes
autoregressively, as it does on a small model), tokens/s of each, their ratio per pair, and a Python profile of one
run of each (the functions whose own time differs most between the two). First, after Engine.warm_up as the app
runs it, the first two AR + auto pairs taken apart (what a first click pays that a second does not).

python -m bench.auto_overhead --shape smollm2_135m --tokenizer smollm2-135m [--doc-tokens 8000] [--pairs 6]   # on a GPU
python -m bench.auto_overhead --shape tiny_49k --tokenizer smollm2-135m --doc-tokens 2000              # on a CPU
python -m bench.auto_overhead --shape embedded --doc-tokens 7900 --new-tokens 64 --pairs 3   # the embedded model
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics

import torch

from bench.common import SHAPES, environment, random_model, save, tokenizer_of
from bench.offload import INSTRUCTION, document, run
from core import Engine, GenerationConfig
from core.events import Finished, RetrievalSelection, StepTiming

SAMPLED = {"temperature": 0.6, "top_p": 0.9}


def anatomy(engine: Engine, doc: str, cfg: GenerationConfig) -> dict:
    """One generation taken apart: its decode time against what its rounds report (levels and selections), the
    first selection's time, the slowest rounds, the first rounds by level (1, 2, 3, selection), and the plans."""
    rounds, selections, firsts, fin = [], [], [], None
    for event in engine.generate(doc, INSTRUCTION, cfg):
        if isinstance(event, StepTiming):
            rounds.append(event.level1_ms + event.level2_ms + event.level3_ms + event.selection_ms)
            if len(firsts) < 3:
                firsts.append((event.level1_ms, event.level2_ms, event.level3_ms, event.selection_ms))
        elif isinstance(event, RetrievalSelection):
            selections.append(event.seconds * 1e3)
        elif isinstance(event, Finished):
            fin = event
    s = fin.stats
    return {"decode_ms": s.decode_s * 1e3, "warmup_ms": s.warmup_s * 1e3, "rounds_ms": sum(rounds),
            "first_selection_ms": selections[0] if selections else None, "rounds": len(rounds),
            "slowest_rounds_ms": sorted(rounds)[-5:], "first_rounds_ms": firsts, "tokens_per_s": s.tokens_per_s,
            "plans": s.plans}


def first_runs(engine: Engine, doc: str, new_tokens: int) -> dict:
    """A served app's first two Compare clicks, engine side: after Engine.warm_up (as the app runs it), greedy AR
    (which prefills) then method auto, twice."""
    engine.warm_up()
    out = {}
    for click in ("first", "second"):
        for method in ("ar", "auto"):
            out[f"{click} {method}"] = anatomy(engine, doc, engine.settings(method=method, greedy=True,
                                                                            max_new_tokens=new_tokens))
            print(click, method, {k: v for k, v in out[f"{click} {method}"].items() if k != "plans"}, flush=True)
    return out


def own_times(engine: Engine, doc: str, cfg: GenerationConfig) -> dict[str, float]:
    """Seconds spent in each function itself (not its callees) during one generation."""
    profile = cProfile.Profile()
    profile.enable()
    run(engine, doc, cfg)
    profile.disable()
    stats = pstats.Stats(profile).stats
    return {f"{name} ({file.rsplit('/', 1)[-1]}:{line})": row[2] for (file, line, name), row in stats.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES) + ["embedded"], default="smollm2_135m",
                   help="random weights at this shape, or the embedded model with its preset's settings")
    p.add_argument("--tokenizer", help="tokenizer of a random shape: a preset id (smollm2-135m), directory or hub id")
    p.add_argument("--doc-tokens", type=int, default=8000)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--pairs", type=int, default=6)
    p.add_argument("--budget", type=int, default=None, help="retrieval budget (default: the method's)")
    args = p.parse_args()
    on_gpu = torch.cuda.is_available()
    if args.shape == "embedded":
        engine = Engine.load()
        tok = engine.tokenizer
    else:
        tok = tokenizer_of(args.tokenizer)
        shape = SHAPES[args.shape]
        model = random_model({**shape, "vocab_size": max(shape["vocab_size"], len(tok))},
                             *(() if on_gpu else (torch.device("cpu"), torch.float32)))
        model.eos_ids = set()
        engine = Engine.from_models(model, tok, f"random {args.shape}",
                                    context_length=args.doc_tokens + args.new_tokens + 1024)
    doc = document(tok, args.doc_tokens)
    first = first_runs(engine, doc, args.new_tokens)
    out: dict = {"first_runs": first, **environment(), "device": torch.cuda.get_device_name() if on_gpu else "cpu",
                 "shape": args.shape, "model": engine.target_name, "doc_tokens": args.doc_tokens,
                 "new_tokens": args.new_tokens, "runs": {}}
    for sampling, settings in (("greedy", {"greedy": True}), ("sampled", SAMPLED)):
        cfgs = {m: engine.settings(method=m, max_new_tokens=args.new_tokens, overflow="truncate", **settings,
                                   **({"budget": args.budget} if args.budget else {})) for m in ("ar", "auto")}
        for cfg in cfgs.values():  # compiles, captures and the planner's first measurements, untimed
            run(engine, doc, cfg)
        rows = {m: [] for m in cfgs}
        for _ in range(args.pairs):
            for m, cfg in cfgs.items():
                rows[m].append(run(engine, doc, cfg))
        ratios = [a["ms_per_token"] / b["ms_per_token"] for a, b in zip(rows["ar"], rows["auto"])]
        profiles = {m: own_times(engine, doc, cfg) for m, cfg in cfgs.items()}
        gaps = {name: (profiles["auto"].get(name, 0.0) - profiles["ar"].get(name, 0.0)) * 1e3 / args.new_tokens
                for name in profiles["ar"].keys() | profiles["auto"].keys()}
        out["runs"][sampling] = {
            "ar_ms_per_token": [r["ms_per_token"] for r in rows["ar"]],
            "auto_ms_per_token": [r["ms_per_token"] for r in rows["auto"]],
            "auto_plans": [r["plans"] for r in rows["auto"]], "auto_over_ar": ratios,
            "median_auto_over_ar": statistics.median(ratios),
            "profile_ms_per_token_auto_minus_ar": dict(sorted(gaps.items(), key=lambda kv: -abs(kv[1]))[:25])}
        print(sampling, "auto / AR tokens/s per pair:", [round(r, 3) for r in ratios], "plans:",
              rows["auto"][-1]["plans"], flush=True)
        for name, ms in list(out["runs"][sampling]["profile_ms_per_token_auto_minus_ar"].items())[:12]:
            print(f"  {ms:+.4f} ms/token  {name}")
    out["summary"] = {s: r["median_auto_over_ar"] for s, r in out["runs"].items()}
    print(out["summary"])
    print(f"saved {save('auto-overhead-' + out['device'].replace(' ', '-'), out)}")


if __name__ == "__main__":
    main()
