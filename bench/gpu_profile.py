"""GPU profile: where a decode step's time goes. Per-kernel device time of one AR step and one level-2 step (budget
4096) of a model with random weights, launched eagerly and replayed from a CUDA graph, beside the step's wall time:
`profile` at the --shape (Llama-2-7B) and the longest --contexts, `profile_small` at the SmolLM2-135M shape and the
longest --real-contexts; `profile_offload`: an offloaded AR step at the Qwen2.5-1.5B shape at each --real-contexts,
its host time beside its copies; `profile_draft`: a level-2 drafting step at that shape (budget 8192) taken apart
(graph replay, LM head, sampling, draw) and its projections' GEMVs against cuBLAS.

python -m bench.gpu_profile [--parts profile profile_small] [--contexts 122880] [--real-contexts 131072]
python -m bench.gpu_profile --parts steps [--tokenizer DIR] [--new-tokens 128]   (the step-cost table)
TRIFORCE_GEMV=0 swaps the Triton decode GEMV for cuBLAS. Writes bench/results/<gpu>.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter
from typing import Callable, Iterator

import torch

from bench.common import (BF16, DEV, SHAPES, SMOLLM2_135M, GpuResults, ar_step_ms, fill_random, free, full_cache,
                          gpu_main, random_model, random_retrieval, shape_key, sync_ms, tokenizer_of)
from core.cache import OffloadedKVCache
from core.decode import Graphs, Level


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


def profile_offload(ctx: int, shape: dict, new_tokens: int = 20) -> dict:
    """An eager offloaded AR step at a small real shape, taken apart: its first and steady wall time (2 and 4 staging
    buffers), the same copies alone, the resident step eager and from a CUDA graph, and the host (CPU) time the
    step's operators take, which the copies cannot hide when it exceeds them (why such steps replay from graphs)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile
    model = random_model(shape)
    a = model.args
    prompt = [100 + i % 30000 for i in range(ctx)]
    out: dict = {"context": ctx}
    with torch.inference_mode():
        for buffers in (2, 4):
            full = OffloadedKVCache(a.n_layers, a.n_kv_heads, a.head_dim, ctx + 64, model.dtype, DEV, buffers)
            full.k.normal_(), full.v.normal_()
            full.used = ctx
            level = Level(model, full, prompt)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            level.logits(prompt, 1, len(prompt), extra=[7])
            torch.cuda.synchronize()
            first = (time.perf_counter() - t0) * 1e3
            out[f"offload_b{buffers}"] = {"first_step_ms": first, "step_ms": ar_step_ms(level, prompt, new_tokens)}
            if buffers == 2:
                out["copies_only_ms"] = sync_ms(lambda: [None for _ in full.stream_layers(ctx)], 5)
                out["kv_gb"] = full.k[:, :, :ctx].nbytes * 2 / 1e9
                with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    for _ in range(3):
                        level.logits(prompt, 1, len(prompt), extra=[7])
                    torch.cuda.synchronize()
                rows = [{"op": e.key[:90], "cpu_us_per_step": e.self_cpu_time_total / 3, "per_step": e.count / 3,
                         "device_us_per_step": getattr(e, "self_device_time_total", 0) / 3}
                        for e in prof.key_averages()]
                rows.sort(key=lambda r: -r["cpu_us_per_step"])
                out["host_ms_per_step"] = sum(r["cpu_us_per_step"] for r in rows) / 1e3
                out["top_host"] = rows[:16]
                rows.sort(key=lambda r: -r["device_us_per_step"])
                out["top_device"] = rows[:8]
            print(json.dumps(out, indent=0)[:4000], flush=True)
            del level, full
            free()
        resident = full_cache(model, ctx + 64)
        fill_random(resident, ctx)
        for mode, graphs in (("eager", None), ("graph", Graphs())):
            out[f"resident_{mode}_ms"] = ar_step_ms(Level(model, resident, prompt, graphs), prompt, new_tokens)
    print({k: v for k, v in out.items() if not k.startswith("top")}, flush=True)
    del resident, model
    free()
    return out


def profile_offload_part(args: argparse.Namespace, results: GpuResults) -> None:
    results.data["profile_offload_qwen25_15b"] = [profile_offload(c, SHAPES["qwen25_15b"]) for c in args.real_contexts]


CHAIN = 8  # tokens level 2 drafts in the loop-against-chain timing


def profile_draft(ctx: int, shape: dict, budget: int = 8192, steps: int = 8) -> dict:
    """A level-2 drafting step at a real shape taken apart, as TriForce.draft_level2 takes it one token at a time:
    the graph replay alone, then with the LM head, the sampling distributions (greedy, and temperature 0.6 / top-p
    0.9) and the draw that brings the token to the host; a draft of CHAIN tokens a forward at a time against one
    chained on the device (TriForce.draft_alone), per token; a profile of `steps` sampled steps (wall against device
    time, top kernels and host operators); each projection's GEMV against cuBLAS from a CUDA graph; a layer's
    norm + q/k/v projection and feed-forward for one token as level 3 computes them and as a drafting level does."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile
    from triton.testing import do_bench_cudagraph

    from core.config import GenerationConfig
    from core.decode import distributions, draw, speculative_verify
    model = random_model(shape)
    full = full_cache(model, ctx + 2048)
    fill_random(full, ctx)
    prompt = [100 + i % 30000 for i in range(ctx)]
    gen = torch.Generator(DEV).manual_seed(0)
    out: dict = {"context": ctx, "budget": budget}
    with torch.inference_mode():
        _, rcache = random_retrieval(full, ctx, model.ops, budget=budget)
        level = Level(model, rcache, prompt, Graphs(), drafting=True)
        seq = prompt
        cfgs = {"greedy": GenerationConfig(temperature=0.0), "sampled": GenerationConfig(temperature=0.6, top_p=0.9)}

        def logits() -> torch.Tensor:
            return level.head(level.states(seq, 1, len(seq), [7]))

        def loop(cfg: GenerationConfig) -> None:  # level 2 drafting CHAIN tokens a forward at a time
            drafted: list[int] = []
            for _ in range(CHAIN):
                hidden = level.states(seq, 1, len(seq), [7, *drafted])
                drafted.append(int(draw(distributions(level.head(hidden), cfg)[0], gen)))  # a wait each

        def chain(cfg: GenerationConfig) -> None:  # ... and as TriForce.draft_alone does, waiting once
            hidden, ids = level.states(seq, 1, len(seq), [7]), []
            for i in range(CHAIN):
                if i:
                    hidden = level.follow(ids[-1])
                ids.append(draw(distributions(level.head(hidden), cfg)[0], gen))
            level.settle(torch.cat(ids).tolist()[:-1])

        stages = {"replay": lambda: level.states(seq, 1, len(seq), [7]), "replay_head": logits}
        for mode, cfg in cfgs.items():
            stages[f"{mode}_distributions"] = lambda cfg=cfg: distributions(logits(), cfg)
            stages[f"{mode}_step"] = lambda cfg=cfg: speculative_verify([], None, distributions(logits(), cfg), gen)
        out["stage_ms"] = {name: sync_ms(fn, 30, 5) for name, fn in stages.items()}
        for mode, cfg in cfgs.items():  # per token drafted
            out["stage_ms"][f"{mode}_loop_token"] = sync_ms(lambda cfg=cfg: loop(cfg), 20, 3) / CHAIN
            out["stage_ms"][f"{mode}_chain_token"] = sync_ms(lambda cfg=cfg: chain(cfg), 20, 3) / CHAIN
        print(out["stage_ms"], flush=True)
        step = stages["sampled_step"]
        torch.cuda.synchronize()
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            for _ in range(steps):
                step()
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) * 1e3 / steps
        events = prof.key_averages()
        kernels = [{"op": e.key[:80], "us_per_step": e.self_device_time_total / steps, "per_step": e.count / steps}
                   for e in events if getattr(e, "self_device_time_total", 0) > 0]
        kernels.sort(key=lambda r: -r["us_per_step"])
        host = [{"op": e.key[:80], "cpu_us_per_step": e.self_cpu_time_total / steps, "per_step": e.count / steps}
                for e in events]
        host.sort(key=lambda r: -r["cpu_us_per_step"])
        out["sampled_profile"] = {"wall_ms": wall, "device_ms": sum(k["us_per_step"] for k in kernels) / 1e3,
                                  "top_device": kernels[:16], "top_host": host[:12]}
        print(json.dumps(out["sampled_profile"], indent=0)[:3000], flush=True)
        a = model.args
        q_rows = a.n_heads * a.head_dim + 2 * a.n_kv_heads * a.head_dim
        shapes = {"qkv": (q_rows, a.dim), "o": (a.dim, a.n_heads * a.head_dim), "gate_up": (2 * a.intermediate_size,
                  a.dim), "down": (a.dim, a.intermediate_size), "lm_head": (a.vocab_size, a.dim)}
        gemvs = {}
        for name, (n, k) in shapes.items():
            w = torch.randn(n, k, device=DEV, dtype=BF16)
            for m in (1, 8):
                x = torch.randn(m, k, device=DEV, dtype=BF16)
                tri = do_bench_cudagraph(lambda: model.ops.k.gemv(x, w, None, None), rep=50)
                cub = do_bench_cudagraph(lambda: torch.nn.functional.linear(x, w), rep=50)
                gemvs[f"{name}_m{m}"] = {"n": n, "k": k, "triton_us": tri * 1e3, "cublas_us": cub * 1e3,
                                         "roofline_us": n * k * 2 / 4.8e12 * 1e6}
            del w
        out["gemv"] = gemvs
        # a one-token step's pre-norm projections as level 3 computes them and as a drafting level does (fused)
        block, x = model.layers[0], torch.randn(1, a.dim, device=DEV, dtype=BF16)
        att, ffn, norm1, norm2 = block.self_attn, block.mlp, block.input_layernorm, block.post_attention_layernorm
        fused = {}
        for kind, ops in (("invariant", model.ops), ("drafting", model.ops.drafting())):
            fused[f"norm_qkv_{kind}_us"] = 1e3 * do_bench_cudagraph(
                lambda: ops.normed_linear(x, norm1.weight, norm1.eps, att.wqkv, att.bqkv), rep=50)
            fused[f"mlp_{kind}_us"] = 1e3 * do_bench_cudagraph(
                lambda: ops.mlp(x, norm2.weight, norm2.eps, ffn.w13, ffn.down_proj.weight), rep=50)
        out["fused"] = fused
        print(json.dumps(gemvs, indent=0), fused, flush=True)
    del level, rcache, full, model
    free()
    return out


def profile_draft_part(args: argparse.Namespace, results: GpuResults) -> None:
    results.data["profile_draft_qwen25_15b"] = profile_draft(args.real_contexts[-1], SHAPES["qwen25_15b"])


# --- step costs through the engine's own loops ------------------------------------------------------------------------

SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")  # the host waits for the GPU
STEP_SINGLE = (30_000, 124_000)  # one request: the real pair's 32K window and the YaRN x4 preset's
STEP_BATCHED = ((1, 16_000), (2, 16_000), (4, 16_000), (8, 16_000), (1, 30_000), (2, 30_000), (4, 30_000),
                (8, 30_000))


def decode_window(events: Iterator, profiler=None) -> tuple[list, float, int]:
    """Drain one generation's events: its StepTiming events once its prefill is done, the wall seconds of its
    decoding, the tokens it emitted; `profiler` runs over the decoding alone (not the prefill)."""
    from core.events import Finished, PrefillProgress, StepTiming, Tokens
    timings, tokens, t0, t1 = [], 0, None, None
    for e in events:
        if isinstance(e, PrefillProgress) and e.done >= e.total and t0 is None:
            torch.cuda.synchronize()
            if profiler is not None:
                profiler.start()
            t0 = time.perf_counter()
        elif t0 is not None and isinstance(e, StepTiming):
            timings.append(e)
        elif t0 is not None and isinstance(e, Tokens):
            tokens += len(e.ids)
        elif t0 is not None and isinstance(e, Finished):
            torch.cuda.synchronize()
            t1 = time.perf_counter()
            if profiler is not None:
                profiler.stop()
    return timings, (t1 or time.perf_counter()) - (t0 or time.perf_counter()), tokens


def kernels(events) -> list:
    """The kernels among a profile's events (not its copies and fills)."""
    return [e for e in events if e.device_type.name == "CUDA" and not e.name.startswith(("Memcpy", "Memset"))]


def launch_counts(run: Callable[[object], tuple[list, float, int]]) -> dict:
    """Kernels launched and host waits per round and per token of a short profiled decode, and the share of its wall
    time the GPU spent in kernels (below 1: the device idled while the host prepared the next step)."""
    from torch.profiler import ProfilerActivity, profile as torch_profile
    prof = torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    timings, wall, tokens = run(prof)
    events = prof.events()
    launched = kernels(events)
    syncs = sum(1 for e in events if e.device_type.name == "CPU" and e.name in SYNC_CALLS)
    rounds = len({t.round for t in timings}) or 1
    per_kernel: Counter = Counter()
    for e in launched:
        per_kernel[e.name[:60]] += e.device_time_total
    host: Counter = Counter()
    for e in events:
        if e.device_type.name == "CPU":
            host[e.name[:60]] += e.self_cpu_time_total
    return {"kernels_per_round": len(launched) / rounds, "kernels_per_token": len(launched) / max(tokens, 1),
            "host_syncs_per_round": syncs / rounds, "host_syncs_per_token": syncs / max(tokens, 1),
            "gpu_busy_share": sum(per_kernel.values()) / 1e6 / wall if wall else None, "profiled_rounds": rounds,
            "top_kernels_us_per_round": {k: v / rounds for k, v in per_kernel.most_common(10)},
            "top_host_us_per_round": {k: v / rounds for k, v in host.most_common(10)}}


def level_costs(timings: list, roofline: dict) -> dict:
    """Median level-3 ms per round and level-2 ms per forward of a run (bench.batch.round_costs), each over its
    roofline."""
    from bench.batch import round_costs
    costs, out = round_costs(timings), {}
    for key, ms, roof in (("level3", costs["level3_ms"], "ar_roofline_ms"),
                          ("level2", costs["level2_step_ms"], "level2_roofline_ms")):
        if ms is not None:
            out |= {f"{key}_ms": ms, f"{key}_over_roofline": ms / roofline[roof]}
    out["tokens_per_round"] = statistics.mean(t.tokens for t in timings) if timings else None
    return out


def ragged_step_ms(model, caches: list, ops, reps: int = 20) -> tuple[float, float]:
    """One decode step of a batch, a row per cache, replayed from a CUDA graph as the engine's batch steps are, with
    its LM head and greedy tokens read back: its median ms and the kernels it launches."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    from core.cache.ragged import Ragged
    from core.decode.graphs import RaggedGraphs
    graphs = RaggedGraphs(Graphs())
    ids = torch.zeros(len(caches), dtype=torch.long)

    def step() -> None:
        hidden, _ = graphs.step(model, Ragged([(c, 1) for c in caches]), ids, 0, ops)
        model.head(hidden, ops).argmax(-1).tolist()
        for c in caches:  # the same lengths every step
            c.truncate(c.seq_len - 1)
    ms = sync_ms(step, reps)
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    return ms, len(kernels(prof.events())) / 5


def batch_steps(shape: dict, bandwidth: float, budget: int = 4096) -> dict:
    """Level 3's and level 2's batched decode step (a row per request; level 2 over each request's retrieval cache
    at `budget`, through the drafting operators) at STEP_BATCHED, each beside its memory roofline."""
    from core.cache.memory import kv_bytes_per_token
    model = random_model(shape)
    weights, token = model.step_weight_bytes(), kv_bytes_per_token(model)
    out = {}
    with torch.inference_mode():
        for count, length in STEP_BATCHED:
            fulls = [full_cache(model, length + 64) for _ in range(count)]
            for c in fulls:
                fill_random(c, length)
            retrieval = [random_retrieval(c, length, model.ops, budget=budget)[1] for c in fulls]
            ar_ms, ar_kernels = ragged_step_ms(model, fulls, model.ops)
            l2_ms, l2_kernels = ragged_step_ms(model, retrieval, model.ops.drafting())
            ar_roof = (weights + count * length * token) / bandwidth * 1e3
            l2_roof = (weights + sum(c.used for c in retrieval) * token) / bandwidth * 1e3
            row = out[f"{count}x{length // 1000}k"] = {
                "requests": count, "prompt_tokens": length, "ar_ms": ar_ms, "ar_roofline_ms": ar_roof,
                "ar_over_roofline": ar_ms / ar_roof, "ar_kernels": ar_kernels, "level2_ms": l2_ms,
                "level2_roofline_ms": l2_roof, "level2_over_roofline": l2_ms / l2_roof, "level2_kernels": l2_kernels}
            print(f"batch {count}x{length}", json.dumps(row), flush=True)
            del fulls, retrieval
            free()
    del model
    free()
    return out


def steps_part(args: argparse.Namespace, results: GpuResults) -> None:
    """Step costs of the real target's shape (Qwen2.5-1.5B, random weights: a step's cost does not depend on the
    values): one request at STEP_SINGLE through the engine's own loop, greedy, AR and TriForce (level 2 over the
    retrieval cache, no level 1), with kernels and host waits per round and the GPU's busy share; batched steps at
    STEP_BATCHED (batch_steps); each level's ms per step beside its memory roofline (the bandwidth measured in this
    run)."""
    from bench.batch import prompts, random_engine, rooflines
    from core.io.presets import YARN_X4
    tok = tokenizer_of(args.tokenizer)
    bandwidth = results.bandwidth()
    new = args.new_tokens
    out, shape = results.data.setdefault("steps_qwen25_15b", {}), SHAPES["qwen25_15b"]
    for length in STEP_SINGLE:
        rope = {"rope_parameters": {**shape["rope_parameters"], **dict(YARN_X4)}} if length > 32_768 else {}
        engine = random_engine(tok, length + new + 1024, {**shape, **rope})  # the 128K preset's scaling
        ids = prompts(tok, 1, length)[0]
        roof = rooflines(engine, 1, length, engine.settings().resolved(False).budget, bandwidth)
        row = out[f"1x{length // 1000}k{'_yarn' if rope else ''}"] = {"prompt_tokens": length, **roof}
        for method in ("ar", "triforce"):
            def run(profiler, tokens: int = new, method: str = method):
                cfg = engine.settings(method=method, greedy=True, drafter="none", max_new_tokens=tokens).validate()
                return decode_window(engine.generate_ids(ids, cfg), profiler)
            run(None, 24)  # graphs captured outside the timed runs
            timings, wall, tokens = run(None)
            row[method] = {"tokens_per_s": tokens / wall, **level_costs(timings, roof),
                           **launch_counts(lambda prof: run(prof, 24))}
        row["triforce_over_ar"] = row["triforce"]["tokens_per_s"] / row["ar"]["tokens_per_s"]
        print(length, json.dumps(row), flush=True)
        results.save()
        engine.release()
        del engine
        free()
    out["batched"] = batch_steps(shape, bandwidth)
    single, batched = out.get("1x30k", {}), out["batched"]
    results.summary.setdefault("real", {}).update({  # a step's cost does not depend on the weights' values
        "ar_over_roofline_30k": single.get("ar", {}).get("level3_over_roofline"),
        "level2_over_roofline_30k": single.get("triforce", {}).get("level2_over_roofline")})
    results.summary.setdefault("batch", {}).update({
        "real_batch_ar_over_roofline_8x30k": batched.get("8x30k", {}).get("ar_over_roofline")})


PARTS = {"profile": profile_part, "profile_small": profile_small_part, "profile_offload": profile_offload_part,
         "profile_draft": profile_draft_part, "steps": steps_part}

if __name__ == "__main__":
    gpu_main(__doc__, [sys.modules[__name__]])
