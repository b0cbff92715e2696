"""Offloaded KV cache on a GPU held to a memory budget (default 24 GiB, a consumer card): random weights at real
shapes through Engine.generate at ~128K context — offloaded AR against offloaded TriForce (T 0.6 / top-p 0.9 and
greedy), the pinned host->GPU bandwidth measured in the same run, the AR roofline (full KV bytes / that bandwidth),
acceptances beside every speed, and what the same run projects for a 25 GB/s (PCIe 4.0) link.

python -m bench.offload --tokenizer TOKENIZER [--gpu-memory-gib 24] [--context 131072] [--shapes 7b 8b]
    [--new-tokens 256] [--ar-tokens 16]
TOKENIZER: a preset id (smollm2-135m: the embedded model's), a saved Hugging Face tokenizer directory or hub
id (its vocabulary sizes the 7B shape's embedding; text comes from assets/docs).
Writes bench/results/offload-<gpu>.json with summary.offload.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import torch

from bench.common import (DOCS, LLAMA2_7B, LLAMA31_8B, LLAMA32_1B, LLAMA_68M, earlier_today, environment, merge_summary,
                          random_model, result_path, save, tokenizer_of)
from core import Engine, GenerationConfig
from core.cache import (ChunkIndex, OffloadedKVCache, chunks_to_keep, gather_selection, pinned_empty, retrieval_cache,
                        select_chunks)
from core.events import Finished, PlanChosen, StepTiming
from core.model import TORCH

INSTRUCTION = "Summarise what has happened so far, naming the main characters."
PCIE4_GB_S = 25.0
SHAPES = {"7b": (LLAMA2_7B, LLAMA_68M), "8b": (LLAMA31_8B, LLAMA32_1B)}  # target, level-1 draft (the paper's
# llama-68m beside Llama 2; Llama 3.2 1B beside Llama 3.1 8B)


def h2d_gb_s(gib: int = 2, reps: int = 10) -> float:
    """Page-locked host -> GPU copy bandwidth (GB/s), as the offloaded cache copies."""
    host = pinned_empty((gib << 30,), torch.uint8, True)
    dev = torch.empty(gib << 30, dtype=torch.uint8, device="cuda")
    dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    return reps * host.numel() / (time.perf_counter() - t0) / 1e9


def random_engine(name: str, tok, context: int, gpu_memory_gib: float) -> Engine:
    """An engine over random bf16 models of a shape pair, held to the GPU memory budget; a vocabulary smaller than
    the tokenizer's grows to it (the 7B shape: 32000 -> the tokenizer's size), and generation runs to max_new_tokens."""
    models = []
    for shape in SHAPES[name]:
        shape = {**shape, "vocab_size": max(shape["vocab_size"], len(tok)), "max_position_embeddings": context}
        models.append(random_model(shape))
        models[-1].eos_ids = set()
    torch.cuda.empty_cache()
    return Engine.from_models(models[0], tok, f"random {name} shape", models[1], f"random {name} draft shape",
                              context, gpu_memory_gib=gpu_memory_gib)


def document(tok, tokens: int) -> str:
    """About `tokens` tokens of the bundled texts, repeated as needed."""
    texts = [(DOCS / n).read_text() for n in ("pride_and_prejudice.txt", "us_constitution.txt", "gpl-3.0.txt")]
    ids: list[int] = []
    while len(ids) < tokens:
        ids += tok("\n\n".join(texts), add_special_tokens=False)["input_ids"]
    return tok.decode(ids[:tokens])


def run(engine: Engine, doc: str, cfg: GenerationConfig) -> dict:
    """One generation: its stats and the summed per-level times of its rounds."""
    levels = dict(level1_ms=0.0, level2_ms=0.0, level3_ms=0.0, selection_ms=0.0)
    fin, chosen, rounds = None, [], []
    retries = allocator_retries()
    for event in engine.generate(doc, INSTRUCTION, cfg):
        if isinstance(event, StepTiming):
            for key in levels:
                levels[key] += getattr(event, key)
            rounds.append([round(event.level2_ms, 1), round(event.level3_ms, 1), event.tokens, event.level2_forwards])
        elif isinstance(event, PlanChosen):
            chosen.append([event.round, event.plan, event.reason])
        elif isinstance(event, Finished):
            fin = event
    s = fin.stats
    out = {"method": s.method, "sampling": "greedy" if cfg.is_greedy else f"T{cfg.temperature}/top-p{cfg.top_p}",
           "prompt_tokens": s.prompt_tokens, "new_tokens": s.new_tokens, "ms_per_token": 1e3 / s.tokens_per_s,
           "prefill_s": s.prefill_s, "prefill_reused": s.prefill_reused, "offloaded": s.offloaded,
           "host_link_gb_per_token": s.host_link_bytes / s.new_tokens / 1e9,
           "level1_acceptance": s.level1_acceptance, "level2_acceptance": s.level2_acceptance,
           "tokens_per_target_forward": s.tokens_per_target_forward, "settings": s.settings, "plans": s.plans,
           "plan_log": chosen, "ahead_made": s.ahead_made, "ahead_kept": s.ahead_kept,
           # per round: level-2 and level-3 ms (what the round waited on), tokens emitted, its draft's level-2 forwards
           "rounds": rounds,
           # frees of the allocator's cached blocks to retry an allocation at the memory limit, each a device-wide
           # synchronisation (it would stall level 2 drafting ahead until level 3's pass ends)
           "allocator_retries": allocator_retries() - retries,
           **{k: v / max(s.new_tokens, 1) for k, v in levels.items()}, "token_ids": fin.token_ids}
    print(json.dumps({k: v for k, v in out.items() if k not in ("token_ids", "settings", "rounds")}), flush=True)
    return out


def allocator_retries() -> int:
    """How often the CUDA caching allocator has freed its cached blocks to retry an allocation (0 without CUDA)."""
    return torch.cuda.memory_stats().get("num_alloc_retries", 0) if torch.cuda.is_available() else 0


def projected_ms(row: dict, bw: float, to: float = PCIE4_GB_S) -> float:
    """ms/token with the host link at `to` GB/s instead of the measured `bw`: the transfer share rescaled."""
    return row["ms_per_token"] + row["host_link_gb_per_token"] * (1 / to - 1 / bw) * 1e3


def selection_cost(name: str, context: int, budget: int = 8192, chunk: int = 8) -> dict:
    """What choosing level 2's chunks costs with the full cache offloaded (the first selection, and each re-selection):
    building the chunk index (one streamed pass), scoring with the index in CPU or GPU memory, and gathering the
    chosen chunks (one streamed pass). Uninitialised host memory: copy times do not depend on values."""
    shape = SHAPES[name][0]
    layers, heads = shape["num_hidden_layers"], shape["num_key_value_heads"]
    dim = shape["hidden_size"] // shape["num_attention_heads"]
    full = OffloadedKVCache(layers, heads, dim, context + 64, torch.bfloat16, torch.device("cuda"))
    full.used = context
    out = {"shape": name, "context": context, "budget": budget}
    queries = torch.randn(layers, heads, dim, device="cuda")
    for where in ("cuda", "cpu"):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        index = ChunkIndex.build(full, context, chunk, torch.device(where))
        torch.cuda.synchronize()
        out[f"index_build_s_index_on_{where}"] = time.perf_counter() - t0
        n_select = chunks_to_keep(index.num_chunks, budget, index.chunk_size)
        select_chunks(index, queries, n_select)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        ids = select_chunks(index, queries, n_select)
        torch.cuda.synchronize()
        out[f"score_topk_ms_index_on_{where}"] = (time.perf_counter() - t0) * 1e3
    into = retrieval_cache(full, index, budget, 300)
    moved = full.moved
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    gather_selection(full, index, ids, into, TORCH)
    torch.cuda.synchronize()
    out["gather_s"] = time.perf_counter() - t0
    out["gather_gb_moved"] = (full.moved - moved) / 1e9
    print(json.dumps(out), flush=True)
    del full, index, into
    gc.collect()
    return out


def shape_run(name: str, tok, args, bw: float) -> dict:
    """AR then TriForce (sampled, greedy) on one shape, all offloaded within the budget."""
    engine = random_engine(name, tok, args.context + args.new_tokens + 1024, args.gpu_memory_gib)
    torch.cuda.reset_peak_memory_stats()
    # the app's warm-up: kernels compiled for every step shape method auto may use (its longest drafts too) and
    # the cost book filled, outside the timed runs
    engine.warm_up(args.new_tokens)
    warm_gib = {"allocated": torch.cuda.memory_allocated() / 2**30, "reserved": torch.cuda.memory_reserved() / 2**30}
    print(f"{name}: GPU memory after the warm-up runs {warm_gib}", flush=True)
    doc = document(tok, args.context - 200)
    t0 = time.perf_counter()  # the first run page-locks the host cache and prefills; the others reuse both
    sampled = run(engine, doc, GenerationConfig(method="triforce", temperature=0.6, top_p=0.9,
                                                max_new_tokens=args.new_tokens))
    first_run_s = time.perf_counter() - t0
    greedy = run(engine, doc, GenerationConfig(method="triforce", greedy=True, max_new_tokens=args.new_tokens))
    # what method auto will start from: the level-3 costs the engine's book holds by regime (offloaded, the prompt
    # length's bits, greedy) and rows, the warm-up's short document's among them
    book = {str(key[1]): {rows: statistics.median_low(w) for rows, w in samples.items()}
            for key, samples in engine.costs.steps.items() if key[0] == "level3"}
    auto = run(engine, doc, GenerationConfig(method="auto", temperature=0.6, top_p=0.9,
                                             max_new_tokens=args.new_tokens))
    ar = run(engine, doc, GenerationConfig(method="ar", greedy=True, max_new_tokens=args.ar_tokens))
    a = engine.target.args
    kv_bytes = 2 * a.n_layers * a.n_kv_heads * a.head_dim * 2 * ar["prompt_tokens"]
    result = {
        "shape": name, "target": engine.target.config.to_diff_dict(), "draft": engine.draft.config.to_diff_dict(),
        "gpu_memory_budget_gib": args.gpu_memory_gib, "peak_gpu_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
        "gpu_memory_after_warmup_gib": warm_gib,
        "full_kv_gb": kv_bytes / 1e9, "ar_roofline_ms": kv_bytes / bw / 1e6, "first_run_s": first_run_s,
        "greedy_identical": greedy["token_ids"][:len(ar["token_ids"])] == ar["token_ids"],
        "runs": [ar, sampled, greedy, auto], "level3_ms_before_auto": book}
    for r in result["runs"]:
        r["projected_ms_per_token_pcie4"] = projected_ms(r, bw)
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", required=True, help="a preset id (smollm2-135m), tokenizer directory or hub id")
    p.add_argument("--gpu-memory-gib", type=float, default=24.0)
    p.add_argument("--context", type=int, default=131072, help="prompt tokens (about)")
    p.add_argument("--shapes", nargs="+", default=["7b", "8b"], choices=sorted(SHAPES))
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--ar-tokens", type=int, default=16, help="AR tokens (each streams the whole cache)")
    p.add_argument("--parts", nargs="+", default=["runs", "selection"], choices=["runs", "selection"])
    args = p.parse_args()
    tok = tokenizer_of(args.tokenizer)
    bw = h2d_gb_s()
    print(f"pinned host->GPU {bw:.1f} GB/s", flush=True)
    selection = [selection_cost(name, args.context) for name in args.shapes] if "selection" in args.parts else []
    shapes = {name: shape_run(name, tok, args, bw) for name in args.shapes} if "runs" in args.parts else {}
    summary = {"h2d_gb_s": bw} if shapes else {}  # the bandwidth the runs' rooflines divide by
    planner = {}
    for name, r in shapes.items():
        ar, sampled, greedy, auto = r["runs"]
        planner[f"random_{name}_offload_128k"] = ar["ms_per_token"] / auto["ms_per_token"]
        planner.setdefault("choices", {})[f"random {name} offloaded 128K"] = auto["plans"]
        key = "7b_128k" if name == "7b" else "8b_gqa_128k"
        summary.update({f"ar_ms_{key}": ar["ms_per_token"], f"ar_roofline_ms_{key}": r["ar_roofline_ms"],
                        f"tf_ms_{key}": sampled["ms_per_token"], f"tf_greedy_ms_{key}": greedy["ms_per_token"],
                        f"speedup_{key}": ar["ms_per_token"] / sampled["ms_per_token"],
                        f"speedup_greedy_{key}": ar["ms_per_token"] / greedy["ms_per_token"],
                        f"l2_acceptance_{name}": sampled["level2_acceptance"],
                        f"l2_acceptance_greedy_{name}": greedy["level2_acceptance"],
                        f"greedy_identical_{name}": r["greedy_identical"],
                        f"speedup_{key}_pcie4_projected": ar["projected_ms_per_token_pcie4"] /
                        sampled["projected_ms_per_token_pcie4"],
                        f"speedup_auto_{key}": ar["ms_per_token"] / auto["ms_per_token"],
                        f"l2_acceptance_auto_{name}": auto["level2_acceptance"]})
    if shapes:
        summary["greedy_identical"] = all(r["greedy_identical"] for r in shapes.values())
    for r in selection:
        r["h2d_gb_s"] = bw
        summary[f"reselect_s_{r['shape']}"] = r["gather_s"] + r["score_topk_ms_index_on_cpu"] / 1e3
    name = "offload-" + torch.cuda.get_device_name().replace(" ", "-")
    old = earlier_today(result_path(name))  # an earlier run today: parts are merged
    env = environment()
    payload = {**old, **env, "gpu": torch.cuda.get_device_name(),
               "commands": old.get("commands", [old["command"]] if old else []) + [env["command"]],
               "summary": {"offload": {**old.get("summary", {}).get("offload", {}), **summary}},
               "shapes": {**old.get("shapes", {}), **shapes}, "selection": selection or old.get("selection", [])}
    print(json.dumps(summary, indent=1))
    print(f"saved {save(name, payload)}")
    if planner:
        print(f"planner figures merged into {merge_summary('planner', 'planner', planner)}")


if __name__ == "__main__":
    main()
