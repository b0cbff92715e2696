"""Needle in a haystack on the embedded model (CPU), the paper's Table 1 ablation: level-2 acceptance with the
retrieval cache vs a StreamingLLM cache of the same budget, greedy and at temperature 0.6 / top-p 0.9, and whether
the answer holds the passkey. The document is assets/docs/needle.txt, the text of haystack().

python -m bench.needle [--budget 256] [--new-tokens 16] [--drafter model]

With --target (a long-context preset, e.g. qwen2.5-coder-1.5b-128k on a GPU): a needle of its own (an access code,
not the passkey the tests use) hidden at each depth of the bundled legal and prose documents cut to each length;
greedy autoregressive decoding answers (quality: is the code in the answer), then at the longest length method auto
and autoregressive decoding answer sampled (speed: auto over AR, each step's rate). Writes
bench/results/needle-long-<GPU>.json with summary.real.onchip_speedup_<length>.

python -m bench.needle --target qwen2.5-coder-1.5b-128k [--draft none] [--lengths 30000 64000 100000 124000]
                       [--depths 0.25 0.6] [--new-tokens 128]
"""

from __future__ import annotations

import argparse

import torch

from bench.acceptance import SETTINGS
from bench.common import DOCS, earlier_today, environment, finish, result_path, save
from core import Engine, GenerationConfig
from core.cache import LEVEL2_CACHES
from core.io.prompting import plain_ids

PASSKEY = "68203"
QUESTION = "What is the pass key?"
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.\n"
NEEDLE = f"The pass key is {PASSKEY}. Remember it. {PASSKEY} is the pass key.\n"


def haystack(lines: int = 240, depth: float = 0.4) -> str:
    """A passkey sentence hidden `depth` of the way into `lines` filler lines (Mohtashami and Jaggi's passkey
    retrieval task): about 6K tokens, well inside the embedded model's 8K context."""
    head = round(lines * depth)
    return ("There is an important piece of information hidden inside a lot of irrelevant text. Find it and memorise "
            "it.\n\n" + FILLER * head + NEEDLE + FILLER * (lines - head))


CODE = "7391-KESTREL"  # the long needle: unlike the tests' passkey, and not a number a model may guess
LONG_QUESTION = "What is the access code for the records archive? Answer with the code."
LONG_NEEDLE = f"\n\nNote for the records office: the access code for the records archive is {CODE}.\n\n"
SPEED_INSTRUCTION = "Summarise the whole document in detail, part by part."  # a long answer: decoding is timed
HAYSTACK = ("us_constitution.txt", "us_declaration_of_independence.txt", "gpl-3.0.txt", "LICENSE-PSF-2.0.txt",
            "pride_and_prejudice.txt")


def long_haystack(tok, tokens: int, depth: float) -> str:
    """The bundled legal and prose documents, repeated and cut to about `tokens` tokens, the needle `depth` of the
    way in (at a paragraph's end)."""
    text = "\n\n".join((DOCS / name).read_text() for name in HAYSTACK)
    ids = plain_ids(tok, text)
    while len(ids) < tokens:
        text, ids = text + "\n\n" + text, ids + ids
    body = tok.decode(ids[:tokens])
    at = body.rfind("\n\n", 0, int(len(body) * depth)) + 1 or int(len(body) * depth)
    return body[:at] + LONG_NEEDLE + body[at:]


def long_main(args: argparse.Namespace) -> None:
    """The long-context needle and speed runs of one preset (see the module's docstring)."""
    engine = Engine.load(args.target, args.draft)
    engine.warm_up()  # as the app does before serving: kernels compiled, the cost book filled
    gpu = torch.cuda.get_device_name().replace(" ", "-") if torch.cuda.is_available() else "cpu"
    name = f"needle-long-{gpu}"
    old = earlier_today(result_path(name))  # today's runs of other lengths and depths are kept
    rows, speed = [], {}
    for length in args.lengths:
        for depth in args.depths if not args.speed_only else args.depths[-1:]:
            doc = long_haystack(engine.tokenizer, length, depth)
            if args.speed_only:
                continue
            fin = finish(engine, doc, LONG_QUESTION, engine.settings(method="ar", greedy=True, max_new_tokens=24))
            rows.append({"length": length, "depth": depth, "prompt_tokens": fin.stats.prompt_tokens,
                         "found": CODE in fin.text, "answer": fin.text})
            print(f"{length:>7} tokens, depth {depth:.0%}: {'found' if CODE in fin.text else 'MISSED'} {fin.text!r}",
                  flush=True)
        if length == max(args.lengths):  # the prompt is prefilled once: only decoding is timed
            for method in ("ar", "auto", "triforce"):
                cfg = engine.settings(method=method, temperature=0.6, top_p=0.9, max_new_tokens=args.new_tokens)
                s = finish(engine, doc, SPEED_INSTRUCTION, cfg).stats
                speed[method] = {"tokens_per_s": s.tokens_per_s, "level2_acceptance": s.level2_acceptance,
                                 "plans": s.plans, "new_tokens": s.new_tokens}
                print(f"{method}: {s.tokens_per_s:.1f} tokens/s, acceptance {s.level2_acceptance:.2f}, "
                      f"plans {s.plans[:3]}", flush=True)
    longest = max(args.lengths)
    summary = {f"onchip_speedup_{round(longest / 1000)}k": speed["auto"]["tokens_per_s"] / speed["ar"]["tokens_per_s"]}
    mine = {(r["length"], r["depth"]) for r in rows}
    rows = sorted([r for r in old.get("rows", []) if (r["length"], r["depth"]) not in mine] + rows,
                  key=lambda r: (r["length"], r["depth"]))
    env = environment()
    path = save(name, {**env, "commands": old.get("commands", [old["command"]] if old else []) + [env["command"]],
                       "gpu": gpu, "model": engine.info, "question": LONG_QUESTION, "code": CODE, "rows": rows,
                       "speed_instruction": SPEED_INSTRUCTION, "speed_at_longest": speed,
                       "summary": {"real": {**old.get("summary", {}).get("real", {}), **summary}}})
    print(f"{sum(r['found'] for r in rows)} of {len(rows)} found; {summary}; saved {path}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--budget", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--drafter", default="model")
    p.add_argument("--repetition-penalty", type=float, default=GenerationConfig.repetition_penalty)
    p.add_argument("--target", help="a long-context preset id: the long needle and speed runs")
    p.add_argument("--lengths", type=int, nargs="+", default=[30_000, 64_000, 100_000, 124_000])
    p.add_argument("--depths", type=float, nargs="+", default=[0.25, 0.6])
    p.add_argument("--draft", help="with --target: its draft model (none: level 1 by prompt lookup alone)")
    p.add_argument("--speed-only", action="store_true", help="with --target: the speed runs alone (no needle runs)")
    args = p.parse_args()
    if args.target:
        return long_main(args)
    engine = Engine.load()
    doc = (DOCS / "needle.txt").read_text()
    rows = []
    for setting, sampling in SETTINGS.items():
        for kind in LEVEL2_CACHES:
            cfg = GenerationConfig(max_new_tokens=args.new_tokens, budget=args.budget, drafter=args.drafter,
                                   level2_cache=kind, repetition_penalty=args.repetition_penalty,
                                   **sampling)
            s = (fin := finish(engine, doc, QUESTION, cfg)).stats
            found = PASSKEY in fin.text
            rows.append({"setting": setting, "level2_cache": kind, "level2_proposed": s.level2_proposed,
                         "level2_accepted": s.level2_accepted, "level2_acceptance": s.level2_acceptance,
                         "level1_acceptance": s.level1_acceptance, "tokens_per_target_forward":
                         s.tokens_per_target_forward, "tokens_per_s": s.tokens_per_s, "answer": fin.text,
                         "passkey_in_answer": found, "prompt_tokens": s.prompt_tokens})
            print(f"{setting:<14} {kind:<10} level-2 acceptance {s.level2_acceptance:.2f} ({s.level2_accepted}/"
                  f"{s.level2_proposed})  passkey {'found' if found else 'missed'}: {fin.text!r}", flush=True)
    path = save("needle", {**environment(), "model": engine.info, "budget": args.budget, "drafter": args.drafter,
                           "repetition_penalty": args.repetition_penalty,
                           "question": QUESTION, "passkey": PASSKEY, "rows": rows})
    print(f"saved {path}")


if __name__ == "__main__":
    main()
