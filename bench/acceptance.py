"""Level-1 acceptance (tokens accepted by level 2 / tokens proposed by level 1) of the model drafter vs the ngram
drafter, on documents the draft was not trained on, greedy and at temperature 0.6 / top-p 0.9.

python -m bench.acceptance [--new-tokens 48] [--target PATH --draft DIR --name NAME] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.common import DOCS, drafter_settings, environment, finish, save
from core import Engine, GenerationConfig
from core.io import held_out_documents, sample_instructions

SETTINGS = {"greedy": {"greedy": True}, "T0.6/top-p0.9": {"temperature": 0.6, "top_p": 0.9}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--target", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--draft", default=None, help="default: the target's shipped draft (assets/draft)")
    p.add_argument("--device", default=None)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--documents", nargs="+", default=held_out_documents())
    p.add_argument("--drafters", nargs="+", default=["model", "model:0.5", "ngram"])
    p.add_argument("--seeds", type=int, default=1, help="sampled runs per instruction at T=0.6")
    p.add_argument("--name", default="acceptance", help="results file name (bench/results/NAME.json)")
    p.add_argument("--out", default=None, help="also write the JSON here")
    args = p.parse_args()
    engine = Engine.load(args.target, args.draft, args.device)
    samples = sample_instructions()
    totals = {(s, d): [0, 0, 0, 0] for s in SETTINGS for d in args.drafters}  # proposed, accepted, tokens, fwd
    runs = []
    for name in args.documents:
        doc = (DOCS / name).read_text()
        for instruction in samples[name]:
            for setting, sampling in SETTINGS.items():
                for seed in range(1 if "greedy" in sampling else args.seeds):
                    for spec in args.drafters:  # "model:0.5": the model drafter gated at draft confidence 0.5
                        cfg = GenerationConfig(max_new_tokens=args.new_tokens, seed=seed, **drafter_settings(spec),
                                               **sampling)
                        s = finish(engine, doc, instruction, cfg).stats
                        t = totals[(setting, spec)]
                        for i, v in enumerate((s.level1_proposed, s.level1_accepted, s.new_tokens,
                                               s.target_forwards)):
                            t[i] += v
                        runs.append({"document": name, "instruction": instruction, "setting": setting,
                                     "seed": seed, "drafter": spec, "prompt_tokens": s.prompt_tokens,
                                     "new_tokens": s.new_tokens, "level1_proposed": s.level1_proposed,
                                     "level1_accepted": s.level1_accepted,
                                     "level2_acceptance": s.level2_acceptance,
                                     "tokens_per_target_forward": s.tokens_per_target_forward})
                        print(f"{name[:28]:<28} {setting:<14} {spec:<9} {s.level1_accepted:>4}/"
                              f"{s.level1_proposed:<4} {s.level1_acceptance:.3f}", flush=True)
    summary = [{"setting": s, "drafter": d, "level1_proposed": t[0], "level1_accepted": t[1],
                "level1_acceptance": t[1] / t[0] if t[0] else 0.0, "new_tokens": t[2],
                "tokens_per_target_forward": t[2] / t[3] if t[3] else 0.0} for (s, d), t in totals.items()]
    payload = {"environment": environment(), "engine": engine.info, "documents": args.documents,
               "new_tokens": args.new_tokens, "gamma1": GenerationConfig().gamma1, "summary": summary, "runs": runs}
    path = save(args.name, payload)
    if args.out:
        Path(args.out).write_text(json.dumps(payload, indent=2) + "\n")
    print(f"\nlevel-1 acceptance on held-out documents {', '.join(args.documents)} ({args.new_tokens} new tokens "
          f"per instruction) -> {path}")
    print(f"{'setting':<14} {'drafter':<9} {'accepted/proposed':>18} {'acceptance':>10} {'tok/fwd':>8}")
    for r in summary:
        print(f"{r['setting']:<14} {r['drafter']:<9} {r['level1_accepted']:>8}/{r['level1_proposed']:<9} "
              f"{r['level1_acceptance']:>10.3f} {r['tokens_per_target_forward']:>8.2f}")


if __name__ == "__main__":
    main()
