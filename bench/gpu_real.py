"""GPU benchmark on the real embedded model (SmolLM2-135M-Instruct, RoPE-scaled to long contexts): AR vs TriForce
end to end with real acceptance, and HF transformers AR on the same weights (`real`); tokens/s and acceptance for
each retrieval budget x re-selection (`sweep`); and the real run's accept/reject trace replayed on a model shape
with random weights, Llama-2-7B unless --shape (`replay`, which reads the `real` part's traces from the result file).

python -m bench.gpu_real [--parts real sweep replay] [--real-contexts 32768 65536 131072] [--draft assets/draft]
    [--budget 4096] [--reselect once] [--gguf PATH (default: the embedded GGUF)]
Writes bench/results/<gpu>.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from transformers import AutoModelForCausalLM

from bench.common import (BF16, DEV, INSTRUCTION, LLAMA_68M, SHAPES, GpuResults, ar_step_ms, document_of, draft_level,
                          fill_random, finish, free, full_cache, gpu_main, hf_ar_ms, random_dynamic_cache, random_model,
                          random_retrieval, shape_key)
from core import Engine, GenerationConfig
from core.decode import Graphs, Level, distributions
from core.events import Verdict
from core.model import Transformer

DOCUMENT = "pride_and_prejudice.txt"
SAMPLINGS = {"greedy": {"greedy": True}, "t0.6_p0.9": {"temperature": 0.6, "top_p": 0.9}}
Trace = list[tuple[int, int, int]]  # (level, proposed, accepted) of each verification


def real_engine(gguf: str | None, draft: str | None, rope: dict, context: int) -> Engine:
    """The target (default: the embedded GGUF) in bf16 on the GPU with CUDA graphs, RoPE-scaled to `context`,
    generating to max_new_tokens (no end-of-sequence stop: a benchmark, not an answer); no draft unless given."""
    engine = Engine.load(gguf, draft or "", device=DEV.type, dtype="bfloat16", context_length=context,
                         rope_scaling={**rope, "max_position_embeddings": context})
    engine.target.eos_ids = set()
    return engine


def hf_real_ar_ms(model: Transformer, length: int) -> float:
    """HF transformers AR on the same weights and RoPE scaling, over a DynamicCache of `length` tokens."""
    with torch.device(DEV):
        hf = AutoModelForCausalLM.from_config(model.config, dtype=BF16, attn_implementation="sdpa").eval()
    hf.model.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("lm_head")})
    hf.tie_weights()
    cache = random_dynamic_cache(model.args, length)
    ms = hf_ar_ms(hf, cache, reps=10)
    del hf, cache
    free()
    return ms


def trace_of(verdicts: list[Verdict]) -> Trace:
    return [(v.level, len(v.proposed), v.accepted) for v in verdicts]


def real(gguf: str | None, contexts: list[int], new_tokens: int, rope: dict, with_hf: bool, draft: str | None,
         budget: int, reselect: str | int) -> dict:
    """End-to-end AR vs TriForce on the embedded model at long contexts, with real acceptance."""
    engine = real_engine(gguf, draft, rope, max(contexts) + new_tokens + 1024)
    engine_drafter = "model" if engine.draft is not None else "ngram"
    rows, traces = [], {}
    for ctx in contexts:
        doc = document_of(engine, DOCUMENT, ctx - 200)
        for name, sampling in SAMPLINGS.items():
            base = dict(max_new_tokens=new_tokens, budget=budget, chunk_size=8, gamma1=2, gamma2=6, seed=0,
                        reselect=reselect, **sampling)
            first = finish(engine, doc, INSTRUCTION, GenerationConfig(method="ar", **base))  # warm-up, graphs
            finish(engine, doc, INSTRUCTION, GenerationConfig(method="triforce", **base))
            ar = finish(engine, doc, INSTRUCTION, GenerationConfig(method="ar", **base))
            verdicts: list[Verdict] = []
            tf = finish(engine, doc, INSTRUCTION, GenerationConfig(method="triforce", **base), verdicts)
            s, t = ar.stats, tf.stats
            row = {"context": s.prompt_tokens, "sampling": name, "ar_tok_s": s.tokens_per_s,
                   "ar_ms_per_token": 1e3 / s.tokens_per_s, "triforce_tok_s": t.tokens_per_s,
                   "speedup": t.tokens_per_s / s.tokens_per_s, "prefill_s": first.stats.prefill_s,
                   "level1_acceptance": t.level1_accepted / max(1, t.level1_proposed),
                   "level2_acceptance": t.level2_accepted / max(1, t.level2_proposed),
                   "tokens_per_target_forward": t.tokens_per_target_forward, "new_tokens": t.new_tokens,
                   "same_text_greedy": ar.text == tf.text if name == "greedy" else None}
            traces[f"{ctx}-{name}"] = trace_of(verdicts)
            rows.append(row)
            print(json.dumps(row), flush=True)
        if with_hf:  # the cache the AR step reads: all but the last prompt token
            rows[-1]["hf_ar_ms"] = rows[-2]["hf_ar_ms"] = hf_real_ar_ms(engine.target, rows[-1]["context"] - 1)
            print(json.dumps({"context": ctx, "hf_ar_ms": rows[-1]["hf_ar_ms"]}), flush=True)
    info = engine.info
    del engine
    free()
    return {"model": f"{info['target']} ({info['dtype']})", "rope_scaling": rope, "drafter": engine_drafter,
            "draft": info["draft"], "budget": budget, "reselect": reselect, "chunk_size": 8, "gamma1": 2,
            "gamma2": 6, "rows": rows, "traces": traces}


def sweep(gguf: str | None, ctx: int, new_tokens: int, rope: dict, draft: str | None, budgets: list[int],
          reselects: list[str | int]) -> dict:
    """Retrieval settings for the real model: acceptance per level and tokens/s for each budget x re-selection."""
    engine = real_engine(gguf, draft, rope, ctx + new_tokens + 1024)
    doc, rows = document_of(engine, DOCUMENT, ctx - 200), []
    for name, sampling in SAMPLINGS.items():
        base = dict(max_new_tokens=new_tokens, chunk_size=8, gamma1=2, gamma2=6, seed=0, **sampling)
        finish(engine, doc, INSTRUCTION, GenerationConfig(method="ar", **base))
        ar = finish(engine, doc, INSTRUCTION, GenerationConfig(method="ar", **base)).stats
        for budget in budgets:
            for reselect in reselects:
                cfg = GenerationConfig(method="triforce", budget=budget, reselect=reselect, **base)
                finish(engine, doc, INSTRUCTION, cfg)  # graphs for this budget
                t = finish(engine, doc, INSTRUCTION, cfg).stats
                rows.append({"context": t.prompt_tokens, "sampling": name, "budget": budget, "reselect": reselect,
                             "speedup": t.tokens_per_s / ar.tokens_per_s, "triforce_tok_s": t.tokens_per_s,
                             "ar_tok_s": ar.tokens_per_s, "level1_acceptance": t.level1_acceptance,
                             "level2_acceptance": t.level2_acceptance,
                             "tokens_per_target_forward": t.tokens_per_target_forward})
                print(json.dumps(rows[-1]), flush=True)
    del engine
    free()
    return {"draft": draft, "new_tokens": new_tokens, "rows": rows}


def replay(trace: Trace, shape: dict, ctx: int) -> dict:
    """Replay a real run's schedule at `ctx` on a shape with random weights: each level-2 forward with the recorded
    proposal count and acceptance, each level-3 verification with the recorded acceptance; against our AR there.
    Each drafted token costs one level-1 step of a llama-68m-shape draft over a 256-token StreamingLLM cache (the
    paper's level 1)."""
    model, tiny = random_model(shape), random_model(LLAMA_68M)
    full = full_cache(model, ctx + 2048)
    fill_random(full, ctx)
    graphs = Graphs()
    cfg = GenerationConfig(temperature=0.6, top_p=0.9)
    counter = iter(range(1 << 30))

    def fresh(n: int) -> list[int]:
        return [100 + next(counter) % 30000 for _ in range(n)]

    with torch.inference_mode():
        index, rcache = random_retrieval(full, ctx, model.ops)
        prompt = fresh(ctx + 1)  # the cache holds all but the last prompt token
        target, l2 = Level(model, full, prompt[:-1], graphs), Level(model, rcache, prompt[:-1], graphs)
        ar_ms = ar_step_ms(target, prompt[:-1])
        l1 = draft_level(tiny, graphs)
        list(l1.prefill(prompt[:256], 256))

        def verify(level: Level, seq: list[int], n: int, trusted: int) -> None:
            distributions(level.logits(seq, n, trusted), cfg)[:, 0].tolist()

        def run() -> int:
            seq, made, draft = list(prompt), 0, []
            for level, proposed, accepted in trace:
                if level == 2:
                    proposals = fresh(proposed)
                    for token in proposals:  # level 1 drafts them one by one
                        verify(l1, l1.tokens + [token], 1, len(l1.tokens))
                    verify(l2, seq + draft + proposals, proposed + 1, len(seq))
                    draft += proposals[:accepted] + fresh(1)
                else:
                    draft = draft[:proposed]
                    verify(target, seq + draft, len(draft) + 1, len(seq))
                    seq += draft[:accepted] + fresh(1)
                    made += accepted + 1
                    draft = []
            full.truncate(ctx)
            rcache.truncate(ctx)
            target.tokens, l2.tokens = prompt[:-1], prompt[:-1]
            return made

        run()  # captures the graphs
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        made = run()
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
    del target, l2, l1, full, rcache, index, model, tiny
    free()
    return {"context": ctx, "tokens": made, "seconds": seconds, "ms_per_token": seconds * 1e3 / made,
            "ar_ms": ar_ms, "speedup": ar_ms * made / (seconds * 1e3)}


def closed_form(level_ms: dict, trace: Trace) -> float:
    """Speedup from level latencies x the trace's counts: AR time of its tokens / (l1 steps + l2 forwards + l3
    forwards), every level-2 forward priced as a 3-token verification."""
    l1 = sum(proposed for lv, proposed, _ in trace if lv == 2)
    l2 = sum(1 for lv, _, _ in trace if lv == 2)
    l3 = [acc + 1 for lv, _, acc in trace if lv == 3]
    cost = l1 * level_ms["l1_step_ms"] + l2 * level_ms["l2_verify3_ms"] + len(l3) * level_ms["l3_verify_ms"]
    return level_ms["ar_ms"] * sum(l3) / cost


def reselect_arg(text: str) -> str | int:
    return int(text) if text.isdigit() else text


def real_part(args: argparse.Namespace, results: GpuResults) -> None:
    results.data["real"] = rl = real(args.gguf, args.real_contexts, args.new_tokens, json.loads(args.rope),
                                     not args.no_hf_real, args.draft, args.budget, reselect_arg(args.reselect))
    top = [r for r in rl["rows"] if r["context"] == max(r["context"] for r in rl["rows"])]
    sampled = top[-1]  # the paper's setting (temperature 0.6, top-p 0.9) at the longest context
    results.summary.update(e2e_speedup_real=sampled["speedup"], e2e_context_real=sampled["context"],
                           e2e_speedup_real_greedy=top[0]["speedup"], ar_ms_real_128k=top[0]["ar_ms_per_token"],
                           hf_ar_ms_real_128k=top[0].get("hf_ar_ms"))


def sweep_part(args: argparse.Namespace, results: GpuResults) -> None:
    results.data["sweep_real"] = sweep(args.gguf, args.real_contexts[-1], 128, json.loads(args.rope), args.draft,
                                       [4096, 16384], ["once", "every_verify", 8])


def replay_part(args: argparse.Namespace, results: GpuResults) -> None:
    if "real" not in results.data:
        print(f"replay skipped: {results.path} holds no real part (its traces); run --parts real first", flush=True)
        return
    traces = results.data["real"]["traces"]
    key = max(traces, key=lambda k: (int(k.split("-")[0]), "t0.6" in k))  # longest context, sampled
    rp = {"trace": key, **replay(traces[key], SHAPES[args.shape], args.contexts[-1])}
    synthetic = results.data.get(shape_key("synthetic_7b", args.shape))
    if synthetic:
        rp["closed_form_speedup"] = closed_form(synthetic["rows"][-1], traces[key])
    results.data[shape_key("replay", args.shape)] = rp
    if args.shape == "llama2_7b":
        results.summary.update(projected_speedup_7b_120k=rp["speedup"],
                               projected_speedup_7b_120k_closed_form=rp.get("closed_form_speedup"),
                               projection_note="trace replay of real SmolLM2 acceptance on random 7B weights")


PARTS = {"real": real_part, "sweep": sweep_part, "replay": replay_part}

if __name__ == "__main__":
    gpu_main(__doc__, [sys.modules[__name__]])
