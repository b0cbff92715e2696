"""The full KV cache in CPU memory (pinned next to a GPU), streamed to the device one layer at a time.

Each forward copies layer i's keys/values host→device into one of two staging buffers on a side stream while the
device computes layer i-1, so a step over a long cache costs about its bytes over the host link; the new tokens'
keys/values go back to the host as each layer finishes. The same code runs with a CPU "device" (copies are then
plain and synchronous), which is how the tests exercise it.

A decode step replays from a CUDA graph like a resident one while a pass over the cache is short (an eager step of
a small model spends more time launching kernels than its copies take; long passes hide the launches). A graph bakes
in the sizes and addresses of its copies, so a step copies a window fixed by the block of BLOCK rows its first new
token falls in: rows up to two blocks from that block's start in, those two blocks back out (the rows there besides
the new ones go back unchanged; at most 16 new tokens always fit). A graph then serves every step starting in the
same block: one capture per shape per BLOCK tokens generated, a few hundred rows more over the link per step.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from core.cache.kvcache import KVCache, pinned_empty

BLOCK = 256  # rows per copied block
# A graph saves a step the host's launch time (some 20-30 ms for a small model's eager step) and costs, at each new
# capture, one more pass over the cache. Passes of up to GRAPH_BYTES (~40 ms over a 55 GB/s link) replay; beyond,
# the copies hide the launches and the steps stay eager.
GRAPH_BYTES = 2 * 10**9


class OffloadedKVCache(KVCache):
    """A KVCache whose storage [layers, Hkv, capacity, D] lives in host memory; `layer(i)` hands the model a staged
    device copy of layer i, prefetched while earlier layers compute."""

    resident = False

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, capacity: int, dtype: torch.dtype,
                 device: torch.device | str, buffers: int = 2):
        super().__init__(n_layers, n_kv_heads, head_dim, capacity, dtype, device)
        self.staging = [(torch.empty(n_kv_heads, capacity, head_dim, dtype=dtype, device=self.device),
                         torch.empty(n_kv_heads, capacity, head_dim, dtype=dtype, device=self.device))
                        for _ in range(min(buffers, n_layers))]
        self.stream = torch.cuda.Stream(self.device) if self.on_cuda else None
        self.loaded = [torch.cuda.Event() if self.on_cuda else None for _ in self.staging]
        self.free = [torch.cuda.Event() if self.on_cuda else None for _ in self.staging]
        self.moved = 0  # bytes copied between host and device so far (the host link's load)
        self._rows = 0  # rows staged per layer in the current pass
        self._back = (0, 0)  # the rows [lo, hi) the current step copies back per layer (it copies [0, hi) in)

    def _buffers(self, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        pin = self.device.type == "cuda"  # page-locked: copies run at the link's speed and asynchronously
        return pinned_empty(shape, dtype, pin), pinned_empty(shape, dtype, pin)

    def _side(self) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def _row_bytes(self) -> int:
        """Bytes of one row of keys and values of one layer."""
        return 2 * self.k.shape[1] * self.k.shape[3] * self.k.element_size()

    def _fetch(self, i: int) -> None:
        """Copy rows [0, self._rows) of layer i into its staging buffer on the side stream, once the buffer is free."""
        b = i % len(self.staging)
        k, v = self.staging[b]
        with self._side():
            if self.stream is not None:
                self.stream.wait_event(self.free[b])
            for h in range(k.shape[0]):  # per head: each a contiguous block, copied without a host-side temporary
                k[h, :self._rows].copy_(self.k[i, h, :self._rows], non_blocking=True)
                v[h, :self._rows].copy_(self.v[i, h, :self._rows], non_blocking=True)
            if self.stream is not None:
                self.loaded[b].record(self.stream)

    def _start(self, rows: int) -> None:
        """A pass over the layers begins: once the device work queued before it is done, stage the first ones."""
        self._rows = rows
        if self.stream is not None:
            for free in self.free:
                free.record(torch.cuda.current_stream(self.device))
        for i in range(len(self.staging)):
            self._fetch(i)

    def _done(self, i: int) -> None:
        """The device work queued so far is all that uses layer i's buffer."""
        if self.stream is not None:
            self.free[i % len(self.staging)].record(torch.cuda.current_stream(self.device))

    def _next(self, i: int) -> None:
        """Stage the layer that reuses layer i's buffer."""
        if i + len(self.staging) < self.k.shape[0]:
            self._fetch(i + len(self.staging))

    def begin(self, n: int) -> None:
        super().begin(n)
        lo = self.used // BLOCK * BLOCK
        hi = min(self.capacity, max(lo + 2 * BLOCK, -(-(self.used + n) // BLOCK) * BLOCK))  # wider: a prefill chunk
        self._back = (lo, hi)
        self.moved += self.k.shape[0] * (hi + hi - lo) * self._row_bytes()
        if self.stream is not None:  # nothing left on the side stream (a stream_layers pass closed early) runs late
            torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def replays(self) -> bool:
        return self.k.shape[0] * self.used * self._row_bytes() <= GRAPH_BYTES

    def layout(self) -> tuple[int, ...]:
        return self._back

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i staged on the device ([Hkv, capacity, D]; slots [0, used) valid, the new tokens go next)."""
        if i == 0:
            self._start(self._back[1])
        return self._staged(i)

    def attended(self, i: int) -> None:
        """Send layer i's block of new keys/values back to the host, then stage the layer that reuses its buffer;
        after the last layer the device's own stream waits for the side stream's copies (a graph's join)."""
        k, v = self.staging[i % len(self.staging)]
        lo, hi = self._back
        self._done(i)
        with self._side():
            if self.stream is not None:
                self.stream.wait_event(self.free[i % len(self.staging)])
            for h in range(k.shape[0]):
                self.k[i, h, lo:hi].copy_(k[h, lo:hi], non_blocking=True)
                self.v[i, h, lo:hi].copy_(v[h, lo:hi], non_blocking=True)
        self._next(i)
        if i == self.k.shape[0] - 1 and self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def stream_layers(self, length: int) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        self._start(length)
        self.moved += self.k.shape[0] * length * self._row_bytes()
        for i in range(self.k.shape[0]):
            k, v = self._staged(i)
            yield i, k[:, :length], v[:, :length]
            self._done(i)
            self._next(i)

    def _staged(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's staging buffer once its copy has arrived (the device's stream waits for it)."""
        b = i % len(self.staging)
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_event(self.loaded[b])
        return self.staging[b]

    def read(self, a: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.on_cuda:
            torch.cuda.synchronize(self.device)  # the newest rows may still be on their way to the host
        return super().read(a, b)
