"""Level 2's retrieval cache: chunk-mean keys, per layer and KV head the top-k chunks by query . mean key (or, as
the paper's ablation, StreamingLLM's first and most recent chunks), gathered from the full cache, re-selected as a
policy says."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from core.config import GenerationConfig
from core.events import RetrievalSelection
from core.cache.kvcache import KVCache, pinned_empty
from core.model.ops import TORCH, TorchOps


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
    def build(cls, full: KVCache, length: int, chunk_size: int, device: torch.device | None = None) -> "ChunkIndex":
        """Means computed in float32 one head of one layer at a time (a float32 copy of a long cache, or of one of its
        layers beside an offloaded run's other buffers, would not fit), stored in the cache's dtype (half the memory
        and read time in bf16) on `device` (default: the cache's compute device)."""
        n = length // chunk_size
        layers, heads, _, d = full.k.shape
        device = device or full.device
        shape = (layers, heads, n, d)
        mean = pinned_empty(shape, full.k.dtype, full.on_cuda) if device.type == "cpu" else \
            torch.empty(shape, dtype=full.k.dtype, device=device)
        for layer, keys, _ in full.stream_layers(n * chunk_size):
            for head in range(heads):
                mean[layer, head].copy_(keys[head].float().view(n, chunk_size, d).mean(1), non_blocking=True)
        return cls(mean, chunk_size, length)


def chunks_to_keep(chunks: int, budget: int, chunk_size: int) -> int:
    """How many of a prompt's `chunks` a budget buys (all of them when it covers the prompt)."""
    return min(budget // chunk_size, chunks)


def chunk_scores(mean_keys: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
    """query . mean key [layers, kv_heads, chunks] in float32 on the queries' device: one batched GEMV; bf16 means on
    a GPU are multiplied as they are, with float32 output (ranking thousands of scores needs more than bf16's 8
    bits). Means kept in CPU memory next to a GPU are brought over one layer at a time."""
    if mean_keys.device != queries.device:
        return torch.cat([chunk_scores(m.to(queries.device, non_blocking=True)[None], q[None])
                          for m, q in zip(mean_keys, queries)])
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


@dataclass
class SinkAndRecent:
    """StreamingLLM at the same budget: the first `sink_chunks` chunks and the most recent others, whatever the
    queries (the paper's ablation of the retrieval cache)."""

    sink_chunks: int

    def __call__(self, index: ChunkIndex, queries: torch.Tensor, n_select: int) -> torch.Tensor:
        """Chunk ids [layers, kv_heads, n_select], the same for every layer and KV head."""
        sink = min(self.sink_chunks, n_select)
        ids = torch.cat([torch.arange(sink), torch.arange(index.num_chunks - n_select + sink, index.num_chunks)])
        return ids.to(index.mean_keys.device).expand(*index.mean_keys.shape[:2], -1)


class ChunkSelector(Protocol):
    """Sorted chunk ids [layers, kv_heads, n_select] for level 2's cache, given the level-3 queries."""

    def __call__(self, index: ChunkIndex, queries: torch.Tensor, n_select: int) -> torch.Tensor: ...


LEVEL2_CACHES: dict[str, Callable[[GenerationConfig], ChunkSelector]] = {
    "retrieval": lambda cfg: select_chunks,
    "streaming": lambda cfg: SinkAndRecent(-(-cfg.sink_tokens // cfg.chunk_size)),
}


def gather_selection(full: KVCache, index: ChunkIndex, chunk_ids: torch.Tensor, into: KVCache,
                     ops: TorchOps = TORCH) -> None:
    """Fill into's head slots with the selected chunks' keys/values, followed by the partial tail chunk."""
    cs = index.chunk_size
    n = chunk_ids.shape[-1] * cs
    tail = slice(index.length - index.tail, index.length)
    if full.resident:  # the whole cache is on the device: one launch
        ops.gather_chunks(full.k[:, :, :index.length], full.v[:, :, :index.length], chunk_ids, cs, into.k, into.v)
        into.k[:, :, n:n + index.tail] = full.k[:, :, tail]
        into.v[:, :, n:n + index.tail] = full.v[:, :, tail]
        return
    for i, k, v in full.stream_layers(index.length):  # as each layer reaches the device
        ops.gather_chunks(k[None], v[None], chunk_ids[i:i + 1], cs, into.k[i:i + 1], into.v[i:i + 1])
        into.k[i, :, n:n + index.tail] = k[:, tail]
        into.v[i, :, n:n + index.tail] = v[:, tail]


class SelectionPolicy(Protocol):
    """When level 2's chunks are chosen again from the latest level-3 queries."""

    def due(self, round_: int) -> bool:
        """Whether to re-select after level-3 round `round_` (counting from 0)."""


class Once:
    """The reference code's rule: chunks chosen once, from the last prompt token's queries."""

    def due(self, round_: int) -> bool:
        return False


class EveryVerify:
    """Re-select after every level-3 verification."""

    def due(self, round_: int) -> bool:
        return True


@dataclass
class EveryN:
    """Re-select after every n-th level-3 verification."""

    n: int

    def due(self, round_: int) -> bool:
        return (round_ + 1) % self.n == 0


SELECTION_POLICIES: dict[str, Callable[[], SelectionPolicy]] = {"once": Once, "every_verify": EveryVerify}


def selection_policy(reselect: str | int) -> SelectionPolicy:
    """The policy a `reselect` setting names: a registered name or a positive integer N (every N verifications)."""
    return EveryN(reselect) if isinstance(reselect, int) else SELECTION_POLICIES[reselect]()


class Retrieval:
    """Level 2's cache: the selected prompt chunks plus every later token, re-selected by policy. `cache`: where
    they go (emptied here; room for the chunks the budget buys, a partial last chunk and the tokens after the
    prompt); `index_device`: where the chunk index is kept (default: the full cache's compute device)."""

    def __init__(self, full: KVCache, cfg: GenerationConfig, cache: KVCache, ops: TorchOps = TORCH,
                 index_device: torch.device | None = None):
        self.full, self.cfg, self.ops, self.cache = full, cfg, ops, cache
        self.policy = selection_policy(cfg.reselect)
        self.selector = LEVEL2_CACHES[cfg.level2_cache](cfg)
        self.index = ChunkIndex.build(full, full.seq_len, cfg.chunk_size, index_device)
        self.n_select = chunks_to_keep(self.index.num_chunks, cfg.budget, cfg.chunk_size)
        cache.reset(self.n_select * cfg.chunk_size + self.index.tail, self.index.length)
        self.synced = full.seq_len  # positions below this hold the full cache's keys/values

    def select(self, queries: list[torch.Tensor], row: int, round_: int, position: int) -> RetrievalSelection:
        """Pick chunks with the level-3 queries recorded at `row` (per layer [Hkv, rows, D]) and gather them."""
        t0 = time.perf_counter()
        ids = self.selector(self.index, torch.stack([q[:, row] for q in queries]), self.n_select)
        gather_selection(self.full, self.index, ids, self.cache, self.ops)
        return RetrievalSelection(round=round_, position=position, chunk_size=self.cfg.chunk_size,
                                  num_chunks=self.index.num_chunks, prompt_tokens=self.index.length,
                                  budget=self.cfg.budget, chunk_ids=ids.tolist(), seconds=time.perf_counter() - t0,
                                  cache_bytes=self.cache.nbytes)

    def copy_from_full(self, upto: int) -> None:
        """Give positions [synced, upto) the full cache's keys and values (the tokens level 3 verified since)."""
        if upto > self.synced:
            self.cache.copy_positions(self.full, self.synced, upto)
            self.synced = upto
