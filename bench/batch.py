"""Batched TriForce over batched autoregressive decoding: B requests of L prompt tokens each decoded together
(Engine.generate_many), throughput over all requests once every one has joined, each request's latency, level-2
acceptance beside every speed, peak memory, and whether each greedy answer equals its single-request one.

python -m bench.batch --parts cpu                 the embedded model on this CPU, 1 to 4 requests of 4K tokens
python -m bench.batch --parts random --tokenizer smollm2-135m [--settings 6x19k 2x56k 10x12k]
                                                  random weights at the Llama-2-7B shape on a GPU (the paper's Table 4)
python -m bench.batch --parts real --target qwen2.5-coder-1.5b [--settings 4x16k 8x30k]
                                                  the real Qwen2.5-Coder pair's target (docs/real-models.md)
python -m bench.batch --parts random-qwen --tokenizer smollm2-135m
                                                  random weights at that target's shape, 4x16k and 8x30k (speed only)
Writes bench/results/batch-<device>.json with summary.batch (a part run in another command the same day is kept).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from collections import Counter

import torch

from bench.common import (DOCS, LLAMA2_7B, QWEN25_15B, copy_bandwidth, earlier_today, environment, random_model,
                          result_path, save, tokenizer_of)
from core.cache.memory import kv_bytes_per_token
from core import Engine, GenerationConfig
from core.batching import Request
from core.events import Finished, PrefillProgress, StepTiming, Tokens

SETTINGS = {"6x19k": (6, 19_000), "2x56k": (2, 56_000), "10x12k": (10, 12_000), "4x16k": (4, 16_000),
            "8x30k": (8, 30_000), "1x4k": (1, 4_000), "2x4k": (2, 4_000), "4x4k": (4, 4_000)}
SAMPLED = {"temperature": 0.6, "top_p": 0.9}
INSTRUCTION = "Summarise the document so far."


def prompts(tok, count: int, length: int) -> list[list[int]]:
    """`count` different prompts of `length` token ids: the bundled documents' text, each request starting
    elsewhere in it."""
    text = "\n\n".join(p.read_text() for p in sorted(DOCS.iterdir()) if p.is_file())
    ids = tok(text, add_special_tokens=False)["input_ids"]
    while len(ids) < length * 2:
        ids = ids + ids
    step = max(1, (len(ids) - length) // max(count, 1))
    return [ids[i * step:i * step + length] for i in range(count)]


def batch_run(engine: Engine, ids: list[list[int]], cfg: GenerationConfig, slots: int) -> dict:
    """One batch to the end: throughput over the span where every request decodes (from the last join to the
    last token), each request's figures."""
    requests = [Request(str(i), ids=p, config=cfg) for i, p in enumerate(ids)]
    joined, finished, tokens, timings, first = set(), {}, [], [], []
    t_all, captured = None, 0.0
    t0 = time.perf_counter()
    for tagged in engine.generate_many(requests, slots):
        e = tagged.event
        if isinstance(e, PrefillProgress) and e.done >= e.total:
            joined.add(tagged.key)
            if len(joined) == len(requests):
                t_all, captured = time.perf_counter(), capture_s(engine)
        elif isinstance(e, Tokens) and t_all is not None:
            tokens.append(len(e.ids))
        elif isinstance(e, StepTiming) and t_all is not None:
            timings.append(e)  # every request's copy of the batch's round (their medians are the batch's)
            if tagged.key == "0":
                first.append(e)
        elif isinstance(e, Finished):
            finished[tagged.key] = e
    t_end = time.perf_counter()
    runs = [finished[str(i)] for i in range(len(ids))]
    span = t_end - (t_all or t0) - (capture_s(engine) - captured)  # a composition's first step is captured
    verified = sum(f.stats.level2_verified for f in runs)
    return {"method": cfg.method, "greedy": cfg.is_greedy, "requests": len(ids), "prompt_tokens": len(ids[0]),
            "new_tokens": [f.stats.new_tokens for f in runs], "tokens_per_s": sum(tokens) / span if span else 0.0,
            "latency_s": [f.stats.decode_s for f in runs], "prefill_s": [f.stats.prefill_s for f in runs],
            "level2_acceptance": sum(f.stats.level2_accepted for f in runs) / verified if verified else None,
            "plans": runs[0].stats.plans, "wall_s": t_end - t0, "token_ids": [f.token_ids for f in runs],
            "shared_with": [f.stats.shared_with for f in runs], **round_costs(timings),
            # the first request's rounds while every request decodes: level-2 and level-3 ms, its tokens, level-2 steps
            "trace": [[round(t.level2_ms, 3), round(t.level3_ms, 3), t.tokens, t.level2_forwards] for t in first]}


def round_costs(timings: list[StepTiming]) -> dict:
    """The batch's rounds while every request decodes: about how many, level 3's milliseconds and level 2's per
    step."""
    drafting = [t for t in timings if t.level2_forwards]
    return {"rounds": max(Counter(t.round for t in timings).values(), default=0),
            "level3_ms": statistics.median(t.level3_ms for t in timings) if timings else None,
            "level2_step_ms": statistics.median(t.level2_ms / t.level2_forwards for t in drafting) if drafting
            else None,
            "level2_steps": statistics.median(t.level2_forwards for t in drafting) if drafting else None}


def capture_s(engine: Engine) -> float:
    """Seconds the engine has spent capturing CUDA graphs (a batch's new compositions): warm-up, not decoding."""
    return engine.graphs.capture_s if engine.graphs is not None else 0.0


def single_ids(engine: Engine, ids: list[int], cfg: GenerationConfig) -> list[int]:
    """A request's answer decoded alone (autoregressive, greedy)."""
    return next(e for e in engine.generate_ids(ids, cfg) if isinstance(e, Finished)).token_ids


RUNS = {"ar": {"method": "ar", "greedy": True}, "triforce": {"method": "triforce", "greedy": True},
        "auto": {"method": "auto", "greedy": True}, "ar_sampled": {"method": "ar", **SAMPLED},
        "triforce_sampled": {"method": "triforce", **SAMPLED}, "auto_sampled": {"method": "auto", **SAMPLED}}
DEFAULT_RUNS = ["ar", "triforce", "auto", "ar_sampled", "auto_sampled"]


def rooflines(engine: Engine, count: int, length: int, budget: int, bandwidth: float | None) -> dict:
    """What a batch's steps must read at the least, over the device's copy bandwidth (measured in the same run): an
    autoregressive step the weights once and every request's full cache, a level-2 step the weights once and every
    request's retrieval cache; None on a CPU."""
    if bandwidth is None:
        return {}
    weights, token = engine.target.step_weight_bytes(), kv_bytes_per_token(engine.target)
    return {"copy_bandwidth_tb_s": bandwidth / 1e12,
            "ar_roofline_ms": (weights + count * length * token) / bandwidth * 1e3,
            "level2_roofline_ms": (weights + count * min(budget, length) * token) / bandwidth * 1e3}


def setting_run(engine: Engine, tok, name: str, new_tokens: int, check: int, fixed: dict | None = None,
                labels: list[str] = DEFAULT_RUNS, bandwidth: float | None = None) -> dict:
    """AR, TriForce and auto batched on one setting, greedy and sampled; `check` requests' greedy answers compared
    with their single-request ones."""
    count, length = SETTINGS[name]
    ids = prompts(tok, count, length)
    if engine.target.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    runs = {}
    for label in labels:
        settings = {**RUNS[label], **(fixed if label.startswith("triforce") else {})}
        cfg = engine.settings(max_new_tokens=new_tokens, drafter="none", **settings).validate()  # the preset's
        runs[label] = batch_run(engine, ids, cfg, count)
        r = runs[label]
        print(f"{name} {label}: {r['tokens_per_s']:.1f} tokens/s, acceptance {r['level2_acceptance']}, rounds "
              f"{r['rounds']}, level 3 {r['level3_ms']} ms, level 2 {r['level2_step_ms']} ms x {r['level2_steps']}, "
              f"plans {r['plans'][:4]}", flush=True)
        gc.collect()
    greedy_ar = engine.settings(max_new_tokens=new_tokens, method="ar", greedy=True).validate()
    greedy = [label for label in ("triforce", "auto") if label in runs]
    identical = [all(single_ids(engine, ids[i], greedy_ar) == runs[label]["token_ids"][i] for label in greedy)
                 for i in range(min(check, count))] if greedy else []
    speed = {label: r["tokens_per_s"] for label, r in runs.items()}
    ratios = {f"speedup_{label}": speed[label] / speed["ar_sampled" if label.endswith("sampled") else "ar"]
              for label in speed if not label.startswith("ar") and
              ("ar_sampled" if label.endswith("sampled") else "ar") in speed}
    roof = rooflines(engine, count, length, engine.settings(**(fixed or {})).resolved(False).budget, bandwidth)
    if roof and runs.get("ar", {}).get("level3_ms"):
        roof["ar_over_roofline"] = runs["ar"]["level3_ms"] / roof["ar_roofline_ms"]
    drafting = [r["level2_step_ms"] for r in runs.values() if r.get("level2_step_ms") and r["greedy"]]
    if roof and drafting:
        roof["level2_over_roofline"] = min(drafting) / roof["level2_roofline_ms"]
    out = {"setting": name, "requests": count, "prompt_tokens": length, "runs": runs, **ratios, **roof,
           "greedy_identical": identical, "settings": fixed or {},
           "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if engine.target.device.type == "cuda" else None}
    for r in runs.values():
        del r["token_ids"]
    print(json.dumps({k: v for k, v in out.items() if k != "runs"}), flush=True)
    return out


def warm(engine: Engine, tok) -> None:
    """Kernels compiled and tuned outside the timed runs: a short batch of each method, greedy and sampled."""
    ids = prompts(tok, 2, 1000)
    for settings in ({"method": "ar", "greedy": True}, {"method": "triforce", "greedy": True},
                     {"method": "auto", **SAMPLED}):
        cfg = engine.settings(max_new_tokens=40, drafter="none", **settings).validate()
        batch_run(engine, ids, cfg, 2)


SHAPES = {"random": ("random_7b_", LLAMA2_7B, ["6x19k", "2x56k", "10x12k"]),
          "random-qwen": ("random_qwen15_", QWEN25_15B, ["4x16k", "8x30k"])}  # the real pair's target's shape


def random_engine(tok, context: int, shape: dict) -> Engine:
    """Random bf16 weights at a model's shape (its vocabulary grown to the tokenizer's), no draft model."""
    shape = {**shape, "vocab_size": max(shape["vocab_size"], len(tok)), "max_position_embeddings": context}
    model = random_model(shape)
    model.eos_ids = set()
    return Engine.from_models(model, tok, "random 7b shape", None, None, context)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", nargs="+", default=["cpu"], choices=["cpu", *SHAPES, "real"])
    p.add_argument("--settings", nargs="+", choices=sorted(SETTINGS))
    p.add_argument("--tokenizer", default="smollm2-135m")
    p.add_argument("--target", help="the real target (a .gguf or preset id)")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--check", type=int, default=2, help="requests per setting compared with their single answers")
    p.add_argument("--budget", type=int, help="the TriForce runs' retrieval budget (default: the engine's)")
    p.add_argument("--gamma2", type=int, help="the TriForce runs' γ2 (default: the engine's)")
    p.add_argument("--runs", nargs="+", default=DEFAULT_RUNS, choices=sorted(RUNS))
    args = p.parse_args()
    results, summary = {}, {}
    bandwidth = copy_bandwidth() if torch.cuda.is_available() else None
    for part in args.parts:
        if part == "cpu":
            engine = Engine.load(None, "none")
            settings = args.settings or ["1x4k", "2x4k", "4x4k"]
            tok = engine.tokenizer
        elif part in SHAPES:
            tok = tokenizer_of(args.tokenizer)
            settings = args.settings or SHAPES[part][2]
            engine = random_engine(tok, max(SETTINGS[s][1] for s in settings) + args.new_tokens + 1024,
                                   SHAPES[part][1])
        else:
            engine = Engine.load(args.target, "none")
            settings = args.settings or ["4x16k", "8x30k"]
            tok = engine.tokenizer
        warm(engine, tok)
        for name in settings:
            fixed = {k: v for k, v in (("budget", args.budget), ("gamma2", args.gamma2)) if v}
            r = results[f"{part}_{name}"] = setting_run(engine, tok, name, args.new_tokens, args.check, fixed,
                                                        args.runs, bandwidth)
            key = {"cpu": "cpu_embedded_", "real": "real_", **{k: v[0] for k, v in SHAPES.items()}}[part] + name
            if part != "cpu" or name == "4x4k":
                summary[key.replace("4x4k", "4")] = r.get("speedup_auto")
            if part == "real":
                summary[f"{key}_sampled"] = r.get("speedup_auto_sampled")
                summary[f"real_batch_ar_over_roofline_{name}"] = r.get("ar_over_roofline")
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    device = torch.cuda.get_device_name().replace(" ", "-") if torch.cuda.is_available() else "cpu"
    old, env = earlier_today(result_path("batch-" + device)), environment()  # today's other parts are kept
    commands = old.get("commands", [old["command"]] if old else []) + [env["command"]]
    payload = {**env, "gpu": device, "commands": commands,
               "summary": {"batch": {**old.get("summary", {}).get("batch", {}), **summary}},
               "results": {**old.get("results", {}), **results}}
    print(json.dumps(summary, indent=1))
    print(f"saved {save('batch-' + device, payload)}")


if __name__ == "__main__":
    main()
