"""GPU benchmark: kernels checked against references, a Llama-2-7B-shape model with random weights (our AR, HF AR,
roofline, each TriForce level, selection, prefill), the real embedded model end to end with RoPE scaling (AR vs
TriForce, HF AR), and a replay of its accept/reject trace on the 7B shape.

python -m bench.gpu --gguf /tmp/smol/model.gguf [--parts check synthetic real replay] [--contexts ...]
    [--draft assets/draft] [--budget 4096] [--reselect once]
Other parts: prefill (chunking variants at 120K), profile / profile_small (per-kernel device time of an AR and a
level-2 step, eager and from a CUDA graph, 7B shape / SmolLM2 shape at the longest real context), sweep (retrieval
budget x re-selection on the real model). TRIFORCE_GEMV=0 swaps the Triton decode GEMV for cuBLAS.
Writes bench/results/<gpu>-<date>.json with a top-level "summary".
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
import transformers
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AutoModelForCausalLM, DynamicCache, LlamaConfig

from core import cuda_graphs
from core.config import GenerationConfig
from core.engine import Engine, default_prefill_chunk
from core.events import Finished, Verdict
from core.kvcache import KVCache, StreamingCache
from core.levels import Level
from core.model import Transformer, gpu_kernels
from core.retrieval import ChunkIndex, chunks_to_keep, gather_selection, retrieval_cache, select_chunks
from core.sampling import distributions

DOCS = Path(__file__).parent.parent / "assets" / "docs"
RESULTS = Path(__file__).parent / "results"
INSTRUCTION = "Summarise what has happened so far, naming the main characters."
LLAMA2_7B = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=131072,
                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False)
SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=131072,
                    rope_parameters={"rope_type": "default", "rope_theta": 100000.0}, tie_word_embeddings=True)
LLAMA_68M = dict(vocab_size=32000, hidden_size=768, intermediate_size=3072, num_hidden_layers=2,
                 num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=131072,
                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False)
DEV = torch.device("cuda")
BF16 = torch.bfloat16


def sync_ms(fn: Callable[[], object], reps: int, warmup: int = 3) -> float:
    """Median wall time of fn() in ms, synchronising after each call (every decode step syncs anyway)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write counted)."""
    from triton.testing import do_bench
    a = torch.empty(2 << 30, dtype=torch.uint8, device=DEV)
    b = torch.empty_like(a)
    ms = do_bench(lambda: b.copy_(a), warmup=50, rep=300, return_mode="median")
    return 2 * a.numel() / (ms * 1e-3)


# --- correctness of the CUDA path -----------------------------------------------------------------------------------

def check_kernels() -> dict:
    """Relative errors of the Triton kernels and of graph-replayed decoding against eager SDPA references."""
    k = gpu_kernels()
    out = {}
    g = torch.Generator(DEV).manual_seed(0)
    for hq, hkv, d, n, length in [(32, 32, 128, 1, 5000), (32, 32, 128, 7, 4097), (9, 3, 64, 1, 130), (9, 3, 64, 7, 70),
                                  (9, 3, 64, 3, 20000), (32, 8, 128, 7, 1000)]:
        cap = length + 100
        kc = torch.randn(hkv, cap, d, device=DEV, dtype=BF16, generator=g)
        vc = torch.randn(hkv, cap, d, device=DEV, dtype=BF16, generator=g)
        q = torch.randn(hq, n, d, device=DEV, dtype=BF16, generator=g)
        meta = torch.tensor([0, length - n], device=DEV)
        got = k.decode_attention(q, kc, vc, meta).float()
        mask = torch.ones(n, length, dtype=torch.bool, device=DEV).tril(diagonal=length - n)
        ref = F.scaled_dot_product_attention(q.double()[None], kc[:, :length].double()[None],
                                             vc[:, :length].double()[None], attn_mask=mask,
                                             enable_gqa=hq != hkv)[0].float()
        out[f"attention_{hq}x{hkv}x{d}_n{n}_L{length}"] = float((got - ref).norm() / ref.norm())
    x = torch.randn(5, 576, device=DEV, dtype=BF16, generator=g)
    w = torch.randn(576, device=DEV, dtype=BF16, generator=g)
    ref = w * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5)).to(BF16)
    out["rms_norm"] = float((k.rms_norm(x, w, 1e-5).float() - ref.float()).norm() / ref.float().norm())
    x = torch.randn(7, 9, 64, device=DEV, dtype=BF16, generator=g)
    ang = torch.randn(7, 32, device=DEV, generator=g)
    cos, sin = torch.cat((ang, ang), -1).cos(), torch.cat((ang, ang), -1).sin()
    xt = x.float().transpose(0, 1)
    ref = xt * cos + torch.cat((-xt[..., 32:], xt[..., :32]), -1) * sin
    out["rope"] = float((k.rope(x, cos.to(BF16), sin.to(BF16)).float() - ref).norm() / ref.norm())
    gu = torch.randn(3, 2 * 1536, device=DEV, dtype=BF16, generator=g)
    ref = F.silu(gu[:, :1536].float()) * gu[:, 1536:].float()
    out["silu_mul"] = float((k.silu_mul(gu).float() - ref).norm() / ref.norm())
    for m, n_out, k_in, bias, add in ((1, 4096, 11008, False, True), (3, 12288, 4096, True, False),
                                      (7, 576, 1536, False, True)):
        x = torch.randn(m, k_in, device=DEV, dtype=BF16, generator=g)
        w = torch.randn(n_out, k_in, device=DEV, dtype=BF16, generator=g) / k_in ** 0.5
        b = torch.randn(n_out, device=DEV, dtype=BF16, generator=g) if bias else None
        r = torch.randn(m, n_out, device=DEV, dtype=BF16, generator=g) if add else None
        ref = x.double() @ w.double().T + (b.double() if bias else 0) + (r.double() if add else 0)
        got = k.gemv(x, w, b, r.clone() if add else None).double()
        out[f"gemv_{m}x{n_out}x{k_in}"] = float((got - ref).norm() / ref.norm())
    out.update(check_selection())
    out.update(check_graph_decode())
    return out


def check_selection() -> dict:
    """Chunk gather kernel == torch.gather; bf16 chunk means scored in float32 vs float32 means: same chunks?"""
    g = torch.Generator(DEV).manual_seed(1)
    full = KVCache(4, 8, 128, 20000, BF16, DEV)
    full.k.normal_(generator=g)
    full.v.normal_(generator=g)
    full.used = 19000
    index = ChunkIndex.build(full, 19000, 8)
    queries = torch.randn(4, 8, 128, device=DEV, generator=g)
    ids = select_chunks(index, queries, 512)
    exact = ChunkIndex(full.k[:, :, :19000].float().view(4, 8, -1, 8, 128).mean(3), 8, 19000)  # float32 means
    ref_ids = select_chunks(exact, queries, 512)
    into = retrieval_cache(full, index, 4096, 16)
    gather_selection(full, index, ids, into)
    tokens = (ids[..., None] * 8 + torch.arange(8, device=DEV)).flatten(2)
    want = torch.gather(full.k[:, :, :19000], 2, tokens[..., None].expand(-1, -1, -1, 128))
    same = sum(len(set(a.tolist()) & set(b.tolist())) for a, b in zip(ids.flatten(0, 1), ref_ids.flatten(0, 1)))
    return {"gather_chunks_equal": bool(torch.equal(into.k[:, :, :4096], want)),
            "selection_bf16_means_overlap": same / ids.numel()}


def check_graph_decode() -> dict:
    """Greedy decoding of a small random GQA model: graphs + Triton vs eager SDPA (kernels off), same tokens?"""
    cfg = LlamaConfig(**{**LLAMA_68M, "num_hidden_layers": 4, "num_attention_heads": 9, "num_key_value_heads": 3,
                         "hidden_size": 576, "head_dim": 64})
    torch.manual_seed(0)
    with torch.device(DEV):
        model = Transformer(cfg).to(BF16).eval()
    model.fuse_projections()
    prompt = torch.randint(0, 32000, (3000,)).tolist()
    runs = []
    for fast in (False, True):
        cache = KVCache(4, 3, 64, 3200, BF16, DEV)
        if not fast:
            cache.kernels = None
        level = Level(model, cache, [])
        seq, logits = list(prompt), []
        with torch.inference_mode():
            list(level.prefill(seq[:-1], 1024))
            for _ in range(24):
                out = level.logits(seq, 1, len(seq) - 1)
                logits.append(out[0])
                seq.append(int(out[0].argmax()))
            verify = level.logits(seq[:-6] + seq[-6:], 7, len(seq) - 7)  # 7-token verification, rolled back
        runs.append((seq[len(prompt):], torch.stack(logits), verify))
    (ta, la, va), (tb, lb, vb) = runs
    return {"graph_tokens_equal": ta == tb, "graph_logits_rel": float((la - lb).norm() / la.norm()),
            "graph_verify_rel": float((va - vb).norm() / va.norm()), "graphs_captured": True}


# --- 7B shape with random weights -----------------------------------------------------------------------------------

def build_7b() -> tuple[torch.nn.Module, Transformer]:
    """HF LlamaForCausalLM (random bf16, SDPA) on the GPU and our Transformer sharing its weights."""
    config = LlamaConfig(**LLAMA2_7B)
    torch.manual_seed(0)
    with torch.device(DEV):
        hf = AutoModelForCausalLM.from_config(config, dtype=BF16, attn_implementation="sdpa").eval()
    with torch.device("meta"):
        ours = Transformer(hf.config)
    ours.load_hf_state_dict(hf.state_dict())
    ours.fuse_projections()  # its own fused copies of q/k/v and gate/up: HF keeps the separate weights
    return hf, ours.eval()


def random_retrieval(full: KVCache, ctx: int) -> tuple[ChunkIndex, KVCache]:
    """A level-2 cache at budget 4096 (chunk 8) over the first ctx cached tokens, selected by a random query."""
    index = ChunkIndex.build(full, ctx, 8)
    rcache = retrieval_cache(full, index, 4096, 2048)
    queries = torch.randn(full.k.shape[0], full.k.shape[1], full.k.shape[-1], device=DEV)
    gather_selection(full, index, select_chunks(index, queries, chunks_to_keep(index, 4096)), rcache)
    return index, rcache


def fill_random(cache: KVCache, length: int) -> None:
    """Pretend `length` prompt tokens are cached: random keys/values (latency does not depend on values)."""
    for layer in range(cache.k.shape[0]):
        cache.k[layer].normal_()
        cache.v[layer].normal_()
    cache.used = cache.head + length


def ar_step_ms(level: Level, base: list[int], reps: int = 20) -> float:
    """Median latency of one AR step (forward of one token, argmax to the host); the context stays fixed (the token
    is passed apart, as the engine does: no copy of the long sequence)."""
    token = [0]

    def step() -> None:
        token[0] = int(level.logits(base, 1, len(base), extra=[token[0] % 1000])[0].argmax())
    return sync_ms(step, reps)


def verify_step_ms(level: Level, base: list[int], n: int, reps: int = 20) -> float:
    """Median latency of a level verification: forward of n tokens, distributions of all n rows to the host."""
    cfg = GenerationConfig(temperature=0.6, top_p=0.9)

    def step() -> None:
        p = distributions(level.logits(base, n, len(base), extra=range(n)), cfg)
        p[:, 0].tolist()
    return sync_ms(step, reps)


def hf_ar_ms(hf, cache: DynamicCache, reps: int = 8) -> float:
    """HF transformers: one token through LlamaForCausalLM with a DynamicCache, growing as in generate()."""
    ids = torch.tensor([[1]], device=DEV)

    def step() -> None:
        out = hf(input_ids=ids, past_key_values=cache, use_cache=True)
        ids.fill_(int(out.logits[0, -1].argmax()) % 1000)
    with torch.inference_mode():
        return sync_ms(step, reps, warmup=2)


def synthetic(contexts: list[int], bw: float) -> dict:
    """Part 1: per-token latency of our AR, HF AR, roofline, levels, selection and prefill at the 7B shape."""
    hf, model = build_7b()
    a = model.args
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    kv_per_token = 2 * a.n_layers * a.n_kv_heads * a.head_dim * 2
    draft = random_model(LLAMA_68M)
    draft_bytes = sum(p.numel() * p.element_size() for p in draft.parameters())
    rows = []
    warm = KVCache(a.n_layers, a.n_kv_heads, a.head_dim, 4096, BF16, DEV)
    with torch.inference_mode():  # one-off kernel compilation is not prefill time
        list(Level(model, warm, []).prefill(list(range(4000)), default_prefill_chunk(model)))
    del warm
    for ctx in contexts:
        row = {"context": ctx}
        full = KVCache(a.n_layers, a.n_kv_heads, a.head_dim, ctx + 64, BF16, DEV)
        level = Level(model, full, [])
        prompt = torch.randint(0, 32000, (ctx,)).tolist()
        with torch.inference_mode():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            full.record_rows = 1
            list(level.prefill(prompt, default_prefill_chunk(model)))  # as the engine prefills
            full.record_rows = 0
            torch.cuda.synchronize()
            row["prefill_s"] = time.perf_counter() - t0
            row["ar_ms"] = ar_step_ms(level, prompt)
            cuda_graphs.ENABLED = False
            row["ar_ms_eager"] = ar_step_ms(level, prompt, reps=10)
            cuda_graphs.ENABLED = True
            row["roofline_ms"] = (weight_bytes + ctx * kv_per_token) / bw * 1e3
            row["l3_verify_ms"] = verify_step_ms(level, prompt, 7)
            row["l3_roofline_ms"] = row["roofline_ms"]
            # level 2: retrieval cache at budget 4096, chunk 8; selection = scores + top-k + gather
            t0 = time.perf_counter()
            index = ChunkIndex.build(full, ctx, 8)
            torch.cuda.synchronize()
            row["chunk_index_s"] = time.perf_counter() - t0
            rcache = retrieval_cache(full, index, 4096, 300)
            queries = torch.stack([q[:, -1] for q in full.queries])
            n_select = chunks_to_keep(index, 4096)
            row["select_ms"] = sync_ms(lambda: select_chunks(index, queries, n_select), 10)
            ids = select_chunks(index, queries, n_select)
            row["gather_ms"] = sync_ms(lambda: gather_selection(full, index, ids, rcache), 10)
            l2 = Level(model, rcache, prompt)
            row["l2_step_ms"] = ar_step_ms(l2, prompt)
            row["l2_verify3_ms"] = verify_step_ms(l2, prompt, 3)
            row["l2_roofline_ms"] = (weight_bytes + rcache.used * kv_per_token) / bw * 1e3
            del l2, rcache, index
            # level 1: a llama-68m shape with a 256-token StreamingLLM cache
            dcache = StreamingCache(2, 12, 64, 16, 240, 16, draft.rotary, BF16, DEV)
            l1 = Level(draft, dcache, [])
            list(l1.prefill(prompt[:256], 256))
            row["l1_step_ms"] = ar_step_ms(l1, prompt[:256])
            row["l1_roofline_ms"] = (draft_bytes + 256 * 2 * 2 * 12 * 64 * 2) / bw * 1e3
        del level, full, l1, dcache
        free()
        cache = DynamicCache()
        with torch.inference_mode():
            for layer in range(a.n_layers):
                shape = (1, a.n_kv_heads, ctx, a.head_dim)
                cache.update(torch.randn(shape, device=DEV, dtype=BF16), torch.randn(shape, device=DEV, dtype=BF16),
                             layer)
        row["hf_ar_ms"] = hf_ar_ms(hf, cache)
        del cache
        free()
        rows.append(row)
        print(json.dumps(row), flush=True)
    del hf, model, draft
    free()
    return {"weight_bytes": weight_bytes, "kv_bytes_per_token": kv_per_token,
            "triton_gemv": bool(gpu_kernels().USE_GEMV), "rows": rows}


def prefill_variants(ctx: int) -> dict:
    """Seconds to prefill ctx tokens at the 7B shape: 8K chunks (bottom-right causal SDPA), or one chunk (plain
    causal SDPA) with PyTorch's backend order or with cuDNN attention first."""
    torch.manual_seed(0)
    with torch.device(DEV):
        model = Transformer(LlamaConfig(**LLAMA2_7B)).to(BF16).eval()
    model.fuse_projections()
    a = model.args
    full = KVCache(a.n_layers, a.n_kv_heads, a.head_dim, ctx + 64, BF16, DEV)
    level = Level(model, full, [])
    prompt = torch.randint(0, 32000, (ctx,)).tolist()
    cudnn_first = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                   SDPBackend.MATH]
    out = {}
    with torch.inference_mode():  # warm-up: kernels compiled and cuBLAS handles made before timing
        list(level.prefill(prompt[:16384], 8192))
    for name, chunk, backends in [("chunks_8192", 8192, None), ("one_chunk", ctx, None),
                                  ("one_chunk_cudnn_first", ctx, cudnn_first), ("chunks_8192_again", 8192, None)]:
        full.truncate(0)
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
    del level, full, model
    free()
    return {"context": ctx, "seconds": out}


# --- the real embedded model ----------------------------------------------------------------------------------------

def document(engine: Engine, tokens: int) -> str:
    ids = engine.tokenizer((DOCS / "pride_and_prejudice.txt").read_text(), add_special_tokens=False)["input_ids"]
    return engine.tokenizer.decode(ids[:tokens])


def finish(engine: Engine, doc: str, cfg: GenerationConfig) -> tuple[Finished, list[Verdict]]:
    verdicts, fin = [], None
    for event in engine.generate(doc, INSTRUCTION, cfg):
        if isinstance(event, Verdict):
            verdicts.append(event)
        elif isinstance(event, Finished):
            fin = event
    return fin, verdicts


def hf_real_ar_ms(engine: Engine, length: int) -> float:
    """HF transformers AR on the same weights and RoPE scaling, its DynamicCache filled from our prefilled cache."""
    model = engine.target
    with torch.device(DEV):
        hf = AutoModelForCausalLM.from_config(model.config, dtype=BF16, attn_implementation="sdpa").eval()
    hf.model.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("lm_head")})
    hf.tie_weights()
    full = engine._prefilled[1]
    cache = DynamicCache()
    with torch.inference_mode():
        for layer in range(model.args.n_layers):
            cache.update(full.k[layer, :, :length][None].clone(), full.v[layer, :, :length][None].clone(), layer)
    ms = hf_ar_ms(hf, cache, reps=10)
    del hf, cache
    free()
    return ms


def real_engine(gguf: str, draft: str | None, rope: dict, context: int) -> Engine:
    """The embedded model from its GGUF in bf16 on the GPU, RoPE-scaled to `context`, generating to max_new_tokens
    (no end-of-sequence stop: a benchmark, not an answer)."""
    engine = Engine.load(gguf, draft, device=DEV.type, dtype="bfloat16", context_length=context,
                         rope_scaling={**rope, "max_position_embeddings": context})
    engine.target.eos_ids = set()
    return engine


def real(gguf: str, contexts: list[int], new_tokens: int, rope: dict, with_hf: bool, draft: str | None,
         budget: int, reselect: str | int) -> dict:
    """Part 2: end-to-end AR vs TriForce on the embedded model at long contexts, with real acceptance."""
    engine = real_engine(gguf, draft, rope, max(contexts) + new_tokens + 1024)
    engine_drafter = "model" if engine.draft is not None else "ngram"
    rows, traces = [], {}
    for ctx in contexts:
        doc = document(engine, ctx - 200)
        for sampling in ({"greedy": True}, {"temperature": 0.6, "top_p": 0.9}):
            name = "greedy" if sampling.get("greedy") else "t0.6_p0.9"
            base = dict(max_new_tokens=new_tokens, budget=budget, chunk_size=8, gamma1=2, gamma2=6, seed=0,
                        reselect=reselect, **sampling)
            first, _ = finish(engine, doc, GenerationConfig(method="ar", **base))  # also captures graphs: warm-up
            finish(engine, doc, GenerationConfig(method="triforce", **base))
            ar, _ = finish(engine, doc, GenerationConfig(method="ar", **base))
            tf, verdicts = finish(engine, doc, GenerationConfig(method="triforce", **base))
            s, t = ar.stats, tf.stats
            row = {"context": s.prompt_tokens, "sampling": name, "ar_tok_s": s.tokens_per_s,
                   "ar_ms_per_token": 1e3 / s.tokens_per_s, "triforce_tok_s": t.tokens_per_s,
                   "speedup": t.tokens_per_s / s.tokens_per_s, "prefill_s": first.stats.prefill_s,
                   "level1_acceptance": t.level1_accepted / max(1, t.level1_proposed),
                   "level2_acceptance": t.level2_accepted / max(1, t.level2_proposed),
                   "tokens_per_target_forward": t.tokens_per_target_forward, "new_tokens": t.new_tokens,
                   "same_text_greedy": ar.text == tf.text if name == "greedy" else None}
            traces[f"{ctx}-{name}"] = [(v.level, len(v.proposed), v.accepted) for v in verdicts]
            rows.append(row)
            print(json.dumps(row), flush=True)
        if with_hf:
            rows[-1]["hf_ar_ms"] = rows[-2]["hf_ar_ms"] = hf_real_ar_ms(engine, len(engine._prefilled[0]) - 1)
            print(json.dumps({"context": ctx, "hf_ar_ms": rows[-1]["hf_ar_ms"]}), flush=True)
    draft_name = engine.info["draft"]
    del engine
    free()
    return {"model": "SmolLM2-135M-Instruct Q4_1 GGUF (dequantised, bf16)", "rope_scaling": rope,
            "drafter": engine_drafter, "draft": draft_name, "budget": budget, "reselect": reselect,
            "chunk_size": 8, "gamma1": 2, "gamma2": 6,
            "rows": rows, "traces": traces}


def sweep(gguf: str, ctx: int, new_tokens: int, rope: dict, draft: str | None, budgets: list[int],
          reselects: list[str | int]) -> dict:
    """Retrieval settings for the real model: acceptance per level and tokens/s for each budget x re-selection."""
    engine = real_engine(gguf, draft, rope, ctx + new_tokens + 1024)
    doc, rows = document(engine, ctx - 200), []
    for sampling in ({"greedy": True}, {"temperature": 0.6, "top_p": 0.9}):
        base = dict(max_new_tokens=new_tokens, chunk_size=8, gamma1=2, gamma2=6, seed=0, **sampling)
        finish(engine, doc, GenerationConfig(method="ar", **base))
        ar = finish(engine, doc, GenerationConfig(method="ar", **base))[0].stats
        for budget in budgets:
            for reselect in reselects:
                cfg = GenerationConfig(method="triforce", budget=budget, reselect=reselect, **base)
                finish(engine, doc, cfg)  # graphs for this budget
                t = finish(engine, doc, cfg)[0].stats
                rows.append({"context": t.prompt_tokens, "sampling": "greedy" if "greedy" in sampling else "t0.6_p0.9",
                             "budget": budget, "reselect": reselect, "speedup": t.tokens_per_s / ar.tokens_per_s,
                             "triforce_tok_s": t.tokens_per_s, "ar_tok_s": ar.tokens_per_s,
                             "level1_acceptance": t.level1_acceptance, "level2_acceptance": t.level2_acceptance,
                             "tokens_per_target_forward": t.tokens_per_target_forward})
                print(json.dumps(rows[-1]), flush=True)
    del engine
    free()
    return {"draft": draft, "new_tokens": new_tokens, "rows": rows}


# --- replay of a real trace on the 7B shape -------------------------------------------------------------------------

def replay(trace: list[tuple[int, int, int]], ctx: int) -> dict:
    """Part 3: replay a real run's schedule on the 7B shape at `ctx` (random weights): each level-2 forward with the
    recorded proposal count and acceptance, each level-3 verification with the recorded acceptance; against our
    AR there. Each drafted token costs one level-1 step of a llama-68m-shape draft over a 256-token StreamingLLM
    cache (the paper's level 1)."""
    _, model = build_7b()
    tiny = random_model(LLAMA_68M)
    a = model.args
    full = KVCache(a.n_layers, a.n_kv_heads, a.head_dim, ctx + 2048, BF16, DEV)
    fill_random(full, ctx)
    cfg = GenerationConfig(temperature=0.6, top_p=0.9)
    counter = iter(range(1 << 30))

    def fresh(n: int) -> list[int]:
        return [100 + next(counter) % 30000 for _ in range(n)]

    with torch.inference_mode():
        index, rcache = random_retrieval(full, ctx)
        prompt = fresh(ctx + 1)  # the cache holds all but the last prompt token
        target, l2 = Level(model, full, prompt[:-1]), Level(model, rcache, prompt[:-1])
        ar_ms = ar_step_ms(target, prompt[:-1])
        l1 = Level(tiny, StreamingCache(2, 12, 64, 16, 240, 16, tiny.rotary, BF16, DEV), [])
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


def random_model(shape: dict) -> Transformer:
    """Our Transformer at a given config shape with random bf16 weights, fused for decoding."""
    torch.manual_seed(0)
    with torch.device(DEV):
        model = Transformer(LlamaConfig(**shape)).to(BF16).eval()
    model.fuse_projections()
    return model


def profile(ctx: int, shape: dict) -> dict:
    """Where a step's time goes: per-kernel device time of one AR step and one level-2 step (budget 4096) of a
    model of this shape (random weights), eager and replayed from a CUDA graph, beside the step's wall time."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile
    model = random_model(shape)
    a = model.args
    full = KVCache(a.n_layers, a.n_kv_heads, a.head_dim, ctx + 2048, BF16, DEV)
    fill_random(full, ctx)
    prompt = [100 + i % 30000 for i in range(ctx)]
    out = {"context": ctx}
    activity = ProfilerActivity.CUDA if DEV.type == "cuda" else ProfilerActivity.CPU
    with torch.inference_mode():
        index, rcache = random_retrieval(full, ctx)
        for name, cache in (("ar", full), ("l2", rcache)):
            level = Level(model, cache, prompt)
            for graphs in (False, True):
                cuda_graphs.ENABLED = graphs
                wall = ar_step_ms(level, prompt, reps=10)
                with torch_profile(activities=[activity]) as prof:
                    for _ in range(5):
                        level.logits(prompt, 1, len(prompt), extra=[7])
                    torch.cuda.synchronize()
                rows = []
                for e in prof.key_averages():
                    us = getattr(e, "device_time_total", 0) if DEV.type == "cuda" else e.self_cpu_time_total
                    if us > 0 and e.count:
                        rows.append({"kernel": e.key[:90], "us_per_step": us / 5, "per_step": e.count / 5})
                rows.sort(key=lambda r: -r["us_per_step"])
                total = sum(r["us_per_step"] for r in rows)
                key = f"{name}_{'graph' if graphs else 'eager'}"
                out[key] = {"wall_ms": wall, "kernel_ms": total / 1e3, "kernels_per_step": sum(r["per_step"] for r in rows),
                            "top": rows[:14]}
                print(key, json.dumps(out[key], indent=0), flush=True)
            cuda_graphs.ENABLED = True
    del full, rcache, index, model
    free()
    return out


def closed_form(level_ms: dict, trace: list[tuple[int, int, int]]) -> float:
    """Speedup from level latencies x the trace's counts: AR time of its tokens / (l1 steps + l2 forwards + l3
    forwards), every level-2 forward priced as a 3-token verification."""
    l1 = sum(proposed for lv, proposed, _ in trace if lv == 2)
    l2 = sum(1 for lv, _, _ in trace if lv == 2)
    l3 = [acc + 1 for lv, _, acc in trace if lv == 3]
    cost = l1 * level_ms["l1_step_ms"] + l2 * level_ms["l2_verify3_ms"] + len(l3) * level_ms["l3_verify_ms"]
    return level_ms["ar_ms"] * sum(l3) / cost


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--parts", nargs="+", default=["check", "synthetic", "real", "replay"])
    p.add_argument("--contexts", type=int, nargs="+", default=[32768, 65536, 122880])
    p.add_argument("--real-contexts", type=int, nargs="+", default=[32768, 65536, 131072])
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--gguf", default="/tmp/smol/model.gguf")
    p.add_argument("--rope", default='{"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 8192}')
    p.add_argument("--no-hf-real", action="store_true")
    p.add_argument("--draft", default=None, help="level-1 draft for the real part (e.g. assets/draft; default: none)")
    p.add_argument("--budget", type=int, default=4096, help="retrieval budget of the real part")
    p.add_argument("--reselect", default="once", help="re-selection of the real part: once, every_verify or N")
    p.add_argument("--out", default=None, help="result file (default bench/results/<gpu>-<date>.json)")
    args = p.parse_args()
    name = torch.cuda.get_device_name().replace(" ", "-")
    path = Path(args.out) if args.out else RESULTS / f"{name}-{dt.date.today().isoformat()}.json"
    result = json.loads(path.read_text()) if path.exists() else {}
    command = " ".join(["python", "-m", "bench.gpu", *sys.argv[1:]])
    date = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    result.update({"command": command, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "transformers": transformers.__version__, "date": date})
    result.setdefault("runs", []).append({"command": command, "date": date, "parts": args.parts})
    result["copy_bandwidth_tb_s"] = bw = copy_bandwidth() / 1e12
    summary = result.setdefault("summary", {})

    def save() -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1) + "\n")

    if "check" in args.parts:
        result["check"] = check_kernels()
        print(json.dumps(result["check"]), flush=True)
        save()
    if "synthetic" in args.parts:
        syn = synthetic(args.contexts, bw * 1e12)
        old = {r["context"]: r for r in result.get("synthetic_7b", {}).get("rows", [])}  # a rerun of some contexts
        syn["rows"] = sorted({**old, **{r["context"]: r for r in syn["rows"]}}.values(), key=lambda r: r["context"])
        result["synthetic_7b"] = syn
        last = syn["rows"][-1]
        summary.update(ar_ms_120k=last["ar_ms"], hf_ar_ms_120k=last["hf_ar_ms"], roofline_ms_120k=last["roofline_ms"],
                       l2_step_ms=last["l2_step_ms"], l2_roofline_ms=last["l2_roofline_ms"],
                       prefill_120k_s=last["prefill_s"], synthetic_context=last["context"])
        save()
    if "prefill" in args.parts:
        result["prefill_7b"] = pf = prefill_variants(args.contexts[-1])
        ok = {k: t for k, t in pf["seconds"].items() if isinstance(t, float)}
        best = min(ok, key=ok.get)
        summary.update(prefill_120k_s=ok[best], prefill_120k_variant=best)
        save()
    if "real" in args.parts:
        reselect = int(args.reselect) if args.reselect.isdigit() else args.reselect
        result["real"] = rl = real(args.gguf, args.real_contexts, args.new_tokens, json.loads(args.rope),
                                   not args.no_hf_real, args.draft, args.budget, reselect)
        top = [r for r in rl["rows"] if r["context"] == max(r["context"] for r in rl["rows"])]
        sampled = top[-1]  # the paper's setting (temperature 0.6, top-p 0.9) at the longest context
        summary.update(e2e_speedup_real=sampled["speedup"], e2e_context_real=sampled["context"],
                       e2e_speedup_real_greedy=top[0]["speedup"], ar_ms_real_128k=top[0]["ar_ms_per_token"],
                       hf_ar_ms_real_128k=top[0].get("hf_ar_ms"))
        save()
    if "sweep" in args.parts:
        result["sweep_real"] = sweep(args.gguf, args.real_contexts[-1], 128, json.loads(args.rope), args.draft,
                                     [4096, 16384], ["once", "every_verify", 8])
        save()
    if "profile" in args.parts:
        result["profile_7b"] = profile(args.contexts[-1], LLAMA2_7B)
        save()
    if "profile_small" in args.parts:
        result["profile_smollm2_shape"] = profile(args.real_contexts[-1], SMOLLM2_135M)
        save()
    if "replay" in args.parts and "real" in result:
        traces = result["real"]["traces"]
        key = max(traces, key=lambda k: (int(k.split("-")[0]), "t0.6" in k))  # longest context, sampled
        ctx = args.contexts[-1]
        result["replay"] = rp = {"trace": key, **replay(traces[key], ctx)}
        if "synthetic_7b" in result:
            rp["closed_form_speedup"] = closed_form(result["synthetic_7b"]["rows"][-1], traces[key])
        summary.update(projected_speedup_7b_120k=rp["speedup"], projected_speedup_7b_120k_closed_form=rp.get(
            "closed_form_speedup"), projection_note="trace replay of real SmolLM2 acceptance on random 7B weights")
        save()
    print(json.dumps(summary, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
