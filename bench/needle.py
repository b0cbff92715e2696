"""Needle in a haystack on the embedded model (CPU), the paper's Table 1 ablation: level-2 acceptance with the
retrieval cache vs a StreamingLLM cache of the same budget, greedy and at temperature 0.6 / top-p 0.9, and whether
the answer holds the passkey. The document is assets/docs/needle.txt, the text of haystack().

python -m bench.needle [--budget 256] [--new-tokens 16] [--drafter model]
"""

from __future__ import annotations

import argparse

from bench.acceptance import SETTINGS
from bench.common import DOCS, environment, finish, save
from core import Engine, GenerationConfig
from core.cache import LEVEL2_CACHES

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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--budget", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--drafter", default="model")
    p.add_argument("--repetition-penalty", type=float, default=GenerationConfig.repetition_penalty)
    args = p.parse_args()
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
