"""CUDA graphs of fixed-shape decode steps: captured once per (cache, tokens fed, logits rows, recorded rows) and
replayed with the token ids copied into a static buffer. The cache's lengths live in device memory (KVCache.meta),
so one graph stays valid while the cache grows and rolls back."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from core.kvcache import KVCache
from core.model import Transformer

ENABLED = True  # benchmarks switch this off to time the same kernels launched eagerly


@dataclass
class Graph:
    """One captured step with its static input and outputs."""

    graph: torch.cuda.CUDAGraph
    ids: torch.Tensor
    hidden: torch.Tensor
    queries: list[torch.Tensor | None]


def applies(model: Transformer, cache: KVCache, n: int) -> bool:
    """Whether a step of n tokens on this cache can run as a graph (CUDA kernels, no host-dependent RoPE)."""
    return ENABLED and cache.kernels is not None and n <= cache.kernels.MAX_QUERIES and \
        model.rotary.rope_type != "dynamic"


def _capture(model: Transformer, cache: KVCache, ids: torch.Tensor, n_rows: int) -> Graph:
    """Warm up on a side stream (Triton compiles, cuBLAS picks kernels), then capture one step."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        model.step(ids, cache, n_rows)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        hidden = model.step(ids, cache, n_rows)
    return Graph(graph, ids, hidden, list(cache.queries))


def step(model: Transformer, cache: KVCache, ids: list[int], n_rows: int) -> torch.Tensor:
    """model.step(ids, cache, n_rows) (normed hidden states of the last n_rows positions) replayed from a graph
    (captured on first use of this shape)."""
    cache.begin(len(ids))
    key = (len(ids), n_rows, cache.record_rows)
    g = cache.graphs.get(key)
    if g is None:
        buf = torch.tensor(ids, device=cache.k.device)
        g = cache.graphs[key] = _capture(model, cache, buf, n_rows)
    else:
        g.ids.copy_(torch.tensor(ids), non_blocking=True)
    g.graph.replay()
    if cache.record_rows:
        cache.queries = list(g.queries)
    cache.end()
    return g.hidden.clone()
