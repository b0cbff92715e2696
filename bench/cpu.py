"""CPU benchmark on the embedded model: AR vs TriForce tokens/s and acceptance per level, per drafter.

python -m bench.cpu [--contexts 2048 8000] [--new-tokens 64] [--drafters model ngram none]
"""

from __future__ import annotations

import argparse

from bench.common import document_of, environment, finish, save
from core import Engine, GenerationConfig

INSTRUCTION = "Summarise what has happened so far, naming the main characters."


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--contexts", type=int, nargs="+", default=[2048, 8000])
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--drafters", nargs="+", default=["model", "ngram", "none"])
    p.add_argument("--document", default="pride_and_prejudice.txt")
    p.add_argument("--budget", type=int, default=1024)
    args = p.parse_args()
    engine = Engine.load()
    drafters = [d for d in args.drafters if d != "model" or engine.draft is not None]
    rows = []
    for context in args.contexts:
        doc = document_of(engine, args.document, context)
        for sampling in ({"greedy": True}, {"temperature": 0.6, "top_p": 0.9}):
            base = dict(max_new_tokens=args.new_tokens, budget=args.budget, seed=0, **sampling)
            ar = finish(engine, doc, INSTRUCTION, GenerationConfig(method="ar", **base)).stats
            rows.append({"context": ar.prompt_tokens, "method": "ar", "drafter": None, **sampling,
                         "tokens_per_s": ar.tokens_per_s, "new_tokens": ar.new_tokens, "prefill_s": ar.prefill_s})
            print(f"{ar.prompt_tokens:>6} {'ar':>9} {str(sampling):>34} {ar.tokens_per_s:6.2f} tok/s")
            for drafter in drafters:
                cfg = GenerationConfig(method="triforce", drafter=drafter, **base)
                s = finish(engine, doc, INSTRUCTION, cfg).stats
                rows.append({"context": s.prompt_tokens, "method": "triforce", "drafter": drafter, **sampling,
                             "tokens_per_s": s.tokens_per_s, "speedup": s.tokens_per_s / ar.tokens_per_s,
                             "new_tokens": s.new_tokens, "level1_acceptance": s.level1_acceptance,
                             "level2_acceptance": s.level2_acceptance,
                             "tokens_per_target_forward": s.tokens_per_target_forward})
                print(f"{s.prompt_tokens:>6} {drafter:>9} {str(sampling):>34} {s.tokens_per_s:6.2f} tok/s "
                      f"x{s.tokens_per_s / ar.tokens_per_s:.2f}  L1 {s.level1_acceptance:.2f} "
                      f"L2 {s.level2_acceptance:.2f}  {s.tokens_per_target_forward:.2f} tok/fwd")
    path = save("cpu", {**environment(), "model": engine.info, "budget": args.budget, "rows": rows})
    print(f"saved {path}")


if __name__ == "__main__":
    main()
