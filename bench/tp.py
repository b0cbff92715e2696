"""Tensor parallelism on GPUs. NOT RUN YET: written on a CPU-only machine (its CPU path is tested by
tests/test_parallel.py, not this script); no file in bench/results comes from it.

The Llama-2-7B shape with random bf16 weights at a ~128K-token random prompt (level 1: a random llama-68m shape,
whole on every rank), through Engine.generate_ids, with the full KV cache on-chip and offloaded: ms/token of AR
(greedy) and TriForce (greedy, and T 0.6 / top-p 0.9), with acceptances; under TP N also the all-reduce time of one decode step
(2 per layer over [rows, dim] bf16: 1 row for AR, γ2 + 1 for a level-3 verification) and, given TP 1's result file,
the scaling over it. Both runs launch decode steps eagerly (no CUDA graphs: tensor-parallel engines do not capture
them), so TP 1 and TP N compare like for like.

python -m bench.tp [--context 131072] [--new-tokens 128] [--ar-tokens 16]                      # TP 1, one GPU
torchrun --nproc-per-node 2 -m bench.tp --baseline bench/results/tp1-<gpu>.json          # TP 2
Writes bench/results/tp<N>-<gpu>.json (rank 0 prints and writes).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

from bench.common import LLAMA2_7B, LLAMA_68M, environment, random_model, save, sync_ms
from core import Engine, GenerationConfig
from core.events import Finished
from core.model import TensorParallel, joined, parallelize

RUNS = {  # name: settings; the AR runs generate --ar-tokens, the others --new-tokens
    "ar": dict(method="ar", greedy=True),
    "triforce_greedy": dict(greedy=True),
    "triforce_t0.6": dict(temperature=0.6, top_p=0.9),
}


class IdTokenizer:
    """Stands in for a tokenizer: the random models' ids are shown as numbers."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return " ".join(map(str, ids))


def random_engine(context: int, tp: TensorParallel | None) -> Engine:
    """Random Llama-2-7B and llama-68m shapes (the same weights on every rank: one seed), the target cut to this
    rank's shard under TP; no EOS, so every run generates its full length."""
    target = random_model({**LLAMA2_7B, "max_position_embeddings": context})
    draft = random_model(LLAMA_68M)
    target.eos_ids = set()
    if tp:
        parallelize(target, draft, tp)
    torch.cuda.empty_cache()
    return Engine.from_models(target, IdTokenizer(), "random Llama-2-7B shape", draft, "random llama-68m shape",
                              context, cuda_graphs=False)


def generate(engine: Engine, prompt: list[int], cfg: GenerationConfig) -> dict:
    """One generation's figures."""
    fin = next(e for e in engine.generate_ids(prompt, cfg) if isinstance(e, Finished))
    s = fin.stats
    return {"ms_per_token": 1e3 / s.tokens_per_s, "new_tokens": s.new_tokens, "prefill_s": s.prefill_s,
            "prefill_reused": s.prefill_reused, "offloaded": s.offloaded,
            "level1_acceptance": s.level1_acceptance, "level2_acceptance": s.level2_acceptance,
            "tokens_per_target_forward": s.tokens_per_target_forward, "token_ids": fin.token_ids}


def allreduce_ms(engine: Engine, rows: int) -> float:
    """Median time of the all-reduces of one forward of `rows` tokens (2 per layer, [rows, dim] in the model dtype)."""
    a = engine.target.args
    buf = torch.randn(rows, a.dim, dtype=engine.target.dtype, device=engine.target.device)
    return sync_ms(lambda: [dist.all_reduce(buf) for _ in range(2 * a.n_layers)], reps=50)


def measure(args: argparse.Namespace, engine: Engine, tp: TensorParallel | None) -> dict:
    """Every run at both placements, and under TP the all-reduce times; rank 0 prints as it goes."""
    prompt = torch.randint(0, 32000, (args.context,), generator=torch.Generator().manual_seed(0)).tolist()
    lengths = {name: args.ar_tokens if cfg.get("method") == "ar" else args.new_tokens for name, cfg in RUNS.items()}
    result: dict = {"world": tp.world if tp else 1, "context": args.context, "runs": {}}
    for offload in ("off", "on"):
        for cfg in RUNS.values():  # a short prompt first: kernels compile outside the timed runs
            generate(engine, prompt[:2048], GenerationConfig(**cfg, max_new_tokens=8, offload=offload))
        for name, cfg in RUNS.items():
            key = f"{name}_{'offloaded' if offload == 'on' else 'on_chip'}"
            row = generate(engine, prompt, GenerationConfig(**cfg, max_new_tokens=lengths[name], offload=offload))
            result["runs"][key] = row
            if not tp or tp.rank == 0:
                print(json.dumps({key: {k: v for k, v in row.items() if k != "token_ids"}}), flush=True)
    if tp:
        gamma2 = GenerationConfig().resolved(False).gamma2
        result["allreduce_ms_decode_step"] = allreduce_ms(engine, 1)
        result["allreduce_ms_level3_verify"] = allreduce_ms(engine, gamma2 + 1)
    result["peak_gpu_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--context", type=int, default=131072 - 256, help="prompt tokens")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--ar-tokens", type=int, default=16, help="AR tokens (an offloaded one streams the whole cache)")
    p.add_argument("--baseline", help="TP 1's result file: adds the scaling of each run over it")
    args = p.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    with contextlib.ExitStack() as stack:
        tp = stack.enter_context(joined("cuda")) if world > 1 else None
        engine = random_engine(args.context + args.new_tokens + 64, tp)
        with torch.inference_mode():
            result = measure(args, engine, tp)
    if tp and tp.rank:
        return
    if args.baseline:
        base = json.loads(Path(args.baseline).read_text())["runs"]
        result["speedup_over_tp1"] = {k: base[k]["ms_per_token"] / r["ms_per_token"] for k, r in
                                      result["runs"].items() if k in base}
        # bf16 partial sums added in another order: a near tie may go the other way, so reported, not asserted
        result["greedy_identical_to_tp1"] = all(base[k]["token_ids"] == r["token_ids"] for k, r in
                                                result["runs"].items() if k in base and "t0.6" not in k)
    path = save(f"tp{result['world']}-{torch.cuda.get_device_name().replace(' ', '-')}", {**environment(), **result})
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
