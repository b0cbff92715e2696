"""Static KV caches: one class for the full and the retrieval cache, a subclass for StreamingLLM."""

from __future__ import annotations

import weakref
from typing import Iterator

import torch

from core.model.transformer import Rotary
from core.config import DECODE_TOKENS
from core.model.ops import rotate

def pinned_empty(shape: tuple[int, ...], dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """An uninitialised host tensor, page-locked when `pin` (registered at its exact size: the caching pinned
    allocator would round a large block up to a power of two)."""
    t = torch.empty(shape, dtype=dtype)
    if pin and t.numel():
        cudart = torch.cuda.cudart()
        err = cudart.cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
        if int(err) != 0:
            raise MemoryError(f"could not page-lock {t.numel() * t.element_size() / 2**30:.1f} GiB of host memory "
                              f"(CUDA error {int(err)})")
        weakref.finalize(t, cudart.cudaHostUnregister, t.data_ptr())
    return t


class KVCache:
    """Per-layer key/value buffers [layers, kv_heads, capacity, head_dim].

    Slots [0, head) hold a fixed set of already-rotated keys (the retrieved part of a prompt; empty for a full
    cache); slots [head, used) hold consecutive sequence positions from `start`.
    """

    resident = True  # the storage is where the model computes (an offloaded cache streams it there layer by layer)
    moved = 0  # bytes copied between host and device memory so far (an offloaded cache's host-link load)

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, capacity: int, dtype: torch.dtype,
                 device: torch.device | str, head: int = 0, start: int = 0):
        self.device = torch.device(device)  # where the model computes with it (a subclass may store elsewhere)
        self.k, self.v = self._buffers((n_layers, n_kv_heads, capacity, head_dim), dtype)
        self.head, self.start, self.used = head, start, head
        self._n = 0
        # On CUDA, [first position, first slot] of the new tokens also live in device memory, so that decode kernels
        # read lengths from there and a CUDA graph of a step stays valid as the cache grows.
        self.on_cuda = self.device.type == "cuda"
        if self.on_cuda:
            self.meta = torch.zeros(2, dtype=torch.int64, device=device)
            self.steps = torch.arange(DECODE_TOKENS, device=device)

    def _buffers(self, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The key and value storage [layers, kv_heads, capacity, head_dim]."""
        return torch.zeros(shape, dtype=dtype, device=self.device), torch.zeros(shape, dtype=dtype, device=self.device)

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
        if self.on_cuda:
            self.meta.copy_(torch.tensor([self._first_position(), self.used]), non_blocking=True)

    def _first_position(self) -> int:
        return self.seq_len

    def positions(self) -> torch.Tensor:
        """Sequence positions of the new tokens (a device tensor; read from device memory on CUDA decode steps)."""
        if self.on_cuda and self._n <= DECODE_TOKENS:
            return self.meta[0] + self.steps[:self._n]
        return torch.arange(self._first_position(), self._first_position() + self._n, device=self.device)

    def replays(self) -> bool:
        """Whether its decode steps are worth replaying from CUDA graphs (always, for a resident cache)."""
        return True

    def layout(self) -> tuple[int, ...]:
        """What a CUDA graph of the step begun last depends on besides its shape: nothing here (the lengths are read
        from device memory); an offloaded cache's copied blocks."""
        return ()

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's key and value buffers [Hkv, capacity, D]."""
        return self.k[i], self.v[i]

    def attended(self, i: int) -> None:
        """Layer i of the current step has stored its new keys/values and attended (a hook for subclasses)."""

    def stream_layers(self, length: int) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """(layer, keys, values) of positions' slots [0, length) [Hkv, length, D] on the compute device, one layer
        at a time (a layer's tensors are valid until the next is asked for)."""
        for i in range(self.k.shape[0]):
            yield i, self.k[i, :, :length], self.v[i, :, :length]

    def read(self, a: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions [a, b), [layers, Hkv, b - a, D]."""
        return self.k[:, :, self.slot(a):self.slot(b)], self.v[:, :, self.slot(a):self.slot(b)]

    def end(self) -> None:
        self.used += self._n

    def reset(self, head: int = 0, start: int = 0) -> None:
        """Empty the cache for reuse (its buffers stay, and so do CUDA graphs captured on them)."""
        self.head, self.start, self.used = head, start, head

    def copy_positions(self, src: "KVCache", a: int, b: int) -> None:
        """Write positions [a, b) with src's keys/values for them (a <= seq_len: the cache then ends at b or later)."""
        k, v = src.read(a, b)
        self.k[:, :, self.slot(a):self.slot(b)] = k
        self.v[:, :, self.slot(a):self.slot(b)] = v
        self.used = max(self.used, self.slot(b))


class StreamingCache(KVCache):
    """StreamingLLM: `sink` first tokens + the most recent `window` in `capacity` slots (what is over sink + window
    is room for new tokens before the oldest recent ones are evicted); positions are slots, so evicting re-rotates
    the kept recent keys (RoPE of p - e equals RoPE of p rotated by -e)."""

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, capacity: int, sink: int, window: int,
                 rotary: Rotary, dtype: torch.dtype, device: torch.device | str):
        super().__init__(n_layers, n_kv_heads, head_dim, capacity, dtype, device)
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
        # the stored tokens are consecutive unless some were evicted or skipped: then only the recent ones can go
        droppable = self.used if self._seq_len == self.used else self.used - self.sink
        if not 0 <= drop <= droppable:
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
        angle = -e * self.rotary.inv_freq.to(self.device)
        emb = torch.cat((angle, angle))
        cos, sin = emb.cos().to(self.k.dtype), emb.sin().to(self.k.dtype)
        self.k[:, :, s:u - e] = rotate(self.k[:, :, s + e:u].clone(), cos, sin)
        self.v[:, :, s:u - e] = self.v[:, :, s + e:u].clone()
        self.used -= e
