"""One decode step over several sequences: their new tokens side by side as the rows of one forward, each sequence's
rows attending over its own cache (the vLLM layout: no padding, every projection reads its weights once for all)."""

from __future__ import annotations

import torch

from core.cache.kvcache import KVCache


class Ragged:
    """The caches of one batched step and the rows each takes, in order (core.model.ops attends part by part). It
    stands where one cache would in Transformer.step: begin, positions, end."""

    def __init__(self, parts: list[tuple[KVCache, int]]):
        self.parts = parts
        self.on_cuda = all(cache.on_cuda for cache, _ in parts)

    @property
    def rows(self) -> int:
        return sum(n for _, n in self.parts)

    def key(self) -> tuple:
        """What a CUDA graph of this step depends on: which caches, how many rows each (lengths are on the device)."""
        return tuple((id(cache), n) for cache, n in self.parts)

    def begin(self, n: int | None = None) -> None:
        """Each cache's bookkeeping for its rows (`n`, the rows of all, only checked)."""
        if n is not None and n != self.rows:
            raise ValueError(f"a ragged step of {self.rows} rows was begun with {n}")
        for cache, rows in self.parts:
            cache.begin(rows)

    def positions(self) -> torch.Tensor:
        """The sequence positions of every row, each sequence's own."""
        return torch.cat([cache.positions() for cache, _ in self.parts])

    def end(self) -> None:
        for cache, _ in self.parts:
            cache.end()

    @property
    def seq_len(self) -> tuple[int, ...]:
        """Each cache's sequence length."""
        return tuple(cache.seq_len for cache, _ in self.parts)

    def truncate(self, lengths: tuple[int, ...]) -> None:
        """Put each cache back at a sequence length (a graph's warm-up step is undone so)."""
        for (cache, _), length in zip(self.parts, lengths):
            cache.truncate(length)
