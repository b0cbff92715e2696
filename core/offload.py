"""The full KV cache in CPU memory (pinned next to a GPU), streamed to the device one layer at a time.

Each forward copies layer i's keys/values host→device into one of two staging buffers on a side stream while the
device computes layer i-1, so a step over a long cache costs about its bytes over the host link; the new tokens'
keys/values go back to the host as each layer finishes. The same code runs with a CPU "device" (copies are then
plain and synchronous), which is how the tests exercise it.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from core.kvcache import KVCache, pinned_empty


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

    def _buffers(self, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        pin = self.device.type == "cuda"  # page-locked: copies run at the link's speed and asynchronously
        return pinned_empty(shape, dtype, pin), pinned_empty(shape, dtype, pin)

    def _side(self) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def _fetch(self, i: int, rows: int) -> None:
        """Copy rows [0, rows) of layer i into its staging buffer on the side stream, once the buffer is free."""
        b = i % len(self.staging)
        k, v = self.staging[b]
        with self._side():
            if self.stream is not None:
                self.stream.wait_event(self.free[b])
            for h in range(k.shape[0]):  # per head: each a contiguous block, copied without a host-side temporary
                k[h, :rows].copy_(self.k[i, h, :rows], non_blocking=True)
                v[h, :rows].copy_(self.v[i, h, :rows], non_blocking=True)
            if self.stream is not None:
                self.loaded[b].record(self.stream)
        self.moved += 2 * k[:, :rows].numel() * k.element_size()

    def _start(self, rows: int) -> None:
        """A pass over the layers begins: stage the first ones."""
        self._rows = rows
        for i in range(len(self.staging)):
            self._fetch(i, rows)

    def _done(self, i: int) -> None:
        """The device work queued so far is all that uses layer i's buffer."""
        if self.stream is not None:
            self.free[i % len(self.staging)].record(torch.cuda.current_stream(self.device))

    def _next(self, i: int) -> None:
        """Stage the layer that reuses layer i's buffer."""
        if i + len(self.staging) < self.k.shape[0]:
            self._fetch(i + len(self.staging), self._rows)

    def begin(self, n: int) -> None:
        super().begin(n)
        self._start(self.used)

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i staged on the device ([Hkv, capacity, D]; slots [0, used) valid, the new tokens go next)."""
        b = i % len(self.staging)
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_event(self.loaded[b])
        return self.staging[b]

    def attended(self, i: int) -> None:
        """Send layer i's new keys/values back to the host, then stage the layer that reuses its buffer."""
        k, v = self.staging[i % len(self.staging)]
        s, n = self.used, self._n
        self._done(i)
        with self._side():
            if self.stream is not None:
                self.stream.wait_event(self.free[i % len(self.staging)])
            for h in range(k.shape[0]):
                self.k[i, h, s:s + n].copy_(k[h, s:s + n], non_blocking=True)
                self.v[i, h, s:s + n].copy_(v[h, s:s + n], non_blocking=True)
        self.moved += 2 * k[:, s:s + n].numel() * k.element_size()
        self._next(i)

    def stream_layers(self, length: int) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        self._start(length)
        for i in range(self.k.shape[0]):
            k, v = self.layer(i)
            yield i, k[:, :length], v[:, :length]
            self._done(i)
            self._next(i)

    def read(self, a: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.stream is not None:
            self.stream.synchronize()  # the newest rows may still be on their way to the host
        return super().read(a, b)
