"""Batched generation: requests wait in line, are prefilled one at a time between the batch's rounds (a chunk per
round, so the batch keeps decoding), join the batch, decode together (core.decode.batch) and leave as they finish.
Each request's events come tagged with its key and read as a single run's would."""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Iterator, Protocol

import torch

from core.cache.kvcache import KVCache, StreamingCache
from core.cache.memory import GiB, Memory, Plan
from core.cache.retrieval import Retrieval
from core.config import AUTO_GAMMA2, MAX_SLOTS, SEATS, GenerationConfig, TriForceError
from core.decode.batch import Batch, Slot
from core.decode.drafters import DraftContext, drafter_names, make_drafters
from core.decode.graphs import Graphs
from core.decode.levels import Level, Stopped
from core.decode.output import Output
from core.events import Event, Finished, Footprint, PrefillProgress, PromptReady, Stats
from core.io.prompting import Prompt, build_prompt, ids_prompt
from core.model.transformer import Transformer
from core.plan.batch import BatchPlanner


class Host(Protocol):
    """What a batch takes of its engine (core.engine.Engine): the target, the level-1 draft model and the tokenizer,
    the context, the memory plan, the CUDA graphs, the default settings and the prefill's chunk."""

    target: Transformer
    draft: Transformer | None
    tokenizer: object
    context_length: int
    memory: Memory
    graphs: Graphs | None

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
    t0: float = 0.0
    chunk: int = 0  # prompt tokens a prefill forward takes
    done: int = 0


@dataclass
class Running:
    """A request in the batch, with what its Finished figures need."""

    admitted: Admitted
    slot: Slot
    prefill_s: float
    t0: float
    captured: float
    forwards: int


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
        self.batch = Batch(self.model, BatchPlanner(AUTO_GAMMA2), engine.graphs)
        self.waiting: deque[Admitted] = deque()
        self.filling: Admitted | None = None
        self.running: dict[str, Running] = {}
        self.line = threading.Lock()  # `submit` may be called from other threads than `step`'s

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
            for slot in self.batch.round():
                self._finish(slot, out)
            for key, run in list(self.running.items()):
                out += [Tagged(key, e) for e in run.slot.events]
                run.slot.events.clear()
                if run.slot.out.done:
                    del self.running[key]
                    self.batch.leave(run.slot)
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
        """A request's caches and its prefill begin."""
        e, ids, plan = self.engine, a.prompt.ids, a.plan
        cfg, cs = plan.cfg, plan.cfg.chunk_size
        out.append(Tagged(a.request.key, PromptReady(
            prompt_tokens=len(ids), document_tokens=a.prompt.document_tokens, dropped_tokens=a.prompt.dropped_tokens,
            context_length=e.context_length, max_new_tokens=cfg.max_new_tokens, chunk_size=cs,
            chunk_texts=[e.tokenizer.decode(ids[i:i + cs]) for i in range(0, len(ids), cs)], offloaded=False,
            caches=plan.placement.describe())))
        args = self.model.args
        full = KVCache(args.n_layers, args.n_kv_heads, args.head_dim, plan.sizes.full, self.model.dtype,
                       self.model.device)
        a.level = Level(self.model, full, [], e.graphs)
        a.chunk = cfg.prefill_chunk or e.prefill_chunk()
        a.filling, a.t0 = a.level.prefill(ids[:-1], a.chunk, record=1, stop=a.request.stop), time.perf_counter()

    def _fill(self, out: list[Tagged]) -> None:
        """The prefill a chunk further (while nothing decodes, a progress further: its caller hands each over as it
        comes); once done, the request joins."""
        a = self.filling
        total, chunk_end = len(a.prompt.ids) - 1, a.done + a.chunk
        while True:
            try:
                a.done = next(a.filling, total)
            except Stopped:  # its stop was set mid-chunk: it leaves, its half-filled cache with it
                self.filling = None
                return
            out.append(Tagged(a.request.key, PrefillProgress(done=a.done, total=total,
                                                             seconds=time.perf_counter() - a.t0,
                                                             cache_bytes=a.level.cache.nbytes)))
            if a.done >= total or not self.running or a.done >= chunk_end:  # (a CPU's prefill yields per layer too)
                break
        if a.done >= total:
            self.filling = None
            self._join(a)

    def _join(self, a: Admitted) -> None:
        """A prefilled request's slot: its level 2 (TriForce and auto) on its own retrieval cache."""
        e, cfg, ids, model = self.engine, a.plan.cfg, a.prompt.ids, self.model
        slot = Slot(a.request.key, ids, cfg, a.level, Output(e.tokenizer, cfg, model.eos_ids),
                    torch.Generator(model.device).manual_seed(cfg.seed))
        if cfg.method != "ar":
            args = model.args
            cache = KVCache(args.n_layers, args.n_kv_heads, args.head_dim, a.plan.sizes.retrieval, model.dtype,
                            model.device)
            slot.retrieval = Retrieval(a.level.cache, cfg, cache, model.ops)
            slot.level2 = Level(model, slot.retrieval.cache, ids[:-1], e.graphs, drafting=True)
        if cfg.method == "triforce":  # its level 1 as a single run's (auto's batch plan drafts with level 2 alone)
            names = drafter_names(cfg.drafter, cfg.method, e.draft is not None)
            if names:
                slot.drafter = make_drafters(names[:1], DraftContext(
                    e.draft, cfg, ids, model.args.vocab_size, slot.generator,
                    lambda: self._streaming(a.plan), e.graphs))[names[0]]
        self.batch.join(slot)
        self.running[a.request.key] = Running(a, slot, time.perf_counter() - a.t0, time.perf_counter(),
                                              self._captured(), a.level.forwards)

    def _streaming(self, plan: Plan) -> StreamingCache:
        """A request's own StreamingLLM cache for the level-1 draft model."""
        d, cfg = self.engine.draft.args, plan.cfg
        return StreamingCache(d.n_layers, d.n_kv_heads, d.head_dim, plan.sizes.streaming, cfg.sink_tokens,
                              cfg.window_tokens, self.engine.draft.rotary, self.engine.draft.dtype,
                              self.engine.draft.device)

    def _captured(self) -> float:
        return self.engine.graphs.capture_s if self.engine.graphs is not None else 0.0

    def _finish(self, slot: Slot, out: list[Tagged]) -> None:
        """A finished request's figures (its Finished event joins its events)."""
        run, model = self.running[slot.key], self.model
        warmup = self._captured() - run.captured
        decode_s = time.perf_counter() - run.t0 - warmup
        n, forwards = len(slot.out.ids), slot.target.forwards - run.forwards
        retrieval = slot.retrieval.cache.nbytes if slot.retrieval else 0
        stats = Stats.of(
            Footprint(slot.counts, slot.drafter.name if slot.drafter else "none" if slot.drafts else "",
                      slot.drafter.steps if slot.drafter else 0, retrieval,
                      slot.drafter.level.cache.nbytes if slot.drafter and slot.drafter.level else 0,
                      slot.drafter.level.model.step_weight_bytes() if slot.drafter and slot.drafter.level else 0,
                      plans=slot.plans),
            method=slot.cfg.method, new_tokens=n, prompt_tokens=len(slot.prompt),
            dropped_tokens=run.admitted.prompt.dropped_tokens, prefill_s=run.prefill_s, prefill_reused=False,
            decode_s=decode_s, warmup_s=warmup, tokens_per_s=n / decode_s if decode_s > 0 else 0.0,
            time_to_first_token_s=(slot.out.first_token_at or run.t0) - run.admitted.t0, target_forwards=forwards,
            tokens_per_target_forward=n / forwards if forwards else 0.0, cache_bytes=slot.target.cache.nbytes,
            target_weight_bytes=model.step_weight_bytes(), stop_reason=slot.out.stop_reason,
            device=str(model.device), dtype=str(model.dtype).removeprefix("torch."), settings=slot.cfg.to_dict(),
            shared_with=slot.beside)
        slot.events.append(Finished(slot.out.text, slot.out.ids, slot.prompt, stats))
