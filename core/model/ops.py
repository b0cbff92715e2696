"""The one place that chooses how a model computes on its device: plain PyTorch operators (any device, autograd,
the reference), on a CPU oneDNN projections on weights packed once, or, on CUDA, Triton kernels for decode steps. A
model holds one Ops (`Transformer.ops`); its caches only store keys and values."""

from __future__ import annotations

import functools
import os
import weakref
from types import ModuleType
from typing import Callable, Protocol

import torch
import torch.nn.functional as F

from core.config import BATCH_TOKENS, DECODE_TOKENS



class AttentionCache(Protocol):
    """What the model needs from a cache: host bookkeeping for n new tokens (begin), their positions as a device
    tensor, each layer's key/value buffers [Hkv, capacity, D] (slots [0, used) hold the past, the new tokens go
    next), a hook after each layer attended, and end. Everything after begin is device work (CUDA-graph safe)."""

    used: int
    meta: torch.Tensor  # on CUDA: [first position, first slot] of the new tokens, read by the decode kernels

    def begin(self, n: int) -> None: ...

    def positions(self) -> torch.Tensor: ...

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]: ...

    def attended(self, i: int) -> None: ...

    def end(self) -> None: ...


class Parts(Protocol):
    """A step over several sequences at once (core.cache.ragged.Ragged): its rows are theirs in order, `parts` says
    each one's cache and rows; attention runs per part, every other operator over all rows together."""

    parts: list[tuple[AttentionCache, int]]


@functools.cache
def flash_attn_func() -> Callable | None:
    """flash_attn.flash_attn_func when the optional flash-attn package imports, else None."""
    try:
        from flash_attn import flash_attn_func as func
    except ImportError:
        return None
    return func


def flash_attention(q: torch.Tensor) -> Callable | None:
    """flash-attn's kernel for a multi-token (prefill) step when it is installed and fits q, else None (SDPA)."""
    fits = q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256
    return flash_attn_func() if fits else None


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Apply RoPE to x [..., n, head_dim] with cos/sin [n, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


@functools.lru_cache(maxsize=2)
def decode_mask(n: int, past: int, group: int, device: torch.device) -> torch.Tensor:
    """The causal mask [group * n, past + n] of a decode step's n new tokens, one row per query head of a group and
    token. It depends on the step, not the layer: every layer of a step shares one (built per layer, the 8K-token
    mask of a 3-row step cost 30 builds of ~0.12 ms on a CPU)."""
    return torch.ones(n, past + n, dtype=torch.bool, device=device).tril(diagonal=past).repeat(group, 1)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int) -> torch.Tensor:
    """Causal GQA attention of n new queries [Hq, n, D] over keys [Hkv, past + n, D] (4-D for SDPA's fast paths)."""
    hq, n, d = q.shape
    hkv = k.shape[0]
    if n > 1 and (flash := flash_attention(q)):  # [1, tokens, heads, D] views; bottom-right causal
        return flash(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                     causal=True)[0].transpose(0, 1)
    if n <= DECODE_TOKENS:  # a decode step: the group's heads x new tokens become rows of one KV head (no K/V copies)
        group = hq // hkv
        mask = None if n == 1 else decode_mask(n, past, group, q.device)
        out = F.scaled_dot_product_attention(q.reshape(1, hkv, group * n, d), k[None], v[None], attn_mask=mask)
        return out.view(hq, n, d)
    gqa = hq != hkv
    if past == 0:
        return F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, enable_gqa=gqa)[0]
    if q.is_cuda:  # bottom-right causal without a materialised mask: flash / cuDNN / efficient backends
        from torch.nn.attention.bias import causal_lower_right  # here: importing it loads torch._dynamo (1.7 s)
        bias = causal_lower_right(n, past + n)
        return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=bias, enable_gqa=gqa)[0]
    mask = torch.ones(n, past + n, dtype=torch.bool, device=q.device).tril(diagonal=past)
    return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, enable_gqa=gqa)[0]


class TorchOps:
    """PyTorch operators: any device, differentiable, and the reference the kernels are checked against."""

    name = "torch"
    device_steps = False  # whether decode steps read lengths from device memory (CUDA-graph safe)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """weight * x / rms(x), computed in float32, rounded to x's dtype before the weight."""
        dtype = x.dtype
        xf = x.float()
        return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)

    def rope_heads(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """RoPE of x [..., n, heads, D], returned head-major [..., heads, n, D]."""
        return rotate(x.transpose(-3, -2), cos, sin)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, weight, bias)

    def logits(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Float32 logits x @ weight.T of the LM head."""
        return F.linear(x, weight).float()

    def normed_linear(self, x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
        """rms_norm(x) @ weight.T (+ bias): a pre-norm layer's first projection, one op so that it may be one kernel."""
        return self.linear(self.rms_norm(x, norm_weight, eps), weight, bias)

    def mlp(self, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float, gate_up: torch.Tensor,
            down: torch.Tensor) -> torch.Tensor:
        """residual + the SwiGLU feed-forward of rms_norm(residual): down(silu(gate) * up), gate rows first."""
        hidden = self.silu_mul(self.linear(self.rms_norm(residual, norm_weight, eps), gate_up))
        return self.linear_add(residual, hidden, down)

    def drafting(self) -> TorchOps:
        """The operators for a level whose output is only a draft (levels 1 and 2): no need to compute a row of a
        many-token step exactly as a one-token step, so the fastest kernel may serve each shape."""
        return self

    def linear_add(self, residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
        """residual + x @ weight.T (+ bias); in place (the add rides in the GEMM) when no gradient needs residual."""
        if bias is not None or residual.requires_grad or residual.dim() != 2:
            return residual + F.linear(x, weight, bias)
        return residual.addmm_(x, weight.t())

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """SwiGLU activation of [..., 2I] (gate first)."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def attend(self, cache: AttentionCache | Parts, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q, k [n, heads, D], store k and v in the cache's layer at its next slots, attend causally over the
        layer's stored keys. Returns the output and the rotated queries, both [Hq, n, D]. A step over several
        sequences (Parts) attends each part's rows over its own cache: each as a step of that sequence alone."""
        parts = getattr(cache, "parts", None)
        if parts is None:
            return self.attend_one(cache, layer, q, k, v, cos, sin)
        outs, queries, a = [], [], 0
        for part, n in parts:
            out, rotated = self.attend_one(part, layer, q[a:a + n], k[a:a + n], v[a:a + n], cos[a:a + n],
                                           sin[a:a + n])
            outs.append(out)
            queries.append(rotated)
            a += n
        return torch.cat(outs, 1), torch.cat(queries, 1)

    def attend_one(self, cache: AttentionCache, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """attend over one sequence's cache."""
        q, k = self.rope_heads(q, cos, sin), self.rope_heads(k, cos, sin)
        keys, values = cache.layer(layer)
        s, n = cache.used, q.shape[1]
        keys[:, s:s + n] = k
        values[:, s:s + n] = v.transpose(0, 1)
        out = attention(q, keys[:, :s + n], values[:, :s + n], s)
        cache.attended(layer)
        return out, q

    def gather_chunks(self, k: torch.Tensor, v: torch.Tensor, chunk_ids: torch.Tensor, chunk_size: int,
                      k_out: torch.Tensor, v_out: torch.Tensor) -> None:
        """k_out/v_out[l, h, j*cs:(j+1)*cs] = k/v[l, h, id*cs:(id+1)*cs] for id = chunk_ids[l, h, j]."""
        n = chunk_ids.shape[-1] * chunk_size
        offsets = torch.arange(chunk_size, device=chunk_ids.device)
        tokens = (chunk_ids[..., None] * chunk_size + offsets).flatten(2)  # [layers, kv_heads, n_select * cs]
        idx = tokens[..., None].expand(-1, -1, -1, k.shape[-1])
        torch.gather(k, 2, idx, out=k_out[:, :, :n])
        torch.gather(v, 2, idx, out=v_out[:, :, :n])


class TritonOps(TorchOps):
    """CUDA decode steps through Triton kernels: split-K attention over the cache in place (lengths read from device
    memory), fused RoPE + store, RMSNorm, SwiGLU, a GEMV for every projection and the LM head (adding into the
    residual where one follows), and a chunk gather. Each computes a row of a k-row step exactly as a 1-row step
    (core.model.kernels says how), so greedy TriForce is token-identical to autoregressive decoding. The drafting
    levels' operators (`drafting()`) need no such match: their one-token steps fold each RMSNorm into the projection
    after it and SwiGLU into the down projection (core.model.kernels.gemv_one). Longer inputs (prefill) keep cuBLAS
    and SDPA."""

    name = "triton"
    device_steps = True

    def __init__(self, kernels: ModuleType, gemv: bool = True, invariant: bool = True):
        self.k = kernels
        self.gemv = gemv  # False: cuBLAS projections (TRIFORCE_GEMV=0), to compare
        self.invariant = invariant  # False: a drafting level's (its one-token steps through fused kernels)
        self._drafting: TritonOps | None = None

    def _gemv(self, x: torch.Tensor) -> bool:
        """A decode step's rows, one sequence's or a batch's (BATCH_TOKENS: the kernel takes them DECODE_TOKENS at a
        time, each row as a one-row step); a prefill's go to cuBLAS."""
        return self.gemv and x.dim() == 2 and x.shape[0] <= BATCH_TOKENS

    def _fused(self, x: torch.Tensor) -> bool:
        """Whether x is a drafting level's one-token step (the fused kernels' case)."""
        return not self.invariant and self._gemv(x) and x.shape[0] == 1

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self.k.rms_norm(x, weight, eps)

    def rope_heads(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return self.k.rope(x, cos, sin) if x.dim() == 3 else super().rope_heads(x, cos, sin)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self.k.gemv(x, weight, bias, None) if self._gemv(x) else F.linear(x, weight, bias)

    def logits(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """A decode step's logits from the GEMV, accumulated and written in float32 (no bf16 rounding of them)."""
        if not self._gemv(x):
            return super().logits(x, weight)
        out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32, device=x.device)
        return self.k.gemv(x, weight, None, out, accumulate=False)

    def normed_linear(self, x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
        if self._fused(x):
            return self.k.gemv_one(x, weight, bias, norm=(norm_weight, eps))
        return super().normed_linear(x, norm_weight, eps, weight, bias)

    def mlp(self, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float, gate_up: torch.Tensor,
            down: torch.Tensor) -> torch.Tensor:
        """Fused: two kernels, the norm riding in the gate/up projection and SwiGLU in the down one (not four)."""
        if self._fused(residual):
            hidden = self.k.gemv_one(residual, gate_up, norm=(norm_weight, eps))
            return self.k.gemv_one(hidden, down, out=residual, swiglu=True)
        return super().mlp(residual, norm_weight, eps, gate_up, down)

    def drafting(self) -> TorchOps:
        if not self.invariant:
            return self
        if self._drafting is None:
            self._drafting = TritonOps(self.k, self.gemv, invariant=False)
        return self._drafting

    def linear_add(self, residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
        if self._gemv(x):
            return self.k.gemv(x, weight, bias, residual)
        return super().linear_add(residual, x, weight, bias)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.k.silu_mul(gate_up) if gate_up.dim() == 2 else super().silu_mul(gate_up)

    def attend_one(self, cache: AttentionCache, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A decode step: one kernel rotates q and k and stores k, v at the slots in cache.meta; split-K attention
        reads the layer in place. Longer inputs: the PyTorch path."""
        if q.shape[0] > DECODE_TOKENS:
            return super().attend_one(cache, layer, q, k, v, cos, sin)
        keys, values = cache.layer(layer)
        q = self.k.rope_store(q, k, v, cos, sin, keys, values, cache.meta)
        out = self.k.decode_attention(q, keys, values, cache.meta)
        cache.attended(layer)
        return out, q

    def gather_chunks(self, k: torch.Tensor, v: torch.Tensor, chunk_ids: torch.Tensor, chunk_size: int,
                      k_out: torch.Tensor, v_out: torch.Tensor) -> None:
        self.k.gather_chunks(k, v, chunk_ids, chunk_size, k_out, v_out)


TORCH = TorchOps()

# Packed copies of the weights a CPU engine computes with are held up to this many bytes (each is as large as its
# weight): all of a model up to half a billion float32 parameters; a larger one's later weights stay unpacked.
CPU_PACK_BYTES = 2 << 30
PACK_ROWS = 4  # the rows oneDNN is told to expect when it packs a weight: flat from 1 to 4 rows, and fast at 2,048


class CpuOps(TorchOps):
    """A CPU's inference: every projection and the LM head through oneDNN on float32 weights packed once into its
    blocked layout (a packed copy per weight, made on first use, remade after the weight changes in place); autograd,
    other dtypes and 3-D inputs keep the PyTorch operators. A decode step reads every weight once whatever its rows,
    so a few rows should cost about what one does; through F.linear (MKL's float32 GEMM, which on a few rows ran far
    below the memory's speed on the 2-core AMD EPYC dev machine) a SmolLM2-135M forward on level 2's 512-token cache
    took 24, 42, 48 and 54 ms for 1, 2, 3 and 7 rows and its LM head 5 to 18 ms; through packed oneDNN 21, 22, 23 and
    26 ms, the head 1.3 to 1.9 ms (medians, python -m bench.cpu_steps). A packed product also computes each row of a
    k-row input bitwise as a 1-row input (MKL runs a GEMV for one row, a GEMM for more)."""

    name = "cpu"

    def __init__(self, budget: int = CPU_PACK_BYTES):
        self.budget, self.packed_bytes, self.packings = budget, 0, 0
        self.usable = torch.backends.mkldnn.is_available()
        # id(weight): (a weak reference to it, its version when packed, the packed copy, its bytes)
        self._packs: dict[int, tuple[weakref.ref, int, torch.Tensor, int]] = {}

    def packed(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
        """weight packed for oneDNN when this product may use it (else None: F.linear computes it)."""
        if not (self.usable and x.dim() == 2 and x.device.type == "cpu" and x.dtype == weight.dtype == torch.float32):
            return None
        if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
            return None
        key = id(weight)
        entry = self._packs.get(key)
        if entry is not None and entry[0]() is weight and entry[1] == weight._version:
            return entry[2]
        if entry is not None:  # changed in place (or a new tensor where a dead one was): packed afresh
            self._forget(key)
        if self.packed_bytes + weight.nbytes > self.budget:
            return None
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS)
        except (RuntimeError, AttributeError):  # a build without oneDNN's linear: PyTorch operators from now on
            self.usable = False
            return None
        self._packs[key] = (weakref.ref(weight, lambda _, key=key: self._forget(key)), weight._version, packed,
                            weight.nbytes)
        self.packed_bytes += weight.nbytes
        self.packings += 1
        return packed

    def _forget(self, key: int) -> None:
        """Drop the packed copy of a weight that died or changed."""
        entry = self._packs.pop(key, None)
        if entry is not None:
            self.packed_bytes -= entry[3]

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        packed = self.packed(x, weight)
        if packed is None:
            return super().linear(x, weight, bias)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")

    def logits(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return self.linear(x, weight).float()

    def linear_add(self, residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.packed(x, weight) is None:
            return super().linear_add(residual, x, weight, bias)
        out = self.linear(x, weight, bias)
        return residual.add_(out) if not residual.requires_grad and residual.dim() == 2 else residual + out


def ops_for(device: torch.device | str) -> TorchOps:
    """Triton kernels on a CUDA device where Triton imports, packed oneDNN projections on a CPU, PyTorch operators
    elsewhere."""
    return _ops_for(torch.device(device).type)


@functools.cache
def _ops_for(device_type: str) -> TorchOps:
    if device_type == "cpu":
        return CpuOps()
    if device_type != "cuda":
        return TORCH
    try:
        from core.model import kernels
    except ImportError:
        return TORCH
    return TritonOps(kernels, gemv=os.environ.get("TRIFORCE_GEMV", "1") != "0")
