"""CPU benchmark on the embedded model: AR vs TriForce tokens/s, acceptance per level and the cost of one level-1
and one level-2 step, per drafter ("model:0.4" = the model drafter gated at draft confidence 0.4).

python -m bench.cpu [--contexts 2048 8000] [--new-tokens 64] [--drafters model model:0.4 ngram none] [--draft DIR]
"""

from __future__ import annotations

import argparse

from bench.common import INSTRUCTION, document_of, drafter_settings, environment, finish, save
from core import Engine, GenerationConfig
from core.events import Finished, StepTiming, Verdict


def timed(engine: Engine, doc: str, cfg: GenerationConfig) -> tuple[Finished, float, float]:
    """A TriForce run with the mean wall time of one level-1 step (a draft-model forward) and of one level-2 step."""
    l1_ms = l2_ms = 0.0
    l2_steps, fin = 0, None
    for e in engine.generate(doc, INSTRUCTION, cfg):
        if isinstance(e, StepTiming):
            l1_ms, l2_ms = l1_ms + e.level1_ms, l2_ms + e.level2_ms
        elif isinstance(e, Verdict) and e.level == 2:
            l2_steps += 1
        elif isinstance(e, Finished):
            fin = e
    steps = fin.stats.level1_steps
    return fin, l1_ms / steps if steps else 0.0, l2_ms / max(1, l2_steps)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--contexts", type=int, nargs="+", default=[2048, 8000])
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--drafters", nargs="+", default=["model", "model:0.4", "ngram", "none"])
    p.add_argument("--document", default="pride_and_prejudice.txt")
    p.add_argument("--budget", type=int, default=1024)
    p.add_argument("--draft", default=None, help="default: the embedded target's shipped draft (assets/draft)")
    p.add_argument("--name", default=None, help="results file name (default: cpu-budget<budget>)")
    args = p.parse_args()
    engine = Engine.load(None, args.draft)
    drafters = [d for d in args.drafters if not d.startswith("model") or engine.draft is not None]
    rows = []
    for context in args.contexts:
        doc = document_of(engine, args.document, context)
        for sampling in ({"greedy": True}, {"temperature": 0.6, "top_p": 0.9}):
            base = dict(max_new_tokens=args.new_tokens, budget=args.budget, seed=0, **sampling)
            ar = finish(engine, doc, INSTRUCTION, GenerationConfig(method="ar", **base)).stats
            rows.append({"context": ar.prompt_tokens, "method": "ar", "drafter": None, **sampling,
                         "tokens_per_s": ar.tokens_per_s, "new_tokens": ar.new_tokens, "prefill_s": ar.prefill_s})
            print(f"{ar.prompt_tokens:>6} {'ar':>9} {str(sampling):>34} {ar.tokens_per_s:6.2f} tok/s")
            for spec in drafters:
                cfg = GenerationConfig(method="triforce", **drafter_settings(spec), **base)
                fin, l1_ms, l2_ms = timed(engine, doc, cfg)
                s = fin.stats
                rows.append({"context": s.prompt_tokens, "method": "triforce", "drafter": spec, **sampling,
                             "tokens_per_s": s.tokens_per_s, "speedup": s.tokens_per_s / ar.tokens_per_s,
                             "new_tokens": s.new_tokens, "level1_proposed": s.level1_proposed,
                             "level1_acceptance": s.level1_acceptance, "level2_acceptance": s.level2_acceptance,
                             "tokens_per_target_forward": s.tokens_per_target_forward,
                             "level1_step_ms": l1_ms, "level2_step_ms": l2_ms})
                ratio = f"L1/L2 step {l1_ms / l2_ms:.2f}" if l1_ms else ""
                print(f"{s.prompt_tokens:>6} {spec:>9} {str(sampling):>34} {s.tokens_per_s:6.2f} tok/s "
                      f"x{s.tokens_per_s / ar.tokens_per_s:.2f}  L1 {s.level1_acceptance:.2f} "
                      f"L2 {s.level2_acceptance:.2f}  {s.tokens_per_target_forward:.2f} tok/fwd {ratio}", flush=True)
    path = save(args.name or f"cpu-budget{args.budget}",
                {**environment(), "model": engine.info, "budget": args.budget, "rows": rows})
    print(f"saved {path}")


if __name__ == "__main__":
    main()
