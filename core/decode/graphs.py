"""CUDA graphs of fixed-shape decode steps: captured once per (cache, tokens fed, rows returned, rows recorded) and
replayed with the token ids copied into a static buffer. The cache's lengths live in device memory (KVCache.meta),
so one graph stays valid while the cache grows and rolls back; an offloaded cache's graphs also depend on the blocks
its step copies (KVCache.layout), and only those of its two latest layouts are kept."""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass

import torch

from core.cache.kvcache import KVCache
from core.model.transformer import Transformer
from core.config import DECODE_TOKENS
from core.model.ops import TorchOps


@dataclass
class Graph:
    """One captured step with its static input and outputs."""

    graph: torch.cuda.CUDAGraph
    ids: torch.Tensor
    hidden: torch.Tensor
    queries: list[torch.Tensor]


KEPT_LAYOUTS = 2  # per cache


def clock(graphs: Graphs | None) -> float:
    """Seconds for timing a level's steps: the wall clock less the time `graphs` has spent capturing, so that a step
    shape's first use (compiling and capturing, seconds) counts as warm-up, not as what that level's steps cost."""
    return time.perf_counter() - (graphs.capture_s if graphs is not None else 0.0)


class Graphs:
    """The graphs captured on each cache (kept while the cache lives): an engine holds one of these when CUDA graphs
    are on."""

    def __init__(self):
        # per cache, its graphs by layout (the latest last) and by shape
        self.by_cache: weakref.WeakKeyDictionary[KVCache, dict[tuple, dict]] = weakref.WeakKeyDictionary()
        self.capture_s = 0.0  # wall time spent capturing (and compiling kernels for) new graphs so far

    @staticmethod
    def applies(model: Transformer, cache: KVCache, n: int) -> bool:
        """Whether a step of n tokens on this cache can run as a graph: device-side lengths, a decode step, a cache
        whose steps are worth it (KVCache.replays), no host-dependent RoPE."""
        return model.ops.device_steps and cache.on_cuda and n <= DECODE_TOKENS and cache.replays() and \
            model.rotary.rope_type != "dynamic"

    def step(self, model: Transformer, cache: KVCache, ids: torch.Tensor, n_rows: int, record: int, ops: TorchOps
             ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """model.step(ids, cache, n_rows, record, ops=ops) replayed from a graph (captured on first use of this
        shape: a cache serves one level, so always with the same operators); `ids` on the host or the device."""
        cache.begin(len(ids))
        layouts, layout = self.by_cache.setdefault(cache, {}), cache.layout()
        graphs = layouts[layout] = layouts.pop(layout, {})
        while len(layouts) > KEPT_LAYOUTS:  # a rollback can step back one block: keep the one before too
            del layouts[next(iter(layouts))]
        key = (len(ids), n_rows, record)
        g = graphs[key] = self.replay(graphs.get(key), model, cache, ids, n_rows, record, ops)
        cache.end()
        return g.hidden.clone(), list(g.queries)

    def replay(self, g: Graph | None, model: Transformer, cache, ids: torch.Tensor, n_rows: int | None, record: int,
               ops: TorchOps) -> Graph:
        """Replay graph `g` of a begun step with the token ids `ids`, or, where there is none yet, capture one (its
        time counted as capture, not as the step's); returns the graph."""
        if g is None:
            t0 = time.perf_counter()
            g = _capture(model, cache, ids.to(model.device, copy=True), n_rows, record, ops)
            torch.cuda.synchronize(model.device)
            self.capture_s += time.perf_counter() - t0
        else:
            g.ids.copy_(ids, non_blocking=True)
        g.graph.replay()
        return g


class RaggedGraphs:
    """The graphs of a batch's steps (core.cache.ragged.Ragged): one per set of caches, rows each and rows recorded,
    the latest KEPT_RAGGED kept (requests join and leave a batch; a graph is tied to its caches' buffers, so the
    batch drops those of a cache it gives up: `forget`)."""

    def __init__(self, graphs: Graphs):
        self.graphs = graphs  # whose capture time this adds to (the engine's clock)
        self.kept: dict[tuple, Graph] = {}

    def step(self, model: Transformer, ragged, ids: torch.Tensor, record: int, ops: TorchOps
             ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """model.step(ids, ragged, None, record, ops=ops) replayed from a graph (captured on first use)."""
        ragged.begin()
        key = (ragged.key(), record, ops.name, getattr(ops, "invariant", True))
        g = self.kept.pop(key, None)
        while g is None and len(self.kept) >= KEPT_RAGGED:  # room for the one captured now
            del self.kept[next(iter(self.kept))]
        g = self.kept[key] = self.graphs.replay(g, model, ragged, ids, None, record, ops)  # the latest last
        ragged.end()
        return g.hidden.clone(), list(g.queries)

    def forget(self, cache: KVCache) -> None:
        """Drop the graphs captured on a cache the batch gives up."""
        self.kept = {k: g for k, g in self.kept.items() if all(c != id(cache) for c, _ in k[0])}


KEPT_RAGGED = 32  # a batch's compositions (which requests, how many rows each) kept as graphs


def _capture(model: Transformer, cache: KVCache, ids: torch.Tensor, n_rows: int | None, record: int, ops: TorchOps
             ) -> Graph:
    """Warm up on a side stream (Triton compiles, cuBLAS picks kernels), then capture one step; the cache's host
    bookkeeping is put back after each (the caller's replay is the step that counts)."""
    before = cache.seq_len  # a batch's: each sequence's
    cache.begin(int(ids.shape[0]))  # the warm-up is a step of its own (an offloaded cache counts its copies)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        model.step(ids, cache, n_rows, record, ops=ops)
    cache.truncate(before)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        hidden, queries = model.step(ids, cache, n_rows, record, ops=ops)
    cache.truncate(before)
    return Graph(graph, ids, hidden, queries)
