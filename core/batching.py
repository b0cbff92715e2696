"""Batched generation: requests wait in line, are prefilled one at a time between the batch's rounds (a chunk per
round, so the batch keeps decoding), join the batch, decode together (core.decode.batch) and leave as they finish.
Each request's events come tagged with its key and read as a single run's would."""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Iterator, Protocol

from core.cache.memory import GiB, Memory, Plan
from core.config import MAX_SLOTS, SEATS, GenerationConfig, TriForceError
from core.decode.batch import Batch, Slot
from core.decode.drafters import DraftContext, drafter_names, make_drafters
from core.decode.graphs import Graphs
from core.decode.levels import Level, Stopped
from core.events import Event, Finished, PrefillBeside, PrefillProgress
from core.io.prompting import Prompt, build_prompt, ids_prompt
from core.lifecycle import Clock, announce, begin, finish
from core.model.transformer import Transformer
from core.plan.estimate import CostBook
from core.plan.policy import BatchAuto


# A newcomer's prefill beside decoding requests may take this share of the batch's rounds' time, on average: they
# keep 1 / (1 + PREFILL_SHARE) = 0.71 of their pace alone while it fills (chunked prefill under a budget, as serving
# engines do). Its pieces of work are the single run's (a layer of a chunk on a CPU, a chunk on a GPU: its keys and
# values are the same), so a piece longer than one round's share is paid for by the rounds after it, which it sits out.
PREFILL_SHARE = 0.4
PACE_BESIDE_PREFILL = 1 / (1 + PREFILL_SHARE)  # what a decoding request keeps of its pace while a prefill runs beside
DEVICE_SHARE_BESIDE_DECODING = PREFILL_SHARE / (1 + PREFILL_SHARE)  # the device's time a prefill gets beside decoding


class Host(Protocol):
    """What a batch takes of its engine (core.engine.Engine): the target, the level-1 draft model and the tokenizer,
    the context, the memory plan, the CUDA graphs, the cost book, the default settings and the prefill's chunk."""

    target: Transformer
    draft: Transformer | None
    tokenizer: object
    context_length: int
    memory: Memory
    graphs: Graphs | None
    costs: CostBook

    def settings(self, **changes) -> GenerationConfig: ...

    def prefill_chunk(self) -> int: ...


@dataclass
class Request:
    """One request of a batch: a document and an instruction (or prompt `ids`, used as they are), its settings
    (None: the engine's), the key its events are tagged with, and a flag that ends it (its stream then ends without
    Finished, like a stopped single run)."""

    key: str
    document: str = ""
    instruction: str = ""
    ids: list[int] | None = None
    config: GenerationConfig | None = None
    stop: threading.Event = field(default_factory=threading.Event)


@dataclass(frozen=True)
class Tagged:
    """An event of the request `key`."""

    key: str
    event: Event


@dataclass
class Admitted:
    """A request with its prompt and plan, waiting or prefilling."""

    request: Request
    prompt: Prompt
    plan: Plan
    level: Level | None = None
    filling: Iterator[int] | None = None
    clock: Clock | None = None
    chunk: int = 0  # prompt tokens a prefill forward takes
    done: int = 0


@dataclass
class Running:
    """A request in the batch, with what its Finished figures need: the other requests prefilled between its
    rounds, the seconds that took, and the prompt length its events last said was prefilling beside it (0: none)."""

    admitted: Admitted
    slot: Slot
    prefills: set[str] = field(default_factory=set)
    prefill_s: float = 0.0
    told: int = 0


def _device_bytes(plan: Plan) -> tuple[int, int]:
    """A request's device bytes the batch shares (the weights, the working memory) and its own (its caches)."""
    placed = plan.placement.device
    shared = placed.get("weights", 0) + placed.get("working memory", 0)
    return shared, sum(placed.values()) - shared


class BatchRun:
    """Requests decoded in one batch of at most `slots` on `engine`'s target model, as many as the device memory
    holds beside each other; the others wait in line, first come first served. `step` does one piece of work (a
    prefill chunk and a round) and returns the events it produced."""

    def __init__(self, engine: Host, slots: int = SEATS):
        if not 1 <= slots <= MAX_SLOTS:
            raise TriForceError(f"a batch holds 1 to {MAX_SLOTS} requests, not {slots}")
        self.engine, self.slots = engine, slots
        self.model = engine.target
        self.batch = Batch(self.model, BatchAuto(engine.costs), engine.graphs)
        self.waiting: deque[Admitted] = deque()
        self.filling: Admitted | None = None
        self.running: dict[str, Running] = {}
        self.line = threading.Lock()  # `submit` may be called from other threads than `step`'s
        self.round_s = 0.0  # the batch's last round
        self.credit = 0.0  # seconds of prefill the rounds so far allow beside them (below 0: owed)

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.filling or self.running)

    def position(self, key: str) -> int | None:
        """Where a waiting request stands in line (1: next), None once it is prefilling or decoding."""
        with self.line:
            return next((i + 1 for i, a in enumerate(self.waiting) if a.request.key == key), None)

    def holds(self, key: str) -> bool:
        """Whether a request is waiting, prefilling or decoding."""
        with self.line:
            return key in self.running or any(a.request.key == key for a in self._queued())

    def submit(self, request: Request) -> None:
        """Queue a request; bad input raises TriForceError, and nothing of the batch changes."""
        e = self.engine
        if self.holds(request.key):
            raise TriForceError(f"a request keyed {request.key!r} is already in the batch")
        cfg = (request.config or e.settings()).validate()
        if request.ids is not None:
            prompt = ids_prompt(request.ids, self.model.args.vocab_size, e.context_length, cfg.max_new_tokens)
        else:
            prompt = build_prompt(e.tokenizer, request.document, request.instruction, e.context_length,
                                  cfg.max_new_tokens, cfg.overflow)
        plan = e.memory.plan(len(prompt.ids), cfg.resolved, "off" if e.memory.limit is not None else "auto")
        shared, own = _device_bytes(plan)
        if e.memory.limit is not None and shared + own > e.memory.limit:
            raise TriForceError(f"a batched request must fit on the GPU beside the weights ({own / GiB:.1f} GiB of "
                                f"caches); run it alone to offload its cache")
        with self.line:
            self.waiting.append(Admitted(request, prompt, plan))

    def _queued(self) -> list[Admitted]:
        return [*self.waiting, *([self.filling] if self.filling else [])]

    def _room(self, admitted: Admitted) -> bool:
        """Whether a request fits beside those decoding (a batch seat and device memory)."""
        if len(self.running) + 1 > self.slots:
            return False
        limit = self.engine.memory.limit
        if limit is None:
            return True
        shared, own = _device_bytes(admitted.plan)
        return shared + own + sum(_device_bytes(r.admitted.plan)[1] for r in self.running.values()) <= limit

    def step(self) -> list[Tagged]:
        """One piece of work: stopped requests leave, the request in line is prefilled a chunk further (or joins),
        and the batch decodes a round. Returns the events, tagged."""
        out: list[Tagged] = []
        with self.line:
            self._drop_stopped()
            admitted = self.waiting.popleft() if self.filling is None and self.waiting and \
                self._room(self.waiting[0]) else None
            if admitted is not None:
                self.filling = admitted
        if admitted is not None:
            self._start(admitted, out)
        if self.filling is not None:
            self._fill(out)
        if self.running:
            self._tell_prefill()
            t0 = time.perf_counter()
            done = self.batch.round()
            self.round_s = time.perf_counter() - t0
            for slot in done:
                self._finish(slot, out)
            for key, run in list(self.running.items()):
                out += [Tagged(key, e) for e in run.slot.events]
                run.slot.events.clear()
                if run.slot.request.out.done:
                    del self.running[key]
                    self.batch.leave(run.slot)
            if not self.running:  # the batch emptied: what it measured goes to the engine's cost book
                self.batch.policy.finish()
        return out

    def _drop_stopped(self) -> None:
        """Requests whose stop is set leave the line or the batch (their caches go with them)."""
        self.waiting = deque(a for a in self.waiting if not a.request.stop.is_set())
        if self.filling is not None and self.filling.request.stop.is_set():
            self.filling = None
        for key, run in list(self.running.items()):
            if run.admitted.request.stop.is_set():
                del self.running[key]
                self.batch.leave(run.slot)

    def _start(self, a: Admitted, out: list[Tagged]) -> None:
        """A request's full cache (core.cache.memory) and its prefill begin."""
        e, ids, plan = self.engine, a.prompt.ids, a.plan
        out.append(Tagged(a.request.key, announce(a.prompt, plan, e.tokenizer, e.context_length)))
        a.level = Level(self.model, e.memory.own_caches(plan, retrieval=False)[0], [], e.graphs)
        a.chunk = plan.cfg.prefill_chunk or e.prefill_chunk()
        a.filling = a.level.prefill(ids[:-1], a.chunk, record=1, stop=a.request.stop)
        a.clock = Clock(time.perf_counter())

    def _fill(self, out: list[Tagged]) -> None:
        """The prefill further: while nothing decodes, a progress further (its caller hands each over as it comes);
        beside decoding requests, for the time the rounds allow it (each round adds PREFILL_SHARE of its time, a
        round's share at most; what a piece took beyond it is owed and sat out). Once done, the request joins."""
        a = self.filling
        if self.running:
            self.credit = min(self.credit, 0.0) + PREFILL_SHARE * self.round_s
            if self.credit <= 0.0:
                return
        else:
            self.credit = 0.0
        total, t0 = len(a.prompt.ids) - 1, time.perf_counter()
        while True:
            try:
                a.done = next(a.filling, total)
            except Stopped:  # its stop was set mid-chunk: it leaves, its half-filled cache with it
                self.filling = None
                return
            out.append(Tagged(a.request.key, PrefillProgress(done=a.done, total=total,
                                                             seconds=time.perf_counter() - a.clock.started,
                                                             cache_bytes=a.level.cache.nbytes,
                                                             decoding_beside=len(self.running))))
            if a.done >= total or not self.running or time.perf_counter() - t0 >= self.credit:
                break
        if self.running:
            took = time.perf_counter() - t0
            self.credit -= took
            for run in self.running.values():  # their device read its prompt meanwhile: their decoding waited
                run.prefills.add(a.request.key)
                run.prefill_s += took
        if a.done >= total:
            self.filling = None
            self._join(a)

    def _tell_prefill(self) -> None:
        """Each decoding request's events say when another's prefill begins or ends beside it (PrefillBeside)."""
        filling = len(self.filling.prompt.ids) if self.filling is not None else 0
        for run in self.running.values():
            if run.told != filling:
                run.told = filling
                run.slot.events.append(PrefillBeside(filling, str(self.model.device)))

    def _join(self, a: Admitted) -> None:
        """A prefilled request's slot: its level 2 (methods that draft) on its own retrieval cache, a triforce
        request's level 1 as in its single run (a planned request's batch plan drafts with level 2 alone)."""
        e, plan, ids = self.engine, a.plan, a.prompt.ids
        cfg = plan.cfg
        retrieval = e.memory.own_caches(plan, retrieval=True)[1] if cfg.kind.drafts else None
        request = begin(a.level, ids, plan, e.tokenizer, retrieval, e.graphs)
        slot = Slot(a.request.key, request, level2_cuts=plan.sizes.kept_chunks < plan.sizes.index_chunks)
        if cfg.kind.drafts and not cfg.kind.planned:
            names = drafter_names(cfg.drafter, False, e.draft is not None)
            if names:
                slot.drafter = make_drafters(names[:1], DraftContext(
                    e.draft, cfg, ids, self.model.args.vocab_size, request.generator,
                    lambda: e.memory.own_streaming_cache(plan, e.draft), e.graphs))[names[0]]
        self.batch.join(slot)
        a.clock.decode_from(a.level, e.graphs)
        self.running[a.request.key] = Running(a, slot)

    def _finish(self, slot: Slot, out: list[Tagged]) -> None:
        """A finished request's figures (its Finished event joins its events)."""
        run, r, d = self.running[slot.key], slot.request, slot.drafter
        footprint = r.footprint(d, d.name if d else "none" if r.drafts else "")
        stats = finish(footprint, r.cfg, r.out, run.admitted.prompt, r.target, run.admitted.clock, self.engine.graphs,
                       shared_with=slot.beside, prefills_beside=len(run.prefills), prefill_beside_s=run.prefill_s)
        slot.events.append(Finished(r.out.text, r.out.ids, r.prompt, stats))
