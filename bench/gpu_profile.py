"""GPU profile: where a decode step's time goes. Per-kernel device time of one AR step and one level-2 step (budget
4096) of a model with random weights, launched eagerly and replayed from a CUDA graph, beside the step's wall time:
`profile` at the --shape (Llama-2-7B) and the longest --contexts, `profile_small` at the SmolLM2-135M shape and the
longest --real-contexts.

python -m bench.gpu_profile [--parts profile profile_small] [--contexts 122880] [--real-contexts 131072]
TRIFORCE_GEMV=0 swaps the Triton decode GEMV for cuBLAS. Writes bench/results/<gpu>-<date>.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from bench.common import (SHAPES, SMOLLM2_135M, GpuResults, ar_step_ms, fill_random, free, full_cache, gpu_main,
                          random_model, random_retrieval, shape_key)
from core.cuda_graphs import Graphs
from core.levels import Level


def profile(ctx: int, shape: dict) -> dict:
    """Per-kernel device time of an AR and a level-2 step, eager and from a CUDA graph (top 14 kernels each)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile
    model = random_model(shape)
    full = full_cache(model, ctx + 2048)
    fill_random(full, ctx)
    prompt = [100 + i % 30000 for i in range(ctx)]
    out = {"context": ctx}
    with torch.inference_mode():
        index, rcache = random_retrieval(full, ctx, model.ops)
        for name, cache in (("ar", full), ("l2", rcache)):
            for mode, graphs in (("eager", None), ("graph", Graphs())):
                level = Level(model, cache, prompt, graphs)
                wall = ar_step_ms(level, prompt, reps=10)
                with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(5):
                        level.logits(prompt, 1, len(prompt), extra=[7])
                    torch.cuda.synchronize()
                rows = []
                for e in prof.key_averages():
                    us = getattr(e, "device_time_total", 0)
                    if us > 0 and e.count:
                        rows.append({"kernel": e.key[:90], "us_per_step": us / 5, "per_step": e.count / 5})
                rows.sort(key=lambda r: -r["us_per_step"])
                total = sum(r["us_per_step"] for r in rows)
                key = f"{name}_{mode}"
                out[key] = {"wall_ms": wall, "kernel_ms": total / 1e3,
                            "kernels_per_step": sum(r["per_step"] for r in rows), "top": rows[:14]}
                print(key, json.dumps(out[key], indent=0), flush=True)
    del full, rcache, index, model
    free()
    return out


def profile_part(args: argparse.Namespace, results: GpuResults) -> None:
    results.data[shape_key("profile_7b", args.shape)] = profile(args.contexts[-1], SHAPES[args.shape])


def profile_small_part(args: argparse.Namespace, results: GpuResults) -> None:
    results.data["profile_smollm2_shape"] = profile(args.real_contexts[-1], SMOLLM2_135M)


PARTS = {"profile": profile_part, "profile_small": profile_small_part}

if __name__ == "__main__":
    gpu_main(__doc__, [sys.modules[__name__]])
