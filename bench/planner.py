"""Method auto against fixed TriForce and autoregressive decoding on the GPU's own memory, at the paper's scale:
random weights at the Llama-2-7B shape (level 1: a random llama-68m shape) over a ~120K-token prompt, through
Engine.generate, T 0.6 / top-p 0.9 and greedy, with acceptances and the plans auto chose. (Offloaded runs:
bench.offload; the real pair: bench.real.)

python -m bench.planner --tokenizer TOKENIZER [--context 122880] [--new-tokens 256]
TOKENIZER: a preset id (smollm2-135m: the embedded model's), a saved Hugging Face tokenizer directory or hub id (text
from assets/docs). Merges random_7b_onchip_120k into summary.planner of bench/results/planner.json and writes the
runs to bench/results/planner-runs-<gpu>.json.
"""

from __future__ import annotations

import argparse

import torch

from bench.common import LLAMA2_7B, LLAMA_68M, environment, merge_summary, random_model, save, tokenizer_of
from bench.offload import document, run
from core import Engine, GenerationConfig

SAMPLED = {"temperature": 0.6, "top_p": 0.9}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", required=True, help="a preset id (smollm2-135m), tokenizer directory or hub id")
    p.add_argument("--context", type=int, default=122880)
    p.add_argument("--new-tokens", type=int, default=256)
    args = p.parse_args()
    tok = tokenizer_of(args.tokenizer)
    models = []
    for shape in (LLAMA2_7B, LLAMA_68M):
        models.append(random_model({**shape, "vocab_size": max(shape["vocab_size"], len(tok))}))
        models[-1].eos_ids = set()
    engine = Engine.from_models(models[0], tok, "random 7b shape", models[1], "random 68m shape",
                                args.context + args.new_tokens + 1024)
    short = document(tok, 3000)  # kernels compiled and graphs captured outside the timed runs
    for method in ("ar", "triforce", "auto"):
        run(engine, short, GenerationConfig(method=method, max_new_tokens=32, **SAMPLED))
    engine.release()
    doc = document(tok, args.context - 200)
    runs = {}
    for sampling, settings in (("sampled", SAMPLED), ("greedy", {"greedy": True})):
        for method in ("ar", "triforce", "auto"):
            runs[f"{method} {sampling}"] = run(engine, doc, GenerationConfig(method=method,
                                                                             max_new_tokens=args.new_tokens,
                                                                             **settings))
    greedy_ids = {name: r.pop("token_ids") for name, r in runs.items() if name.endswith("greedy")}
    for r in runs.values():
        r.pop("token_ids", None)
    summary = {"random_7b_onchip_120k": runs["ar sampled"]["ms_per_token"] / runs["auto sampled"]["ms_per_token"],
               "choices": {"random 7b on-chip 120K": runs["auto sampled"]["plans"]}}
    out = {**environment(), "gpu": torch.cuda.get_device_name(), "context": args.context, "runs": runs,
           "speedup_triforce_sampled": runs["ar sampled"]["ms_per_token"] / runs["triforce sampled"]["ms_per_token"],
           "speedup_auto_greedy": runs["ar greedy"]["ms_per_token"] / runs["auto greedy"]["ms_per_token"],
           "greedy_identical": len({tuple(ids) for ids in greedy_ids.values()}) == 1, "summary": summary}
    print({k: v for k, v in out.items() if k != "runs"})
    print(f"saved {save('planner-runs-' + torch.cuda.get_device_name().replace(' ', '-'), out)}")
    print(f"planner figures merged into {merge_summary('planner', 'planner', summary)}")


if __name__ == "__main__":
    main()
