"""GPU benchmark at a model shape with random weights (Llama-2-7B unless --shape): per-token latency of our AR
(from CUDA graphs and eager), HF transformers AR, the HBM roofline, a level-3 verification, a level-2 step over a
budget-4096 retrieval cache, chunk selection, a level-1 step of a llama-68m-shape draft, and prefill; `prefill`
times the prefill chunking variants at the longest context.

python -m bench.gpu_synthetic [--parts synthetic prefill] [--contexts 32768 65536 122880] [--shape llama31_8b]
TRIFORCE_GEMV=0 swaps the Triton decode GEMV for cuBLAS. Writes bench/results/<gpu>.json (or --out).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from bench.common import (LLAMA_68M, SHAPES, GpuResults, ar_step_ms, draft_level, free, full_cache, gpu_main, hf_ar_ms,
                          random_dynamic_cache, random_hf_pair, random_model, shape_key, sync_ms, verify_step_ms)
from core.cache import ChunkIndex, chunks_to_keep, gather_selection, retrieval_cache, select_chunks
from core.decode import Graphs, Level
from core.engine import default_prefill_chunk
from core.model import TritonOps


def nbytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def synthetic(shape: dict, contexts: list[int], bw: float) -> dict:
    """Per-token latency of our AR, HF AR, roofline, levels, selection and prefill at each context."""
    hf, model = random_hf_pair(shape)
    a, ops, graphs = model.args, model.ops, Graphs()
    weight_bytes = nbytes(model)
    kv_per_token = 2 * a.n_layers * a.n_kv_heads * a.head_dim * 2
    draft = random_model(LLAMA_68M)
    d = draft.args
    draft_bytes = nbytes(draft)
    rows = []
    with torch.inference_mode():  # one-off kernel compilation is not prefill time
        list(Level(model, full_cache(model, 4096), []).prefill(list(range(4000)), default_prefill_chunk(model)))
    for ctx in contexts:
        row = {"context": ctx}
        full = full_cache(model, ctx + 64)
        level = Level(model, full, [], graphs)
        prompt = torch.randint(0, 32000, (ctx,)).tolist()
        with torch.inference_mode():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            list(level.prefill(prompt, default_prefill_chunk(model), record=1))  # as the engine prefills
            torch.cuda.synchronize()
            row["prefill_s"] = time.perf_counter() - t0
            queries = torch.stack([q[:, -1] for q in level.queries])  # the last prompt row's: the first selection
            row["ar_ms"] = ar_step_ms(level, prompt)
            row["ar_ms_eager"] = ar_step_ms(Level(model, full, level.tokens), prompt, reps=10)
            row["roofline_ms"] = (weight_bytes + ctx * kv_per_token) / bw * 1e3
            row["l3_verify_ms"] = verify_step_ms(level, prompt, 7)
            row["l3_roofline_ms"] = row["roofline_ms"]
            # level 2: retrieval cache at budget 4096, chunk 8; selection = scores + top-k + gather
            t0 = time.perf_counter()
            index = ChunkIndex.build(full, ctx, 8)
            torch.cuda.synchronize()
            row["chunk_index_s"] = time.perf_counter() - t0
            rcache = retrieval_cache(full, index, 4096, 300)
            n_select = chunks_to_keep(index.num_chunks, 4096, index.chunk_size)
            row["select_ms"] = sync_ms(lambda: select_chunks(index, queries, n_select), 10)
            ids = select_chunks(index, queries, n_select)
            row["gather_ms"] = sync_ms(lambda: gather_selection(full, index, ids, rcache, ops), 10)
            l2 = Level(model, rcache, prompt, graphs)
            row["l2_step_ms"] = ar_step_ms(l2, prompt)
            row["l2_verify3_ms"] = verify_step_ms(l2, prompt, 3)
            row["l2_roofline_ms"] = (weight_bytes + rcache.used * kv_per_token) / bw * 1e3
            # level 1: a llama-68m shape with a 256-token StreamingLLM cache
            l1 = draft_level(draft, graphs)
            list(l1.prefill(prompt[:256], 256))
            row["l1_step_ms"] = ar_step_ms(l1, prompt[:256])
            row["l1_roofline_ms"] = (draft_bytes + 256 * 2 * d.n_layers * d.n_kv_heads * d.head_dim * 2) / bw * 1e3
        del level, full, l1, l2, rcache, index
        free()
        cache = random_dynamic_cache(a, ctx)
        row["hf_ar_ms"] = hf_ar_ms(hf, cache)
        del cache
        free()
        rows.append(row)
        print(json.dumps(row), flush=True)
    del hf, model, draft
    free()
    return {"weight_bytes": weight_bytes, "kv_bytes_per_token": kv_per_token,
            "triton_gemv": isinstance(ops, TritonOps) and ops.gemv, "rows": rows}


def prefill_variants(shape: dict, ctx: int) -> dict:
    """Seconds to prefill ctx tokens: 8K chunks (bottom-right causal SDPA), or one chunk (plain causal SDPA) with
    PyTorch's backend order or with cuDNN attention first."""
    model = random_model(shape)
    level = Level(model, full_cache(model, ctx + 64), [])
    prompt = torch.randint(0, 32000, (ctx,)).tolist()
    cudnn_first = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                   SDPBackend.MATH]
    out = {}
    with torch.inference_mode():  # warm-up: kernels compiled and cuBLAS handles made before timing
        list(level.prefill(prompt[:16384], 8192))
    for name, chunk, backends in [("chunks_8192", 8192, None), ("one_chunk", ctx, None),
                                  ("one_chunk_cudnn_first", ctx, cudnn_first), ("chunks_8192_again", 8192, None)]:
        level.cache.truncate(0)
        level.tokens = []
        order = sdpa_kernel(backends, set_priority=True) if backends else contextlib.nullcontext()
        try:
            with torch.inference_mode(), order:
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                list(level.prefill(prompt, chunk))
                torch.cuda.synchronize()
            out[name] = time.perf_counter() - t0
        except RuntimeError as e:
            out[name] = f"failed: {str(e).splitlines()[0][:160]}"
        print(json.dumps({name: out[name]}), flush=True)
    del level, model
    free()
    return {"context": ctx, "seconds": out}


def synthetic_part(args: argparse.Namespace, results: GpuResults) -> None:
    key = shape_key("synthetic_7b", args.shape)
    syn = synthetic(SHAPES[args.shape], args.contexts, results.bandwidth())
    old = {r["context"]: r for r in results.data.get(key, {}).get("rows", [])}  # a rerun of some contexts
    syn["rows"] = sorted({**old, **{r["context"]: r for r in syn["rows"]}}.values(), key=lambda r: r["context"])
    results.data[key] = syn
    if args.shape == "llama2_7b":
        last = syn["rows"][-1]
        results.summary.update(ar_ms_120k=last["ar_ms"], hf_ar_ms_120k=last["hf_ar_ms"],
                               roofline_ms_120k=last["roofline_ms"], l2_step_ms=last["l2_step_ms"],
                               l2_roofline_ms=last["l2_roofline_ms"], prefill_120k_s=last["prefill_s"],
                               synthetic_context=last["context"])


def prefill_part(args: argparse.Namespace, results: GpuResults) -> None:
    results.data[shape_key("prefill_7b", args.shape)] = pf = prefill_variants(SHAPES[args.shape], args.contexts[-1])
    ok = {k: t for k, t in pf["seconds"].items() if isinstance(t, float)}
    if args.shape == "llama2_7b" and ok:
        best = min(ok, key=ok.get)
        results.summary.update(prefill_120k_s=ok[best], prefill_120k_variant=best)


PARTS = {"synthetic": synthetic_part, "prefill": prefill_part}

if __name__ == "__main__":
    gpu_main(__doc__, [sys.modules[__name__]])
