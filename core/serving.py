"""One batch serving requests as they arrive (the app's visitors): a thread decodes, each caller reads its own
request's events. A request that arrives while the batch decodes joins it at a next round; one whose stream is
closed (or whose stop is set) leaves it, the others decoding on."""

from __future__ import annotations

import queue
import threading
from typing import Any, Iterator

from core.batching import BatchRun, Request
from core.config import SEATS, TriForceError
from core.engine import Engine
from core.events import Event, Finished

_END = object()  # a request's stream ends (finished or stopped)


def drained(stream: queue.Queue | queue.SimpleQueue, idle: float | None, end: object) -> Iterator[Any]:
    """A queue's items as they come until `end`, and a None whenever none came for `idle` seconds (None: wait as
    long as it takes), so that the reader can do something meanwhile."""
    while True:
        try:
            item = stream.get(timeout=idle)
        except queue.Empty:
            yield None
            continue
        if item is end:
            return
        yield item


class BatchServer:
    """Requests on one engine decoded in one batch of at most `slots`; the others wait in line, first come first
    served (`position`)."""

    def __init__(self, engine: Engine, slots: int = SEATS):
        self.engine, self.slots = engine, slots
        self.run = BatchRun(engine, slots)
        self.streams: dict[str, queue.SimpleQueue] = {}
        self.lock = threading.Lock()  # streams and the decoding thread's start
        self.thread: threading.Thread | None = None

    def submit(self, request: Request, idle: float | None = None) -> Iterator[Event | None]:
        """The events of `request` as the batch produces them, and with `idle` a None whenever none came for `idle`
        seconds (so that the reader can do something meanwhile); bad input raises TriForceError here. Closing the
        iterator (or setting request.stop) ends the request at the batch's next step."""
        with self.lock:
            if request.key in self.streams:
                raise TriForceError(f"a request keyed {request.key!r} is already being served")
            stream = self.streams[request.key] = queue.SimpleQueue()  # before the batch can emit its first event
            try:
                self.run.submit(request)
            except BaseException:
                del self.streams[request.key]
                raise
            if self.thread is None:
                self.thread = threading.Thread(target=self._decode, name="batch", daemon=True)
                self.thread.start()
        return self._read(request, stream, idle)

    def position(self, key: str) -> int | None:
        """Where a request waits in line (1: next), None once it prefills or decodes."""
        return self.run.position(key)

    def decoding(self) -> int:
        """Requests prefilling or decoding now."""
        return len(self.run.running) + (self.run.filling is not None)

    @staticmethod
    def _read(request: Request, stream: queue.SimpleQueue, idle: float | None) -> Iterator[Event | None]:
        try:
            for item in drained(stream, idle, _END):
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            request.stop.set()

    def _decode(self) -> None:
        """Step the batch while it holds requests; hand each event to its request's stream."""
        while True:
            with self.lock:
                if not self.run.busy:
                    self._end_all(None)
                    self.thread = None
                    return
            try:
                tagged = self.run.step()
            except BaseException as err:  # every request in flight learns why; the batch starts afresh
                with self.lock:
                    self._end_all(err)
                    self.run = BatchRun(self.engine, self.slots)
                continue
            for t in tagged:
                stream = self.streams.get(t.key)
                if stream is not None:
                    stream.put(t.event)
                    if isinstance(t.event, Finished):
                        stream.put(_END)
                        self.streams.pop(t.key, None)
            with self.lock:  # stopped requests left without Finished
                for key in [k for k in self.streams if not self.run.holds(k)]:
                    self.streams.pop(key).put(_END)

    def _end_all(self, err: BaseException | None) -> None:
        for stream in self.streams.values():
            if err is not None:
                stream.put(err)
            stream.put(_END)
        self.streams.clear()
