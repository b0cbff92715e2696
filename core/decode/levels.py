"""A model reading one cache, kept in step with a token sequence that grows and rolls back."""

from __future__ import annotations

import functools
import itertools
import queue
import threading
from collections import deque
from typing import Any, Callable, Iterator, Sequence

import torch

from core.decode.graphs import Graphs
from core.cache.kvcache import KVCache
from core.model.transformer import Transformer
from core.config import DECODE_TOKENS


def common_prefix(a: list[int], b: list[int], start: int, limit: int) -> int:
    """Length of the common prefix of a and b, known to be at least `start`, at most `limit`."""
    n = min(len(a), len(b), limit)
    i = min(start, n)
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _overlap(a: int, n: int, total: int, last: int) -> int:
    """How many of positions [a, a + n) are among the last `last` of `total`."""
    return max(0, min(a + n, total) - max(a, total - last))


class Stopped(Exception):
    """A prefill forward was stopped between two layers (its cache holds part of a chunk: not to be reused)."""


LAYERS_AHEAD = 2  # how far a prefill's host may run ahead of a GPU


class Leash:
    """Keeps the host at most LAYERS_AHEAD layers ahead of a GPU while it prefills. The host queues a forward's
    kernels far faster than the GPU runs them: unleashed, it had queued a whole 120K-token prefill (seconds of GPU
    work) before a Stop came, so the Stop landed after all of it and the progress it reported was what it had
    queued. Waiting on the event of a layer two back leaves the GPU a layer queued, so it never idles."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.events: deque[torch.cuda.Event] = deque()

    def step(self) -> None:
        """A layer was queued: wait until the GPU has finished the one LAYERS_AHEAD before it."""
        if not self.cuda:
            return
        event = torch.cuda.Event()
        event.record()
        self.events.append(event)
        if len(self.events) > LAYERS_AHEAD:
            self.events.popleft().synchronize()


class Level:
    """Feeds a model exactly the tokens its cache lacks, rolling the cache back where the sequence changed."""

    def __init__(self, model: Transformer, cache: KVCache, tokens: list[int], graphs: Graphs | None = None,
                 drafting: bool = False):
        self.model, self.cache, self.graphs = model, cache, graphs  # graphs: replay decode steps (None: eager)
        self.drafting = drafting  # its output is a draft: the model's drafting operators serve it
        self.tokens = list(tokens)  # the sequence the cache holds keys/values for
        self.forwards = 0
        self.queries: list[torch.Tensor] = []  # per layer, the queries the last forward recorded [Hkv, rows, D]

    def logits(self, seq: list[int], n_last: int, trusted: int = 0, extra: Sequence[int] = ()) -> torch.Tensor:
        """Float32 logits [n_last, V] predicting the tokens after each of the last n_last positions of seq + extra.

        `trusted`: a length up to which seq is known to equal what this level saw before (skips comparing it).
        `extra`: tokens after seq, passed apart so that a long seq is never copied.
        """
        return self.head(self.states(seq, n_last, trusted, extra))

    @property
    def ops(self):
        """The operators this level computes with."""
        return self.model.ops.drafting() if self.drafting else self.model.ops

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits of hidden states this level computed."""
        return self.model.head(hidden, self.ops)

    def states(self, seq: list[int], n_last: int, trusted: int = 0, extra: Sequence[int] = (), record: int = 0
               ) -> torch.Tensor:
        """The normed hidden states [n_last, D] of the last n_last positions of seq + extra (logits: self.head);
        with `record`, self.queries holds the group-summed queries of the last `record` positions."""
        new = self.pending(seq, n_last, trusted, extra)
        # The device kernels compute a row of a decode step as a one-token step would; a longer input (a level-3
        # draft over DECODE_TOKENS) is fed in decode-step pieces so that every row keeps that property.
        piece = DECODE_TOKENS if self.ops.device_steps else len(new)
        outs, queries = [], []
        for a in range(0, len(new), piece):
            part = new[a:a + piece]
            out, recorded = self._step(torch.tensor(part), _overlap(a, len(part), len(new), n_last),
                                       _overlap(a, len(part), len(new), record))
            outs.append(out)
            queries = [torch.cat(q, 1) for q in zip(queries, recorded)] if queries else recorded
        self.queries = queries
        self.fed(new)
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def pending(self, seq: list[int], n_last: int, trusted: int = 0, extra: Sequence[int] = ()) -> list[int]:
        """Roll the cache back to where what it holds and seq + extra part (keeping at least the last n_last positions
        to compute) and return the tokens it lacks, which the caller feeds next (then `fed`)."""
        total = len(seq) + len(extra)
        start = min(trusted, len(self.tokens), total - n_last)
        tail = seq[start:] + list(extra)  # short: `trusted` is near the end
        keep = start + common_prefix(self.tokens[start:], tail, 0, total - n_last - start)
        self.cache.truncate(keep)
        del self.tokens[keep:]
        return tail[keep - start:]

    def fed(self, new: list[int]) -> None:
        """The tokens `pending` returned went through a forward."""
        self.tokens.extend(new)
        self.forwards += 1

    def follow(self, token: torch.Tensor) -> torch.Tensor:
        """The normed hidden state [1, D] after one more token known only on the device (a [1] tensor): a level that
        drafts alone feeds each token it draws straight back, so the host never waits for one. Its id joins
        self.tokens once `settle` learns it."""
        self.tokens.append(-1)  # a placeholder, matching no id, until settle
        out, self.queries = self._step(token, 1, 0)
        self.forwards += 1
        return out

    def settle(self, ids: list[int]) -> None:
        """The ids of the last len(ids) tokens fed through `follow`, read back from the device."""
        self.tokens[len(self.tokens) - len(ids):] = ids

    def _step(self, ids: torch.Tensor, n_rows: int, record: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """One forward of token ids [n] (on the host or the device) after the cached tokens: replayed from a CUDA
        graph where one applies."""
        if self.graphs is not None and self.graphs.applies(self.model, self.cache, len(ids)):
            return self.graphs.step(self.model, self.cache, ids, n_rows, record, self.ops)
        self.cache.begin(len(ids))
        return self.model.step(ids.to(self.model.device), self.cache, n_rows, record, ops=self.ops)

    def prefill(self, ids: list[int], chunk: int, record: int = 0, stop: threading.Event | None = None
                ) -> Iterator[int]:
        """Feed ids into the cache in chunks without computing logits; yields the count done after each chunk, and on
        a CPU, where one chunk's forward takes seconds, after each of its layers too (the share of the chunk's tokens
        its layers so far stand for). With `record`, self.queries holds the queries of the last `record` ids. Once
        `stop` is set, the next layer raises Stopped (a chunk can take seconds); on a GPU the host stays within
        LAYERS_AHEAD layers of the device (Leash), so the Stop lands there and each count yielded is what the device
        has nearly done."""
        leash = Leash(self.model.device)
        layers = len(self.model.layers)

        def between() -> None:
            leash.step()
            if stop is not None and stop.is_set():
                raise Stopped

        for a in range(0, len(ids), chunk):
            piece = ids[a:a + chunk]
            self.cache.begin(len(piece))
            last = a + chunk >= len(ids)
            forward = functools.partial(self.model.step, torch.tensor(piece, device=self.model.device), self.cache,
                                        0, record if last else 0, ops=self.ops)
            if self.model.device.type == "cpu":
                steps = LayerByLayer(forward, between)
                for started in steps:  # layer `started` begins: the layers before it are done
                    if started:
                        yield a + len(piece) * started // layers
                _, queries = steps.result
            else:
                _, queries = forward(between=between)
            if last:
                self.queries = queries
            self.tokens.extend(piece)
            yield a + len(piece)


class LayerByLayer:
    """Iterates over the layers of one forward as they begin, the forward running on a helper thread (torch lets go
    of the GIL while it computes): a generator cannot yield from inside the forward's call back between two layers.
    The forward waits at each layer's start until its consumer asks for the next one, so a consumer that pauses
    pauses the forward (a batch's prefill paced beside decoding requests, core.batching, would otherwise go on
    computing beside their rounds). `result` holds what the forward returned once the iteration ends; its exception
    (Stopped included) is raised by the iteration. Leaving the iteration early stops the forward at its next layer
    and waits for it."""

    def __init__(self, forward: Callable[..., Any], between: Callable[[], None]):
        self.forward, self.between = forward, between
        self.result: Any = None

    def __iter__(self) -> Iterator[int]:
        begun: queue.SimpleQueue = queue.SimpleQueue()
        left = threading.Event()  # the consumer stopped iterating: the forward stops at its next layer
        asked = threading.Semaphore(0)  # the consumer asks for the next layer
        layer = itertools.count()

        def between() -> None:
            self.between()
            if left.is_set():
                raise Stopped
            begun.put(next(layer))
            asked.acquire()
            if left.is_set():
                raise Stopped

        def run() -> None:
            try:
                begun.put((self.forward(between=between),))
            except BaseException as err:  # handed to the consumer, which raises it
                begun.put(err)

        worker = threading.Thread(target=run, name="prefill-forward", daemon=True)
        worker.start()
        try:
            while True:
                item = begun.get()
                if isinstance(item, int):
                    yield item
                    asked.release()
                elif isinstance(item, BaseException):
                    raise item
                else:
                    self.result = item[0]
                    return
        finally:
            left.set()
            asked.release()  # a forward waiting at a layer's start goes on, to stop there
            worker.join()
