"""A CPU's operators (core.model.ops.CpuOps): projections through oneDNN on weights packed once, the same values as
PyTorch's, each row of a k-row product bitwise a 1-row product's; a decode step packs nothing again and builds its
causal mask once, whatever its layers; autograd and weights beyond the packing budget keep PyTorch's operators."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from core.cache.kvcache import KVCache
from core.decode.levels import Level
from core.model import ops as ops_module
from core.model.ops import TORCH, CpuOps, ops_for
from tests.tiny import tiny_config, tiny_pair

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch build has no oneDNN")


def weight(out: int, inp: int, seed: int = 0) -> nn.Parameter:
    return nn.Parameter(torch.randn(out, inp, generator=torch.Generator().manual_seed(seed)), requires_grad=False)


def test_a_cpu_engine_computes_with_cpu_ops():
    assert isinstance(ops_for("cpu"), CpuOps)


def test_packed_projections_match_pytorch_and_compute_each_row_as_a_one_row_input():
    ops, w = CpuOps(), weight(96, 64)
    bias = torch.randn(96)
    x = torch.randn(33, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        many = ops.linear(x, w, bias)
        torch.testing.assert_close(many, F.linear(x, w, bias), atol=1e-5, rtol=1e-5)
        for k in (1, 2, 3, 7, 32):  # a verification's rows are what one-token steps at those positions compute
            assert torch.equal(ops.linear(x[:k], w, bias), many[:k])
        residual = torch.randn(3, 96)
        want = residual + F.linear(x[:3], w)
        got = ops.linear_add(residual, x[:3], w)
        assert got.data_ptr() == residual.data_ptr()  # in place, as TorchOps' addmm_
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert ops.logits(x[:2], w).dtype == torch.float32
    assert ops.packings == 1  # one weight, packed once for all of it


def test_decode_steps_pack_no_weight_again_and_match_pytorch():
    _, model = tiny_pair(tiny_config(layers=3, vocab=128, max_position=512))
    model.requires_grad_(False)
    ids = torch.randint(0, 128, (80,), generator=torch.Generator().manual_seed(3)).tolist()
    a = model.args
    logits = {}
    for name, ops in (("torch", TORCH), ("cpu", CpuOps())):
        model.ops = ops
        level = Level(model, KVCache(a.n_layers, a.n_kv_heads, a.head_dim, 128, torch.float32, "cpu"), [])
        list(level.prefill(ids[:60], 32))
        logits[name] = [level.logits(ids[:61 + i], 1 + i % 3, 60 + i) for i in range(12)]  # 1, 2 and 3 rows
        if name == "cpu":  # every projection and the head, once: a step packs nothing, however many rows it has
            assert ops.packings == 7 * a.n_layers + 1
    model.ops = None
    for got, want in zip(logits["cpu"], logits["torch"]):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_a_weight_changed_in_place_is_packed_again_and_a_dead_one_frees_its_copy():
    ops, w = CpuOps(), weight(64, 64)
    x = torch.randn(2, 64)
    with torch.no_grad():
        ops.linear(x, w)
        w.mul_(2.0)  # as an optimiser's step does
        torch.testing.assert_close(ops.linear(x, w), F.linear(x, w), atol=1e-5, rtol=1e-5)
    assert ops.packings == 2 and ops.packed_bytes == w.nbytes
    del w
    gc.collect()
    assert ops.packed_bytes == 0 and not ops._packs


def test_weights_beyond_the_budget_and_autograd_keep_pytorch_operators():
    small, big = weight(32, 64, 1), weight(512, 64, 2)
    ops = CpuOps(budget=small.nbytes)
    x = torch.randn(3, 64)
    with torch.no_grad():
        ops.linear(x, small)
        torch.testing.assert_close(ops.linear(x, big), F.linear(x, big))
    assert ops.packings == 1 and ops.packed_bytes == small.nbytes
    trained = nn.Parameter(torch.randn(16, 64))  # requires grad: training sees PyTorch's operators
    out = ops.linear(x, trained)
    out.sum().backward()
    assert trained.grad is not None and ops.packings == 1


def test_a_decode_step_builds_its_causal_mask_once_whatever_its_layers():
    _, model = tiny_pair(tiny_config(layers=4, vocab=96, max_position=256))
    model.requires_grad_(False)
    a = model.args
    level = Level(model, KVCache(a.n_layers, a.n_kv_heads, a.head_dim, 64, torch.float32, "cpu"), [])
    ids = list(range(1, 40))
    list(level.prefill(ids[:30], 32))
    ops_module.decode_mask.cache_clear()
    level.logits(ids[:34], 4, 30)  # one 4-row step over 4 layers
    info = ops_module.decode_mask.cache_info()
    assert (info.misses, info.hits) == (1, a.n_layers - 1)
