"""The CUDA path, on a GPU (skipped without one): core.model.ops.TritonOps (the Triton kernels) against
core.model.ops.TorchOps and float64 references, the chunk gather, chunk selection from bf16 means, and greedy decoding replayed from CUDA
graphs against eager PyTorch operators. `python -m bench.gpu --parts check` records the same measurements
(`measured`) in the GPU result file.

python -m pytest -q tests/test_gpu.py
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig

from core.config import GenerationConfig
from core.decode.graphs import Graphs
from core.cache.kvcache import KVCache
from core.decode.levels import Level, Stopped
from core.model.transformer import Transformer
from core.cache.offload import OffloadedKVCache
from core.model.ops import DECODE_TOKENS, TORCH, TorchOps, TritonOps, ops_for, rotate
from core.cache.memory import retrieval_cache
from core.cache.retrieval import ChunkIndex, gather_selection, select_chunks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA path needs a CUDA GPU")

DEV, BF16 = "cuda", torch.bfloat16
TOL = 1e-2  # relative error of a bf16 result (an H200 measured <= 2.2e-3 against float64)
# q heads, KV heads, head dim, new tokens, cached keys (the new ones included)
ATTENTION = [(32, 32, 128, 1, 5000), (32, 32, 128, 7, 4097), (9, 3, 64, 1, 130), (9, 3, 64, 7, 70),
             (9, 3, 64, 3, 20000), (32, 8, 128, 7, 1000), (32, 8, 128, 13, 3000), (32, 8, 128, 16, 3000)]
GEMV = [(1, 4096, 11008, False, True), (3, 12288, 4096, True, False), (7, 576, 1536, False, True),
        (13, 4096, 11008, False, True), (16, 4096, 11008, False, True)]  # rows, out, in, bias, added to a residual
GRAPH_MODEL = dict(vocab_size=32000, hidden_size=576, intermediate_size=3072, num_hidden_layers=4,
                   num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=131072,
                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False)


def triton_ops(gemv: bool = True) -> TritonOps:
    from core.model import kernels  # Triton: imported on CUDA machines only
    return TritonOps(kernels, gemv)


@pytest.fixture(scope="module")
def triton() -> TritonOps:
    pytest.importorskip("triton")
    return triton_ops()


def rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.double(), ref.double()
    return float((got - ref).norm() / ref.norm())


def randn(*shape: int, g: torch.Generator, dtype: torch.dtype = BF16) -> torch.Tensor:
    return torch.randn(*shape, device=DEV, dtype=dtype, generator=g)


def assert_small(errors: dict[str, float], tol: float = TOL) -> None:
    large = {k: e for k, e in errors.items() if not e <= tol}
    assert not large, f"relative errors above {tol}: {large} (all: {errors})"


def sdpa64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal (bottom-right) GQA attention of q [Hq, n, D] over k, v [Hkv, L, D], in float64."""
    n, length = q.shape[1], k.shape[1]
    mask = torch.ones(n, length, dtype=torch.bool, device=q.device).tril(diagonal=length - n)
    return F.scaled_dot_product_attention(q.double()[None], k.double()[None], v.double()[None], attn_mask=mask,
                                          enable_gqa=q.shape[0] != k.shape[0])[0]


# --- measurements ----------------------------------------------------------------------------------------------------

def attention_key(case: tuple) -> str:
    hq, hkv, d, n, length = case
    return f"attention_{hq}x{hkv}x{d}_n{n}_L{length}"


def attention_error(ops: TritonOps, hq: int, hkv: int, d: int, n: int, length: int) -> float:
    """The split-K decode kernel over a cache whose last n of `length` keys are the new tokens', vs float64 SDPA."""
    g = torch.Generator(DEV).manual_seed(length)
    kc, vc = randn(hkv, length + 100, d, g=g), randn(hkv, length + 100, d, g=g)
    q = randn(hq, n, d, g=g)
    got = ops.k.decode_attention(q, kc, vc, torch.tensor([0, length - n], device=DEV))
    return rel(got, sdpa64(q, kc[:, :length], vc[:, :length]))


def attend(ops: TorchOps, keys: torch.Tensor, values: torch.Tensor, past: int, q: torch.Tensor, k: torch.Tensor,
           v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, KVCache]:
    """ops.attend on a one-layer cache holding keys/values [Hkv, capacity, D] with `past` of them in use."""
    hkv, capacity, d = keys.shape
    cache = KVCache(1, hkv, d, capacity, BF16, DEV)
    cache.k[0], cache.v[0] = keys, values
    cache.used = past
    cache.begin(q.shape[0])
    out, rotated = ops.attend(cache, 0, q, k, v, cos, sin)
    cache.end()
    return out, rotated, cache


def attend_errors(ops: TritonOps, hq: int, hkv: int, d: int, n: int, length: int) -> dict[str, float]:
    """A decode step's attention as the model calls it (q, k, v [n, heads, D] views of one projection; RoPE at
    positions past..length-1): TritonOps.attend vs TorchOps.attend (output, rotated queries, stored keys) and both
    outputs vs float64."""
    g = torch.Generator(DEV).manual_seed(length + 1)
    past = length - n
    keys, values = randn(hkv, length + 100, d, g=g), randn(hkv, length + 100, d, g=g)
    q, k, v = randn(n, (hq + 2 * hkv) * d, g=g).split([hq * d, hkv * d, hkv * d], dim=-1)
    q, k, v = q.view(n, hq, d), k.view(n, hkv, d), v.view(n, hkv, d)
    inv_freq = 10000.0 ** -(torch.arange(0, d, 2, device=DEV, dtype=torch.float32) / d)
    freqs = torch.arange(past, length, device=DEV, dtype=torch.float32)[:, None] * inv_freq
    emb = torch.cat((freqs, freqs), -1)
    cos, sin = emb.cos().to(BF16), emb.sin().to(BF16)
    out_t, q_t, cache_t = attend(ops, keys, values, past, q, k, v, cos, sin)
    out_p, q_p, cache_p = attend(TORCH, keys, values, past, q, k, v, cos, sin)
    q64 = rotate(q.double().transpose(0, 1), cos.double(), sin.double())
    k64 = rotate(k.double().transpose(0, 1), cos.double(), sin.double())
    ref = sdpa64(q64, torch.cat((keys[:, :past].double(), k64), 1),
                 torch.cat((values[:, :past].double(), v.double().transpose(0, 1)), 1))
    stored = slice(past, length)
    assert torch.equal(cache_t.v[0, :, stored], cache_p.v[0, :, stored]), "values stored differently"
    assert torch.equal(cache_t.k[0, :, :past], keys[:, :past]), "the past keys changed"
    return {"out_vs_torch": rel(out_t, out_p), "out_float64": rel(out_t, ref), "torch_out_float64": rel(out_p, ref),
            "queries_vs_torch": rel(q_t, q_p), "queries_float64": rel(q_t, q64),
            "keys_vs_torch": rel(cache_t.k[0, :, stored], cache_p.k[0, :, stored]),
            "keys_float64": rel(cache_t.k[0, :, stored], k64)}


def elementwise_errors(ops: TritonOps) -> dict[str, float]:
    """RMSNorm, RoPE and SwiGLU: vs TorchOps and vs float references."""
    g = torch.Generator(DEV).manual_seed(2)
    x, w = randn(5, 576, g=g), randn(576, g=g)
    x64 = x.double()
    norm64 = w.double() * x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5)
    got = ops.rms_norm(x, w, 1e-5)
    out = {"rms_norm": rel(got, TORCH.rms_norm(x, w, 1e-5)), "rms_norm_float64": rel(got, norm64)}
    x = randn(7, 9, 64, g=g)
    ang = randn(7, 32, g=g, dtype=torch.float32)
    cos, sin = torch.cat((ang, ang), -1).cos(), torch.cat((ang, ang), -1).sin()
    got = ops.rope_heads(x, cos.to(BF16), sin.to(BF16))
    out["rope"] = rel(got, rotate(x.double().transpose(0, 1), cos.double(), sin.double()))
    out["rope_vs_torch"] = rel(got, TORCH.rope_heads(x, cos.to(BF16), sin.to(BF16)))
    gate_up = randn(3, 2 * 1536, g=g)
    got = ops.silu_mul(gate_up)
    gate, up = gate_up.double().chunk(2, -1)
    out["silu_mul"] = rel(got, F.silu(gate) * up)
    out["silu_mul_vs_torch"] = rel(got, TORCH.silu_mul(gate_up))
    return out


def gemv_key(case: tuple) -> str:
    m, n_out, k_in, _, _ = case
    return f"gemv_{m}x{n_out}x{k_in}"


def gemv_errors(ops: TritonOps, m: int, n_out: int, k_in: int, bias: bool, add: bool) -> dict[str, float]:
    """A decode projection (linear, or linear_add into a residual in place) vs float64 and vs cuBLAS (TorchOps)."""
    g = torch.Generator(DEV).manual_seed(m)
    x, w = randn(m, k_in, g=g), randn(n_out, k_in, g=g) / k_in ** 0.5
    b = randn(n_out, g=g) if bias else None
    r = randn(m, n_out, g=g) if add else None
    ref = x.double() @ w.double().T + (b.double() if bias else 0) + (r.double() if add else 0)

    def project(o: TorchOps) -> torch.Tensor:
        return o.linear_add(r.clone(), x, w, b) if add else o.linear(x, w, b)
    got = project(ops)
    return {"float64": rel(got, ref), "vs_torch": rel(got, project(TORCH))}


def selection_measures(ops: TritonOps) -> dict:
    """Chunk gather (Triton) == TorchOps' torch.gather == the chunks' tokens gathered by hand, tail included; chunks
    picked from bf16 means (as stored) vs float32 means: the overlap of the two selections."""
    g = torch.Generator(DEV).manual_seed(1)
    full = KVCache(4, 8, 128, 20000, BF16, DEV)
    full.k.normal_(generator=g)
    full.v.normal_(generator=g)
    length = full.used = 19003  # 2375 chunks of 8 and a tail of 3
    index = ChunkIndex.build(full, length, 8)
    queries = torch.randn(4, 8, 128, device=DEV, generator=g)
    ids = select_chunks(index, queries, 512)
    cut = index.num_chunks * 8
    exact = ChunkIndex(full.k[:, :, :cut].float().view(4, 8, -1, 8, 128).mean(3), 8, length)
    ref_ids = select_chunks(exact, queries, 512)
    same = sum(len(set(a.tolist()) & set(b.tolist())) for a, b in zip(ids.flatten(0, 1), ref_ids.flatten(0, 1)))
    into, want = retrieval_cache(full, index, 4096, 16), retrieval_cache(full, index, 4096, 16)
    gather_selection(full, index, ids, into, ops)
    gather_selection(full, index, ids, want, TORCH)
    tokens = torch.cat(((ids[..., None] * 8 + torch.arange(8, device=DEV)).flatten(2),
                        torch.arange(cut, length, device=DEV).expand(4, 8, -1)), -1)
    idx = tokens[..., None].expand(-1, -1, -1, 128)
    n = tokens.shape[-1]
    by_hand = (torch.gather(full.k[:, :, :length], 2, idx), torch.gather(full.v[:, :, :length], 2, idx))
    return {"gather_chunks_equal": torch.equal(into.k[:, :, :n], by_hand[0]) and
            torch.equal(into.v[:, :, :n], by_hand[1]),
            "gather_equals_torch_ops": torch.equal(into.k[:, :, :n], want.k[:, :, :n]) and
            torch.equal(into.v[:, :, :n], want.v[:, :, :n]),
            "selection_bf16_means_overlap": same / ids.numel()}


def greedy(model: Transformer, ops: TorchOps, graphs: Graphs | None, prompt: list[int], steps: int = 24,
           cache: type[KVCache] = KVCache) -> dict:
    """Greedy decoding of `steps` tokens after prefilling prompt[:-1], then a 7-token verification (rolled back)
    recording its queries, through `ops`, from CUDA graphs when `graphs` is given, on a `cache` of that class."""
    model.ops = ops
    a = model.args
    level = Level(model, cache(a.n_layers, a.n_kv_heads, a.head_dim, len(prompt) + steps + 200, BF16, DEV), [],
                  graphs)
    seq, logits = list(prompt), []
    with torch.inference_mode():
        list(level.prefill(seq[:-1], 1024))
        for _ in range(steps):
            out = level.logits(seq, 1, len(seq) - 1)
            logits.append(out[0])
            seq.append(int(out[0].argmax()))
        verify = model.head(level.states(seq, 7, len(seq) - 7, record=7))
        queries = torch.stack(level.queries)  # [layers, Hkv, 7, D]
    model.ops = None
    captured = sum(len(shapes) for layouts in graphs.by_cache.values() for shapes in layouts.values()) \
        if graphs else 0
    return {"tokens": seq[len(prompt):], "logits": torch.stack(logits), "verify": verify, "queries": queries,
            "graphs": captured}


def graph_model() -> tuple[Transformer, list[int]]:
    """The small random GQA model (9/3 heads) the graph checks decode, and its 3,000-token prompt."""
    torch.manual_seed(0)
    with torch.device(DEV):
        model = Transformer(LlamaConfig(**GRAPH_MODEL)).to(BF16).eval()
    model.fuse_projections()
    return model, torch.randint(0, 32000, (3000,)).tolist()


def graph_decode(ops: TritonOps) -> dict:
    """A small random GQA model (9/3 heads): eager TorchOps vs TritonOps replayed from CUDA graphs vs TritonOps
    eager: the same greedy tokens, logits, verification logits and recorded queries?"""
    model, prompt = graph_model()
    eager = greedy(model, TorchOps(), None, prompt)
    kernels = greedy(model, ops, None, prompt)
    graph = greedy(model, ops, Graphs(), prompt)
    return {"graph_tokens_equal": eager["tokens"] == graph["tokens"],
            "graph_logits_rel": rel(graph["logits"], eager["logits"]),
            "graph_verify_rel": rel(graph["verify"], eager["verify"]),
            "graph_queries_rel": rel(graph["queries"], eager["queries"]),
            "graphs_captured": graph["graphs"] > 0, "graphs_count": graph["graphs"],
            "graph_vs_triton_eager_tokens_equal": kernels["tokens"] == graph["tokens"],
            "graph_vs_triton_eager_logits_rel": rel(graph["logits"], kernels["logits"]),
            "graph_vs_triton_eager_verify_rel": rel(graph["verify"], kernels["verify"])}


def offloaded_graph_decode(ops: TritonOps) -> dict:
    """The same model decoding 300 tokens (across two of the offloaded cache's copied blocks) from CUDA graphs on a
    resident cache and on an offloaded one: bitwise the same logits, verification and queries?"""
    model, prompt = graph_model()
    resident = greedy(model, ops, Graphs(), prompt, 300)
    offloaded = greedy(model, ops, Graphs(), prompt, 300, OffloadedKVCache)
    return {"offloaded_graph_equal": all(torch.equal(resident[k], offloaded[k]) for k in ("logits", "verify",
                                                                                        "queries")),
            "offloaded_graphs_count": offloaded["graphs"]}


def measured() -> dict:
    """Every measurement above under the keys of the GPU result file's "check" (python -m bench.gpu --parts check)."""
    ops = triton_ops()
    out = {}
    for case in ATTENTION:
        out[attention_key(case)] = attention_error(ops, *case)
        out[attention_key(case) + "_attend_vs_torch"] = attend_errors(ops, *case)["out_vs_torch"]
    out.update(elementwise_errors(ops))
    for case in GEMV:
        errors = gemv_errors(ops, *case)
        out[gemv_key(case)], out[gemv_key(case) + "_vs_torch"] = errors["float64"], errors["vs_torch"]
    out.update(selection_measures(ops))
    out.update(graph_decode(ops))
    out.update(offloaded_graph_decode(ops))
    return out


# --- tests -----------------------------------------------------------------------------------------------------------

def test_cuda_models_compute_through_triton(triton):
    assert isinstance(ops_for(DEV), TritonOps)
    with torch.device("meta"):
        model = Transformer(LlamaConfig(**{**GRAPH_MODEL, "num_hidden_layers": 1}))
    model.to_empty(device=DEV)
    assert isinstance(model.ops, TritonOps)
    model.ops = TORCH
    assert model.ops is TORCH


@pytest.mark.parametrize("case", ATTENTION, ids=attention_key)
def test_decode_attention_kernel_matches_float64(triton, case):
    assert attention_error(triton, *case) <= TOL


@pytest.mark.parametrize("case", ATTENTION, ids=attention_key)
def test_triton_attend_matches_torch_ops(triton, case):
    assert_small(attend_errors(triton, *case))


def test_norm_rope_swiglu_kernels(triton):
    assert_small(elementwise_errors(triton))


@pytest.mark.parametrize("case", GEMV, ids=gemv_key)
def test_gemv_matches_float64_and_cublas(triton, case):
    assert_small(gemv_errors(triton, *case))


def fused_errors(ops: TritonOps, dim: int, hidden: int) -> dict[str, float]:
    """A drafting level's one-token step through the fused kernels: the norm folded into the q/k/v projection (with
    its bias), and the feed-forward as two kernels (norm into gate/up, SwiGLU into down, added to the residual), vs
    float64 and TorchOps. The feed-forward's output is large beside the residual, so that its error is not hidden
    in the rounding of their sum."""
    g = torch.Generator(DEV).manual_seed(dim)
    x, norm = randn(1, dim, g=g), 1.0 + randn(dim, g=g) / 4
    wqkv, bqkv = randn(dim + 256, dim, g=g) / dim ** 0.5, randn(dim + 256, g=g)
    gate_up, down = randn(2 * hidden, dim, g=g) / dim ** 0.5, randn(dim, hidden, g=g) * 4 / hidden ** 0.5
    x64 = x.double()
    normed64 = norm.double() * x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6)
    gate, up = (normed64 @ gate_up.double().T).chunk(2, -1)
    mlp64 = x64 + (F.silu(gate) * up) @ down.double().T
    drafting = ops.drafting()
    qkv = drafting.normed_linear(x, norm, 1e-6, wqkv, bqkv)
    mlp = drafting.mlp(x.clone(), norm, 1e-6, gate_up, down)
    return {"qkv_float64": rel(qkv, normed64 @ wqkv.double().T + bqkv.double()),
            "qkv_vs_torch": rel(qkv, TORCH.normed_linear(x, norm, 1e-6, wqkv, bqkv)),
            "mlp_float64": rel(mlp, mlp64), "mlp_vs_torch": rel(mlp, TORCH.mlp(x.clone(), norm, 1e-6, gate_up, down))}


@pytest.mark.parametrize("shape", [(1536, 8960), (576, 1536)])
def test_a_drafting_one_token_step_folds_the_norm_and_swiglu_into_its_projections(triton, shape):
    assert_small(fused_errors(triton, *shape))


def test_gemv_is_tuned_once_per_weight_shape(triton):
    """Every step size up to the kernel's rows reuses one tuning of a projection: none is paid mid-run."""
    from core.model import kernels
    g = torch.Generator(DEV).manual_seed(4)
    w = randn(2304, 832, g=g)
    for m in range(1, DECODE_TOKENS + 1):
        x = randn(m, 832, g=g)
        assert rel(triton.linear(x, w), x.double() @ w.double().T) <= TOL
    assert [key[:2] for key in kernels._gemv_tuned.cache].count((2304, 832)) == 1


def test_projections_go_to_cublas_without_the_gemv(triton):
    g = torch.Generator(DEV).manual_seed(3)
    x, w, r = randn(3, 576, g=g), randn(1536, 576, g=g), randn(3, 1536, g=g)
    cublas = triton_ops(gemv=False)
    assert torch.equal(cublas.linear(x, w), F.linear(x, w))
    assert torch.equal(cublas.linear_add(r.clone(), x, w), TORCH.linear_add(r.clone(), x, w))


def test_chunk_gather_and_bf16_mean_selection(triton):
    m = selection_measures(triton)
    assert m["gather_chunks_equal"] and m["gather_equals_torch_ops"]
    assert m["selection_bf16_means_overlap"] >= 0.99


PREFILL_MODEL = dict(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                     num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=65536,
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False)


def test_a_stop_during_a_long_gpu_prefill_lands_within_layers_not_after_the_queued_work():
    """The host queues a prefill forward's kernels in milliseconds and the GPU takes a good part of a second to run
    them (32K tokens in one forward): held a few layers ahead of the device, the host sees a Stop set a quarter of
    the way in, raises Stopped, and the device is idle well before the forward would have ended."""
    torch.manual_seed(0)
    with torch.device(DEV):
        model = Transformer(LlamaConfig(**PREFILL_MODEL)).to(BF16).eval().requires_grad_(False)
    ids = torch.randint(0, PREFILL_MODEL["vocab_size"], (32768,)).tolist()
    cache = KVCache(16, 8, 128, len(ids) + 16, BF16, DEV)

    def prefill(stop: threading.Event | None = None) -> None:
        cache.truncate(0)
        list(Level(model, cache, []).prefill(ids, len(ids), stop=stop))

    prefill()  # kernels chosen and memory allocated
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    prefill()
    torch.cuda.synchronize()
    whole = time.perf_counter() - t0
    stop = threading.Event()
    timer = threading.Timer(whole / 4, stop.set)
    t0 = time.perf_counter()
    timer.start()
    with pytest.raises(Stopped):
        prefill(stop)
    torch.cuda.synchronize()
    assert time.perf_counter() - t0 < 0.6 * whole, f"the device ran on after the Stop (whole forward {whole:.3f} s)"


def test_graph_replayed_decoding_matches_eager(triton):
    m = graph_decode(triton)
    assert m["graphs_count"] >= 2, "no decode step ran from a CUDA graph"
    assert m["graph_tokens_equal"] and m["graph_vs_triton_eager_tokens_equal"]
    assert_small({k: v for k, v in m.items() if k.endswith("_rel")})


def test_an_offloaded_cache_replays_its_steps_from_graphs_exactly_as_a_resident_one(triton):
    m = offloaded_graph_decode(triton)
    assert m["offloaded_graphs_count"] >= 2 and m["offloaded_graph_equal"]


# --- batch invariance: row i of a k-token step is bitwise the one-token step at its position -------------------------

# q heads, KV heads, head dim, keys cached before the step: MHA (7B), GQA 4 (8B), 6 (Qwen 1.5B), 7 (Qwen 0.5B), 3
INVARIANCE = [(32, 32, 128, 4097), (32, 8, 128, 100_000), (12, 2, 128, 30_000), (14, 2, 64, 777), (9, 3, 64, 2000)]


@pytest.mark.parametrize("case", INVARIANCE, ids=lambda c: f"{c[0]}x{c[1]}x{c[2]}_L{c[3]}")
def test_attention_rows_of_a_many_token_step_equal_one_token_steps(triton, case):
    hq, hkv, d, past = case
    g = torch.Generator(DEV).manual_seed(past)
    kc, vc = randn(hkv, past + 64, d, g=g), randn(hkv, past + 64, d, g=g)  # the new tokens' keys already stored
    for k in range(2, DECODE_TOKENS + 1):
        q = randn(hq, k, d, g=g)
        many = triton.k.decode_attention(q, kc, vc, torch.tensor([past, past], device=DEV))
        for i in range(k):
            one = triton.k.decode_attention(q[:, i:i + 1].contiguous(), kc, vc,
                                            torch.tensor([past + i, past + i], device=DEV))
            assert torch.equal(many[:, i], one[:, 0]), (k, i)


@pytest.mark.parametrize("shape", [(1536, 8960), (17920, 1536), (151936, 1536), (4096, 4096), (576, 49152)])
def test_projection_rows_of_a_many_token_step_equal_one_token_steps(triton, shape):
    """The GEMV as a plain projection, with a bias, added into a residual, and as float32 LM-head logits."""
    n_out, k_in = shape
    g = torch.Generator(DEV).manual_seed(n_out)
    w, b = randn(n_out, k_in, g=g) / k_in ** 0.5, randn(n_out, g=g)
    for k in (2, 3, 7, 13, 16, 17, 24, DECODE_TOKENS, 40, 3 * DECODE_TOKENS):  # both GEMV blocks; a batch's pieces
        x, r = randn(k, k_in, g=g), randn(k, n_out, g=g)
        outs = (triton.linear(x, w), triton.linear(x, w, b), triton.linear_add(r.clone(), x, w), triton.logits(x, w))
        for i in range(k):
            ones = (triton.linear(x[i:i + 1], w), triton.linear(x[i:i + 1], w, b),
                    triton.linear_add(r[i:i + 1].clone(), x[i:i + 1], w), triton.logits(x[i:i + 1], w))
            for many, one in zip(outs, ones):
                assert torch.equal(many[i], one[0]), (k, i)
        assert outs[3].dtype == torch.float32


def test_norm_rope_store_and_swiglu_rows_equal_one_token_steps(triton):
    g = torch.Generator(DEV).manual_seed(11)
    x, w = randn(16, 1536, g=g), randn(1536, g=g)
    gate_up = randn(16, 2 * 8960, g=g)
    q, kv = randn(16, 12, 128, g=g), randn(16, 2, 128, g=g)
    ang = randn(16, 64, g=g, dtype=torch.float32)
    cos, sin = torch.cat((ang, ang), -1).cos().to(BF16), torch.cat((ang, ang), -1).sin().to(BF16)
    for k in (2, 7, 16):
        norm, act = triton.rms_norm(x[:k], w, 1e-6), triton.silu_mul(gate_up[:k])
        caches = torch.zeros(2, 2, 64, 128, device=DEV, dtype=BF16), torch.zeros(2, 2, 64, 128, device=DEV, dtype=BF16)
        rotated = triton.k.rope_store(q[:k], kv[:k], kv[:k], cos[:k], sin[:k], caches[0][0], caches[1][0],
                                      torch.tensor([0, 8], device=DEV))
        for i in range(k):
            assert torch.equal(norm[i], triton.rms_norm(x[i:i + 1], w, 1e-6)[0])
            assert torch.equal(act[i], triton.silu_mul(gate_up[i:i + 1])[0])
            one = triton.k.rope_store(q[i:i + 1], kv[i:i + 1], kv[i:i + 1], cos[i:i + 1], sin[i:i + 1], caches[0][1],
                                      caches[1][1], torch.tensor([0, 8 + i], device=DEV))
            assert torch.equal(rotated[:, i], one[:, 0])
        assert torch.equal(caches[0][0][:, 8:8 + k], caches[0][1][:, 8:8 + k])


def near_tie_engine():
    """A random GQA model (12/2 heads, head dim 128, as Qwen2.5-1.5B) whose LM head is scaled down, so that its top
    two logits often lie within bf16 rounding of each other, with a smaller random draft of the same vocabulary."""
    from core.engine import Engine
    from tests.tiny import DigitTokenizer
    shape = dict(vocab_size=4096, hidden_size=768, intermediate_size=1024, num_hidden_layers=3,
                 num_attention_heads=4, num_key_value_heads=1, head_dim=128, max_position_embeddings=32768,
                 rope_parameters={"rope_type": "default", "rope_theta": 1e6}, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(DEV):
        target = Transformer(LlamaConfig(**{**shape, "num_attention_heads": 12, "num_key_value_heads": 2}))
        draft = Transformer(LlamaConfig(**{**shape, "num_hidden_layers": 1}))
    for model in (target, draft):
        model.to(BF16).eval().requires_grad_(False)
        model.fuse_projections()
        model.eos_ids = set()
    target.lm_head.weight.mul_(0.02)
    return Engine.from_models(target, DigitTokenizer(), "near-tie", draft, "draft", 8192)


@pytest.mark.parametrize("drafter,level2_cache,offload", [("none", "retrieval", "off"), ("ngram", "retrieval", "off"),
                                                          ("model", "retrieval", "off"), ("model", "streaming", "off"),
                                                          ("model", "retrieval", "on"), ("none", "retrieval", "on")])
def test_greedy_triforce_equals_autoregressive_in_bf16_where_logits_nearly_tie(triton, drafter, level2_cache, offload):
    from core.events import Finished
    engine = near_tie_engine()
    prompt = torch.randint(0, 4096, (3000,), generator=torch.Generator().manual_seed(1)).tolist()
    base = dict(greedy=True, max_new_tokens=64, budget=512, drafter=drafter, level2_cache=level2_cache,
                offload=offload)
    with torch.inference_mode():
        ar = next(e for e in engine.generate_ids(prompt, GenerationConfig(method="ar", **base))
                  if isinstance(e, Finished))
        for gamma2 in (6, 15, 20):  # 21 new tokens: level 3 is fed in two decode steps
            tf = next(e for e in engine.generate_ids(prompt, GenerationConfig(gamma2=gamma2, **base))
                      if isinstance(e, Finished))
            assert tf.token_ids == ar.token_ids, (gamma2, tf.stats.level2_acceptance)
    assert sum(m < 0.05 for _, m in ar.stats.near_ties) >= 5  # the premise: many steps decided by a near-tie


def test_batched_requests_equal_their_single_runs_in_bf16(triton):
    """Four requests decoded in one batch (graphs replayed over their caches side by side, rows in GEMV pieces): each
    greedy answer, of any method and draft length, equals its autoregressive single run where many logits nearly
    tie. (A sampled answer keeps its distribution, not its single run's tokens: a drafting level's one-row step
    folds its norms into the projections, a batch's many-row step does not, so level 2 draws from a distribution
    rounded otherwise.)"""
    from core.batching import Request
    from core.events import Finished
    engine = near_tie_engine()
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 4096, (n,), generator=g).tolist() for n in (3000, 1800, 2500, 900)]
    base = dict(max_new_tokens=48, budget=512, drafter="none")

    def alone(ids, **settings):
        return next(e for e in engine.generate_ids(ids, GenerationConfig(**base, **settings))
                    if isinstance(e, Finished)).token_ids

    def together(settings, slots=4):
        requests = [Request(str(i), ids=p, config=GenerationConfig(**base, **s))
                    for i, (p, s) in enumerate(zip(prompts, settings))]
        done = {t.key: t.event.token_ids for t in engine.generate_many(requests, slots) if isinstance(t.event, Finished)}
        return [done[str(i)] for i in range(len(prompts))]

    with torch.inference_mode():
        ar = [alone(p, method="ar", greedy=True) for p in prompts]
        for settings in ([dict(method="triforce", greedy=True, gamma2=g2) for g2 in (6, 15, 3, 9)],
                         [dict(method="auto", greedy=True)] * 4, [dict(method="ar", greedy=True)] * 4):
            assert together(settings) == ar, settings
