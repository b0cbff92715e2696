"""Static KV caches: one class for the full and the retrieval cache, a subclass for StreamingLLM."""

from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from core.model import Rotary, gpu_kernels, rotate, rotate_heads


FOLD_QUERIES = 16  # up to this many new tokens attend as rows of their KV head (measured faster on a CPU)


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


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int) -> torch.Tensor:
    """Causal GQA attention of n new queries [Hq, n, D] over keys [Hkv, past + n, D] (4-D for SDPA's fast paths)."""
    hq, n, d = q.shape
    hkv = k.shape[0]
    if n > 1 and (flash := flash_attention(q)):  # [1, tokens, heads, D] views; causal is bottom-right aligned
        return flash(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                     causal=True)[0].transpose(0, 1)
    if n <= FOLD_QUERIES:  # a decode step: the group's heads x new tokens become rows of one KV head (no K/V copies)
        group = hq // hkv
        mask = None if n == 1 else \
            torch.ones(n, past + n, dtype=torch.bool, device=q.device).tril(diagonal=past).repeat(group, 1)
        out = F.scaled_dot_product_attention(q.reshape(1, hkv, group * n, d), k[None], v[None], attn_mask=mask)
        return out.view(hq, n, d)
    gqa = hq != hkv
    if past == 0:
        return F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, enable_gqa=gqa)[0]
    if q.is_cuda:  # bottom-right causal without a materialised mask: flash / cuDNN / efficient backends
        bias = causal_lower_right(n, past + n)
        return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=bias, enable_gqa=gqa)[0]
    mask = torch.ones(n, past + n, dtype=torch.bool, device=q.device).tril(diagonal=past)
    return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, enable_gqa=gqa)[0]


class KVCache:
    """Per-layer key/value buffers [layers, kv_heads, capacity, head_dim].

    Slots [0, head) hold a fixed set of already-rotated keys (the retrieved part of a prompt; empty for a full
    cache); slots [head, used) hold consecutive sequence positions from `start`.
    """

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, capacity: int, dtype: torch.dtype,
                 device: torch.device | str, head: int = 0, start: int = 0):
        shape = (n_layers, n_kv_heads, capacity, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.head, self.start, self.used = head, start, head
        self.record_rows = 0  # > 0: keep the group-summed queries of the last rows of each forward (for retrieval)
        self.queries: list[torch.Tensor | None] = [None] * n_layers
        self._n = 0
        # CUDA decode path: [first position, first slot] of the new tokens on the device, so that attention reads
        # lengths from memory and a CUDA graph of a step stays valid as the cache grows.
        self.kernels = gpu_kernels() if torch.device(device).type == "cuda" else None
        if self.kernels:
            self.meta = torch.zeros(2, dtype=torch.int64, device=device)
            self.steps = torch.arange(self.kernels.MAX_QUERIES, device=device)
        self.graphs: dict = {}  # CUDA graphs captured on these buffers (core.cuda_graphs)

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    @property
    def seq_len(self) -> int:
        """Number of sequence tokens this cache accounts for."""
        return self.start + self.used - self.head

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def slot(self, pos: int) -> int:
        return self.head + pos - self.start

    def truncate(self, seq_len: int) -> None:
        """Forget every token at position >= seq_len."""
        if not self.start <= seq_len <= self.seq_len:
            raise ValueError(f"cannot truncate to {seq_len}: cache covers {self.start}..{self.seq_len}")
        self.used = self.slot(seq_len)

    def begin(self, n: int) -> None:
        """Host bookkeeping before n new tokens (outside any CUDA graph)."""
        if self.used + n > self.capacity:
            raise RuntimeError(f"KV cache full: {self.used} + {n} > {self.capacity}")
        self._n = n
        if self.fast:
            self.meta.copy_(torch.tensor([self._first_position(), self.used]), non_blocking=True)

    @property
    def fast(self) -> bool:
        """Whether this step takes the device-side path (Triton split-K attention, lengths in device memory)."""
        return self.kernels is not None and self._n <= self.kernels.MAX_QUERIES

    def _first_position(self) -> int:
        return self.seq_len

    def positions(self) -> torch.Tensor:
        """Sequence positions of the new tokens (a device tensor)."""
        if self.fast:
            return self.meta[0] + self.steps[:self._n]
        return torch.arange(self._first_position(), self._first_position() + self._n, device=self.k.device)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> torch.Tensor:
        """Rotate q, k [n, heads, D] with cos/sin, store k and v, attend; on the CUDA decode path one kernel rotates
        and stores (slots read from self.meta) and split-K attention reads the cache in place."""
        if not self.fast:
            return self.store_and_attend(layer, rotate_heads(q, cos, sin), rotate_heads(k, cos, sin),
                                         v.transpose(0, 1))
        q = self.kernels.rope_store(q, k, v, cos, sin, self.k[layer], self.v[layer], self.meta)
        self._record(layer, q)
        return self.kernels.decode_attention(q, self.k[layer], self.v[layer], self.meta)

    def store_and_attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store rotated k, v [Hkv, n, D] at the next slots and attend with rotated q [Hq, n, D]."""
        s, n = self.used, self._n
        self._record(layer, q)
        self.k[layer, :, s:s + n] = k
        self.v[layer, :, s:s + n] = v
        return attention(q, self.k[layer, :, :s + n], self.v[layer, :, :s + n], s)

    def _record(self, layer: int, q: torch.Tensor) -> None:
        if self.record_rows:
            rows = q[:, -self.record_rows:]
            self.queries[layer] = rows.reshape(self.k.shape[1], -1, *rows.shape[1:]).sum(1)  # [Hkv, rows, D]

    def end(self) -> None:
        self.used += self._n

    def reset(self, head: int = 0, start: int = 0) -> None:
        """Empty the cache for reuse (its buffers and CUDA graphs stay)."""
        self.head, self.start, self.used = head, start, head
        self.record_rows = 0

    def copy_positions(self, src: "KVCache", a: int, b: int) -> None:
        """Overwrite positions [a, b) with src's keys/values for them."""
        self.k[:, :, self.slot(a):self.slot(b)] = src.k[:, :, src.slot(a):src.slot(b)]
        self.v[:, :, self.slot(a):self.slot(b)] = src.v[:, :, src.slot(a):src.slot(b)]


class StreamingCache(KVCache):
    """StreamingLLM: `sink` first tokens + the most recent `window`; positions are slots, so evicting re-rotates
    the kept recent keys (RoPE of p - e equals RoPE of p rotated by -e)."""

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, sink: int, window: int, slack: int,
                 rotary: Rotary, dtype: torch.dtype, device: torch.device | str):
        super().__init__(n_layers, n_kv_heads, head_dim, sink + window + slack, dtype, device)
        self.sink, self.window, self.rotary = sink, window, rotary
        self._seq_len = 0

    @property
    def seq_len(self) -> int:
        return self._seq_len

    def reset(self, head: int = 0, start: int = 0) -> None:
        super().reset()
        self._seq_len = 0

    def truncate(self, seq_len: int) -> None:
        drop = self._seq_len - seq_len
        if not 0 <= drop <= self.used - self.sink:
            raise ValueError(f"cannot truncate streaming cache to {seq_len}")
        self.used -= drop
        self._seq_len = seq_len

    def skip(self, n: int) -> None:
        """Account for n sequence tokens that are never stored (the middle of a long prompt)."""
        self._seq_len += n

    def begin(self, n: int) -> None:
        if self.used + n > self.capacity:
            self._evict(self.used + n - self.sink - self.window)
        if self.used + n > self.capacity:
            raise RuntimeError(f"{n} tokens do not fit a streaming cache of {self.capacity}")
        super().begin(n)

    def _first_position(self) -> int:
        return self.used  # positions are slots

    def end(self) -> None:
        super().end()
        self._seq_len += self._n

    def _evict(self, e: int) -> None:
        e = min(e, self.used - self.sink)
        if e <= 0:
            return
        s, u = self.sink, self.used
        angle = -e * self.rotary.inv_freq.to(self.k.device)
        emb = torch.cat((angle, angle))
        cos, sin = emb.cos().to(self.k.dtype), emb.sin().to(self.k.dtype)
        self.k[:, :, s:u - e] = rotate(self.k[:, :, s + e:u].clone(), cos, sin)
        self.v[:, :, s:u - e] = self.v[:, :, s + e:u].clone()
        self.used -= e


class CachePool:
    """Static caches kept for later generations of one engine, so that the CUDA graphs captured on them are reused."""

    def __init__(self):
        self.caches: list[KVCache] = []
        self.taken: set[int] = set()

    def release(self) -> None:
        """A new generation starts: every cache is free again."""
        self.taken.clear()

    def take(self, fits: Callable[[KVCache], bool], make: Callable[[], KVCache]) -> KVCache:
        """A free cache that `fits`, else a new one from make()."""
        c = next((c for c in self.caches if id(c) not in self.taken and fits(c)), None)
        if c is None:
            c = make()
            self.caches.append(c)
        self.taken.add(id(c))
        return c
