"""Static KV caches: one class for the full and the retrieval cache, a subclass for StreamingLLM."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from core.model import Rotary, rotate


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int) -> torch.Tensor:
    """Causal GQA attention of n new queries [Hq, n, D] over keys [Hkv, past + n, D] (4-D for SDPA's fast paths)."""
    hq, n, d = q.shape
    hkv = k.shape[0]
    if n == 1:  # one query: the group's heads become rows of one KV head, no mask, no K/V expansion
        out = F.scaled_dot_product_attention(q.reshape(1, hkv, hq // hkv, d), k[None], v[None])
        return out.view(hq, 1, d)
    gqa = hq != hkv
    if past == 0:
        return F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, enable_gqa=gqa)[0]
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

    def begin(self, n: int) -> torch.Tensor:
        if self.used + n > self.capacity:
            raise RuntimeError(f"KV cache full: {self.used} + {n} > {self.capacity}")
        self._n = n
        return torch.arange(self.seq_len, self.seq_len + n, device=self.k.device)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        s, n = self.used, self._n
        self.k[layer, :, s:s + n] = k
        self.v[layer, :, s:s + n] = v
        if self.record_rows:
            rows = q[:, -self.record_rows:]
            self.queries[layer] = rows.view(k.shape[0], -1, *rows.shape[1:]).sum(1)  # [Hkv, rows, D]
        return attention(q, self.k[layer, :, :s + n], self.v[layer, :, :s + n], s)

    def end(self) -> None:
        self.used += self._n

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

    def truncate(self, seq_len: int) -> None:
        drop = self._seq_len - seq_len
        if not 0 <= drop <= self.used - self.sink:
            raise ValueError(f"cannot truncate streaming cache to {seq_len}")
        self.used -= drop
        self._seq_len = seq_len

    def skip(self, n: int) -> None:
        """Account for n sequence tokens that are never stored (the middle of a long prompt)."""
        self._seq_len += n

    def begin(self, n: int) -> torch.Tensor:
        if self.used + n > self.capacity:
            self._evict(self.used + n - self.sink - self.window)
        if self.used + n > self.capacity:
            raise RuntimeError(f"{n} tokens do not fit a streaming cache of {self.capacity}")
        self._n = n
        return torch.arange(self.used, self.used + n, device=self.k.device)

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
