"""Retrieval cache selection: chunk-mean keys, per layer and KV head top-k chunks by query . mean key."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from core.kvcache import CachePool, KVCache


@dataclass
class ChunkIndex:
    """Mean post-RoPE key of each full chunk of the first `length` cached tokens; the partial tail is always kept."""

    mean_keys: torch.Tensor  # [layers, kv_heads, chunks, head_dim], the cache's dtype
    chunk_size: int
    length: int

    @property
    def num_chunks(self) -> int:
        return self.mean_keys.shape[2]

    @property
    def tail(self) -> int:
        return self.length - self.num_chunks * self.chunk_size

    @classmethod
    def build(cls, full: KVCache, length: int, chunk_size: int) -> "ChunkIndex":
        """Means computed in float32, stored in the cache's dtype (half the memory and read time in bf16)."""
        n = length // chunk_size
        layers, heads, _, d = full.k.shape
        mean = torch.empty(layers, heads, n, d, dtype=full.k.dtype, device=full.k.device)
        for layer in range(layers):  # one layer at a time: a float32 copy of a whole long cache would not fit
            keys = full.k[layer, :, :n * chunk_size].float()
            mean[layer] = keys.view(heads, n, chunk_size, d).mean(2)
        return cls(mean, chunk_size, length)


def chunks_to_keep(index: ChunkIndex, budget: int) -> int:
    """How many chunks a budget buys (all of them when the budget covers the prompt)."""
    return min(budget // index.chunk_size, index.num_chunks)


def chunk_scores(mean_keys: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
    """query . mean key [layers, kv_heads, chunks] in float32: one batched GEMV; bf16 means on a GPU are multiplied
    as they are, with float32 output (ranking thousands of scores needs more than bf16's 8 bits)."""
    layers, heads, chunks, d = mean_keys.shape
    m = mean_keys.flatten(0, 1)
    if m.is_cuda and m.dtype != torch.float32:
        q = queries.to(m.dtype).flatten(0, 1)[..., None]
        return torch.bmm(m, q, out_dtype=torch.float32).view(layers, heads, chunks)
    return torch.bmm(m.float(), queries.float().flatten(0, 1)[..., None]).view(layers, heads, chunks)


def select_chunks(index: ChunkIndex, queries: torch.Tensor, n_select: int) -> torch.Tensor:
    """Sorted chunk ids [layers, kv_heads, n_select] with the highest query . mean-key scores; chunk 0 always.

    queries: [layers, kv_heads, head_dim], the query heads of each GQA group summed (the sum of the group's scores).
    """
    scores = chunk_scores(index.mean_keys, queries)
    if index.num_chunks:
        scores[:, :, 0] = float("inf")  # the attention sink
    return scores.topk(n_select, dim=-1).indices.sort(dim=-1).values


def gather_selection(full: KVCache, index: ChunkIndex, chunk_ids: torch.Tensor, into: KVCache) -> None:
    """Fill into's head slots with the selected chunks' keys/values, followed by the partial tail chunk."""
    cs = index.chunk_size
    n = chunk_ids.shape[-1] * cs
    if full.kernels is not None:  # CUDA: one kernel copying whole chunks
        full.kernels.gather_chunks(full.k, full.v, chunk_ids, cs, into.k, into.v)
    else:
        offsets = torch.arange(cs, device=chunk_ids.device)
        tokens = (chunk_ids[..., None] * cs + offsets).flatten(2)  # [layers, kv_heads, n_select * cs]
        idx = tokens[..., None].expand(-1, -1, -1, full.k.shape[-1])
        torch.gather(full.k[:, :, :index.length], 2, idx, out=into.k[:, :, :n])
        torch.gather(full.v[:, :, :index.length], 2, idx, out=into.v[:, :, :n])
    tail = slice(index.length - index.tail, index.length)
    into.k[:, :, n:n + index.tail] = full.k[:, :, tail]
    into.v[:, :, n:n + index.tail] = full.v[:, :, tail]


def retrieval_cache(full: KVCache, index: ChunkIndex, budget: int, extra: int, pool: CachePool | None = None
                    ) -> KVCache:
    """An empty retrieval cache sized for `budget` prompt tokens (+ tail) and `extra` later tokens (from `pool`
    when one fits; its capacity then also covers any tail, so one cache serves prompts of any length)."""
    head = chunks_to_keep(index, budget) * index.chunk_size + index.tail
    n_layers, n_kv, _, d = full.k.shape
    if pool is None:
        return KVCache(n_layers, n_kv, d, head + extra, full.k.dtype, full.k.device, head=head, start=index.length)
    shape = (n_layers, n_kv, budget + index.chunk_size + extra, d)
    cache = pool.take(lambda c: type(c) is KVCache and c.k.shape[:2] == shape[:2] and c.k.shape[3] == d
                      and c.capacity >= head + extra and c.k.dtype == full.k.dtype,
                      lambda: KVCache(n_layers, n_kv, d, shape[2], full.k.dtype, full.k.device))
    cache.reset(head, index.length)
    return cache
