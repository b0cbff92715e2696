"""Our compact model computes the same logits as transformers' own implementations."""

import gc
import weakref

import pytest
import torch

from core.cache.kvcache import KVCache
from core.model.ops import TORCH
from tests.tiny import tiny_config, tiny_pair

ROPES = {
    "default": {},
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
}


def full_cache(model, capacity: int) -> KVCache:
    a = model.args
    return KVCache(a.n_layers, a.n_kv_heads, a.head_dim, capacity, torch.float32, "cpu")


def check_logits(hf, ours, ids: torch.Tensor, pieces: bool = True, atol: float = 1e-4) -> None:
    """One forward over ids, and the same ids fed in three pieces through the cache, both match transformers.
    (Dynamic NTK RoPE changes its frequencies with the length seen so far, so cached pieces differ by design.)"""
    with torch.no_grad():
        want = hf(ids[None]).logits[0]
        got = ours(ids, full_cache(ours, len(ids)))
        torch.testing.assert_close(got, want, atol=atol, rtol=1e-4)
        if not pieces:
            return
        cache = full_cache(ours, len(ids))
        cut = [0, len(ids) // 2, len(ids) - 1, len(ids)]
        pieces = [ours(ids[a:b], cache) for a, b in zip(cut, cut[1:])]
        torch.testing.assert_close(torch.cat(pieces), want, atol=atol, rtol=1e-4)


@pytest.mark.parametrize("rope", list(ROPES))
def test_llama_rope_types_match_transformers(rope):
    hf, ours = tiny_pair(tiny_config("llama", rope=ROPES[rope], max_position=64))
    ids = torch.randint(0, 96, (150,), generator=torch.Generator().manual_seed(1))  # past the 64 trained positions
    check_logits(hf, ours, ids, pieces=rope != "dynamic")


@pytest.mark.parametrize("family", ["mistral", "qwen2", "qwen3"])
def test_other_families_match_transformers(family):
    hf, ours = tiny_pair(tiny_config(family))
    ids = torch.randint(0, 96, (40,), generator=torch.Generator().manual_seed(2))
    check_logits(hf, ours, ids)


def test_qwen2_uses_qkv_bias():
    _, ours = tiny_pair(tiny_config("qwen2"))
    assert ours.layers[0].self_attn.q_proj.bias is not None
    assert ours.layers[0].self_attn.o_proj.bias is None


def test_embedded_model_matches_transformers(embedded):
    from transformers import AutoModelForCausalLM

    from core.io.loading import _cache_dir, embedded_source

    hf = AutoModelForCausalLM.from_pretrained(_cache_dir(embedded_source()), dtype=torch.float32).eval()
    ids = torch.tensor(embedded.tokenizer("The quick brown fox jumps over the lazy dog. " * 12)["input_ids"])
    # Two float32 sums of 30 layers in different orders: transformers' logits are 6e-5 from a float64 forward, ours
    # 1.0e-4 with MKL's GEMM (F.linear) and 1.2e-4 with the CPU's oneDNN (CpuOps), 1.2e-4 from each other at most.
    check_logits(hf, embedded.target, ids, atol=2e-4)


def flash_reference(q, k, v, causal):
    """flash-attn's documented semantics on [B, S, H, D] tensors: GQA by head groups, a causal mask aligned to the
    bottom-right corner (query i sees keys up to i + Sk - Sq)."""
    assert causal and q.shape[-1] == k.shape[-1] and q.stride(-1) == 1 and k.stride(-1) == 1
    sq, hq, sk, hkv = q.shape[1], q.shape[2], k.shape[1], k.shape[2]
    k = k.repeat_interleave(hq // hkv, dim=2).float()
    v = v.repeat_interleave(hq // hkv, dim=2).float()
    scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), k) / q.shape[-1] ** 0.5
    allowed = torch.ones(sq, sk, dtype=torch.bool).tril(diagonal=sk - sq)
    weights = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("bhqk,bkhd->bqhd", weights, v).to(q.dtype)


def test_prefill_uses_flash_attn_when_installed(monkeypatch):
    """The optional flash-attn path (prefill on a GPU) hands it the right layout: same output as SDPA."""
    import core.model.ops as ops
    calls = []

    def fake_flash(q, k, v, causal):
        calls.append(q.shape)
        return flash_reference(q, k, v, causal)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(6, 5, 16, generator=g, dtype=torch.bfloat16)
    k = torch.randn(2, 12, 16, generator=g, dtype=torch.bfloat16)
    v = torch.randn(2, 12, 16, generator=g, dtype=torch.bfloat16)
    want = ops.attention(q, k, v, past=7)
    monkeypatch.setattr(ops, "flash_attention", lambda q: fake_flash)
    got = ops.attention(q, k, v, past=7)
    assert calls == [(1, 5, 6, 16)]
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


def test_dequantised_gguf_cache_is_keyed_by_content(tmp_path):
    """One cached checkpoint per model: the same file in two places shares it, another file does not."""
    import struct

    from core.io.inputs import GGUF_MAGIC
    from core.io.loading import Source, _cache_dir
    header = struct.pack("<IIQQ", GGUF_MAGIC, 3, 1, 1)  # one tensor and one metadata entry: a header that reads
    for name, data in (("a", header + b"same bytes" * 20), ("b", header + b"same bytes" * 20),
                       ("c", header + b"other bytes" * 20)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "m.gguf").write_bytes(data)
    a, b, c = (_cache_dir(Source("m", str(tmp_path / n), "m.gguf")) for n in "abc")
    assert a == b != c and a.name.startswith("m-")


def test_fused_projections_keep_no_copy_of_the_separate_weights():
    """Fusing q/k/v and gate/up leaves the separate projections as views of the fused weight, even for a model whose
    parameters still require grad (an autograd node must not keep the old weights alive: 9 GB at the 7B shape)."""
    from core.model.transformer import Transformer

    model = Transformer(tiny_config())
    old = weakref.ref(model.layers[0].self_attn.q_proj.weight)
    model.fuse_projections()
    gc.collect()
    att, mlp = model.layers[0].self_attn, model.layers[0].mlp
    assert old() is None
    assert att.q_proj.weight.data_ptr() == att.wqkv.data_ptr() and mlp.gate_proj.weight.data_ptr() == mlp.w13.data_ptr()


def test_row_wise_cpu_ops_compute_each_row_as_a_one_row_input():
    """On a CPU the row-wise operators (RMSNorm, RoPE, SwiGLU) give row i of a k-row input bit for bit what a 1-row
    input gives; projections go to the BLAS library, whose blocking may depend on the row count, so bitwise
    identity of a whole step is a property of the GPU kernels (tests/test_gpu.py), not promised here."""
    from core.model.ops import TORCH
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(16, 576, generator=g), torch.randn(576, generator=g)
    heads = torch.randn(16, 9, 64, generator=g)
    ang = torch.randn(16, 32, generator=g)
    cos, sin = torch.cat((ang, ang), -1).cos(), torch.cat((ang, ang), -1).sin()
    gate_up = torch.randn(16, 3072, generator=g)
    for k in (2, 7, 16):
        norm, rope, act = TORCH.rms_norm(x[:k], w, 1e-5), TORCH.rope_heads(heads[:k], cos[:k], sin[:k]), \
            TORCH.silu_mul(gate_up[:k])
        for i in range(k):
            assert torch.equal(norm[i], TORCH.rms_norm(x[i:i + 1], w, 1e-5)[0])
            assert torch.equal(rope[:, i], TORCH.rope_heads(heads[i:i + 1], cos[i:i + 1], sin[i:i + 1])[:, 0])
            assert torch.equal(act[i], TORCH.silu_mul(gate_up[i:i + 1])[0])


def test_decode_steps_project_through_the_gemv_and_a_drafting_level_s_one_token_steps_through_fused_kernels():
    """TritonOps (here over a stand-in for core.model.kernels that records its calls): a decode step's projections, the
    LM head included, go to the GEMV, whose rows do not depend on the row count, with RMSNorm and SwiGLU kernels of
    their own; the drafting operators (levels 1 and 2) do the same for several tokens, but a one-token step folds
    each norm into the projection after it and SwiGLU into the down projection. All compute what TorchOps does."""
    from types import SimpleNamespace

    from core.model.ops import TritonOps

    calls = []

    def gemv(x, weight, bias, out, accumulate=True):
        calls.append(("gemv", weight.shape[0]))
        y = torch.nn.functional.linear(x, weight, bias)
        return y if out is None else out.copy_(y) if not accumulate else out.add_(y)

    def gemv_one(x, weight, bias=None, out=None, norm=None, swiglu=False):
        calls.append(("norm" if norm else "swiglu" if swiglu else "one", weight.shape[0]))
        x = TORCH.rms_norm(x, *norm) if norm else TORCH.silu_mul(x) if swiglu else x
        y = torch.nn.functional.linear(x, weight, bias)
        return y if out is None else out.add_(y)

    kernels = SimpleNamespace(gemv=gemv, gemv_one=gemv_one, silu_mul=TORCH.silu_mul, rms_norm=TORCH.rms_norm)
    invariant = TritonOps(kernels)
    g = torch.Generator().manual_seed(0)
    norm, gate_up, down, qkv, head = (torch.randn(*s, generator=g) for s in ((8,), (32, 8), (8, 16), (24, 8), (50, 8)))
    unfused = [("gemv", 32), ("gemv", 8), ("gemv", 24), ("gemv", 50)]
    for ops, rows, expected in ((invariant, 1, unfused), (invariant.drafting(), 3, unfused),
                                (invariant.drafting(), 1, [("norm", 32), ("swiglu", 8), ("norm", 24), ("gemv", 50)])):
        calls.clear()
        x = torch.randn(rows, 8, generator=g)
        torch.testing.assert_close(ops.mlp(x.clone(), norm, 1e-5, gate_up, down),
                                   TORCH.mlp(x.clone(), norm, 1e-5, gate_up, down))
        torch.testing.assert_close(ops.normed_linear(x, norm, 1e-5, qkv), TORCH.normed_linear(x, norm, 1e-5, qkv))
        logits = ops.logits(x, head)
        assert logits.dtype == torch.float32 and torch.allclose(logits, TORCH.logits(x, head), atol=1e-5)
        assert calls == expected
    assert invariant.drafting().drafting() is invariant.drafting() and TORCH.drafting() is TORCH


def test_tokens_fed_on_the_device_join_a_level_once_settled_and_compute_what_host_ids_do():
    """A level fed its own draws on the device (Level.follow) computes what it computes fed the same ids from the
    host, and once their ids are settled it holds them as its sequence, so its next forward feeds only what is new
    (a placeholder left in it would roll the cache back to there and feed the draft again)."""
    from core.decode.levels import Level
    _, model = tiny_pair(tiny_config(layers=2))
    prompt = torch.randint(0, 96, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    draws = [17, 4, 61]
    with torch.no_grad():
        host = Level(model, full_cache(model, 64), [])
        list(host.prefill(prompt[:-1], 16))
        expected = host.logits(prompt + draws, 1)
        device = Level(model, full_cache(model, 64), [])
        list(device.prefill(prompt[:-1], 16))
        device.states(prompt, 1)
        for token in draws[:-1]:
            device.follow(torch.tensor([token]))
        got = device.head(device.follow(torch.tensor([draws[-1]])))
        assert device.tokens[:len(prompt)] == prompt and len(device.tokens) == len(prompt) + len(draws)
        device.settle(draws)
        assert device.tokens == prompt + draws
        torch.testing.assert_close(got, expected)
