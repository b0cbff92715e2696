"""The one place that talks to the engine: cached model loading and the (ZeroGPU-aware) event stream.

Off a ZeroGPU Space every visitor's run is a request on one BatchServer per loaded engine (core.serving): a thread
of its own decodes the batch, runs that arrive while it decodes join it at a next round, at most SEATS decode at
once and the rest wait in line, first come first served. On ZeroGPU the GPU is lent to a worker process only for the
call of a @spaces.GPU function (at most its duration): no decoding thread can outlive a request there, so runs go one
at a time, each in its own call, in the order the app's line (app.service.Jobs) gives them their one seat (BATCHED
false)."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import itertools
import os
import queue
import re
import threading
import time
from collections.abc import Callable, Generator, Iterable, Iterator
from dataclasses import dataclass, fields, replace

try:  # ZeroGPU: the `spaces` package must be imported before torch; off a Space its decorator does nothing.
    import spaces

    gpu = spaces.GPU(duration=240)
except ImportError:
    def gpu(fn):  # type: ignore[no-redef]
        """No-op stand-in for spaces.GPU off Hugging Face Spaces."""
        return fn

from app.presets import Preset
from app.service import Deadline, Ticket
from app.state import InLine, ShownVerdict, typed
from core import Engine, GenerationConfig, TriForceError
from core.batching import Request
from core.config import SEATS
from core.events import Event, Finished, PromptReady, Verdict
from core.io import gpu_memory_gib, note_gpu_only
from core.serving import BatchServer, drained

ZERO_GPU = os.environ.get("SPACES_ZERO_GPU", "").lower() in ("1", "t", "true")  # a ZeroGPU Space (spaces' own test)
BATCHED = not ZERO_GPU  # visitors' runs decode together in one batch (ZeroGPU: one at a time; the module says why)
_RUN_LOCK = threading.Lock()  # unbatched: one generation at a time, even while a cancelled run's last step finishes
_servers: dict[int, BatchServer] = {}  # the batch of each loaded engine, by the engine's id (Engine.load keeps it)
_servers_lock = threading.Lock()
_runs = itertools.count(1)  # numbers every run: a request's key is unique whoever sends it
_DONE = object()  # the end of a generation's event queue
# The engine's thread lets go of the GIL while it waits for the device and wants it back the moment a step is done;
# a UI thread holding it runs on for Python's switch interval (5 ms by default: several decode steps of a small model
# on a GPU) before it hands over. A shorter interval bounds that wait; the process serving the app sets it (app.py).
SWITCH_INTERVAL_S = 0.0005
HANDOVER_S = 0.02  # events go to the app in batches at most this far apart (a handover per event costs GIL switches)
WAITING_S = 0.25  # with no event for this long, the stream says it is waiting (a Stop lands between yields)
URGENT_KINDS = ("Loading", "PrefillProgress", "PromptReady", "Finished")  # handed over at once
_loaded: dict[tuple[str | None, str | None], dict] = {}


@dataclass
class Waiting(Event):
    """No event came for WAITING_S (a long prefill forward): the consumer yields, so that a Stop lands."""


@dataclass
class OutOfTime(Event):
    """The job's wall-time bound passed (app.service.Deadline): its generation was stopped there, the events before
    this one standing."""


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, where there is one (Linux with glibc)."""
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


_MALLOC_TRIM = _malloc_trim()


def trim_host_memory() -> None:
    """Hand the C heap's free pages back to the system after a run: glibc keeps them, so runs of varied sizes would
    otherwise leave the process's resident memory creeping up."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


class ModelLoadError(RuntimeError):
    """A preset's models could not be loaded; the message says which and why."""


def load_engine(target: str | None, draft: str | None, name: str | None = None) -> Engine:
    """The engine for a target/draft pair (Engine.load caches per process), held to TRIFORCE_GPU_MEMORY_GIB of GPU
    memory when set (a larger GPU then offloads like a card of that size); failures raise ModelLoadError, which
    calls the pair `name` if given."""
    setting = os.environ.get("TRIFORCE_GPU_MEMORY_GIB", "").strip()
    try:
        budget = gpu_memory_gib(setting) if setting else None
    except TriForceError as err:
        raise ModelLoadError(f"TRIFORCE_GPU_MEMORY_GIB: {err}") from None
    try:
        engine = Engine.load(gpu_memory_gib=budget) if target is None else \
            Engine.load(target=target, draft=draft, gpu_memory_gib=budget)
    except Exception as err:  # any loader failure (missing weights, no network, out of memory) must not kill the app
        name = name or (target or "the embedded model") + (f" + {draft}" if draft else "")
        raise ModelLoadError(f"Could not load {name}: {err}. "
                             "The embedded SmolLM2 preset works offline on CPU.") from err
    if budget is not None and engine.target.device.type != "cuda":
        note_gpu_only("TRIFORCE_GPU_MEMORY_GIB", engine.target.device.type)
    _loaded[(target, draft)] = dict(engine.info)
    return engine


def preset_engine(preset: Preset) -> Engine:
    """The engine of a preset."""
    return load_engine(*preset.sources(), preset.name)


def seats() -> int:
    """Runs that decode at once: SEATS in the batch, one without it."""
    return SEATS if BATCHED else 1


def batch_server(preset: Preset) -> BatchServer:
    """The one BatchServer of the preset's engine, made at its first request with seats() seats."""
    engine = preset_engine(preset)
    with _servers_lock:
        if id(engine) not in _servers:
            _servers[id(engine)] = BatchServer(engine, seats())
        return _servers[id(engine)]


def warm_up(preset: Preset) -> float | None:
    """Compile the preset's GPU kernels before serving (Engine.warm_up); seconds taken, or None where nothing is
    compiled ahead (a CPU) or nothing may run outside a request (ZeroGPU lends its GPU only inside one)."""
    engine = preset_engine(preset)
    if engine.target.device.type != "cuda" or ZERO_GPU:
        return None
    started = time.monotonic()
    engine.warm_up()
    return time.monotonic() - started


def counting_engine(preset: Preset) -> tuple[Engine, bool]:
    """The preset's engine if already loaded (exact counts), else the embedded one (approximate counts)."""
    if preset.sources() in _loaded:
        return preset_engine(preset), True
    return load_engine(None, None), preset.target is None


def loaded_infos() -> list[dict]:
    """engine.info of every engine loaded in this process, oldest first."""
    return list(_loaded.values())


@functools.cache
def _special_tokens(tokenizer) -> re.Pattern:
    """A pattern matching the tokenizer's special-token strings (never shown as text)."""
    return re.compile("|".join(map(re.escape, sorted(tokenizer.all_special_tokens, key=len, reverse=True))))


def shown(tokenizer, event: Event) -> Event:
    """An engine event as the page shows it: a Verdict with the text of each proposed token (ShownVerdict), for
    showing rejected drafts; special tokens left out of every text (the prompt's chunks included)."""
    if isinstance(event, Verdict):
        texts = [tokenizer.decode([token], skip_special_tokens=True) for token in event.proposed]
        return ShownVerdict(**{f.name: getattr(event, f.name) for f in fields(Verdict)}, proposed_texts=texts)
    if isinstance(event, PromptReady):
        specials = _special_tokens(tokenizer)
        return replace(event, chunk_texts=[specials.sub("", text) for text in event.chunk_texts])
    return event


def _shown(tokenizer, events: Iterable[Event]) -> Iterator[dict]:
    """Generation events as `shown` makes them, as plain dicts (safe to pickle out of a ZeroGPU worker; a
    ShownVerdict crosses as a Verdict with its texts, app.state.typed)."""
    for event in events:
        yield shown(tokenizer, event).to_dict() | {"kind": type(event).__name__}


@gpu
def _event_dicts(target: str | None, draft: str | None, document: str, instruction: str,
                 config: dict, stop: threading.Event | None = None) -> Iterator[dict]:
    """One generation run alone, its events as _shown's dicts. `stop` (not across processes: None on ZeroGPU) stops
    a prefill between two layers."""
    engine = load_engine(target, draft)
    yield from _shown(engine.tokenizer, engine.generate(document, instruction, GenerationConfig(**config), stop))


@contextlib.contextmanager
def _turn(ticket: Ticket | None, stop: threading.Event) -> Iterator[None]:
    """A run alone's turn: its seat in the app's line, first come first (unless `stop` is set while it waits), then
    the device to itself (_RUN_LOCK: a cancelled run's last step may still be finishing)."""
    if ticket is not None and not ticket.seat(stop):
        yield
        return
    with _RUN_LOCK:
        yield


def _hand_over(generation: Callable[[], Iterator[dict]], lock: contextlib.AbstractContextManager, stop: threading.Event,
               events: queue.Queue) -> None:
    """Run a generation (under `lock`, unless `stop` was set meanwhile) on this thread, handing its event dicts to
    `events` in batches HANDOVER_S apart (an urgent kind at once) until it ends or `stop` is set; an error goes over
    as an item, _DONE last."""
    with lock:
        if stop.is_set():  # stopped while it waited for its turn: nothing ran
            events.put(_DONE)
            return
        stream = generation()
        batch: list = []
        handed = time.monotonic()
        try:
            for event in stream:
                if stop.is_set():
                    break
                batch.append(event)
                if event["kind"] in URGENT_KINDS or time.monotonic() - handed >= HANDOVER_S:
                    events.put(batch)
                    batch, handed = [], time.monotonic()
        except Exception as err:  # handed to the consumer, which raises it where the UI can report it
            batch.append(err)
        finally:
            stream.close()
            trim_host_memory()
            events.put(batch)
            events.put(_DONE)


def stream_events(preset: Preset, document: str, instruction: str, config: GenerationConfig,
                  deadline: Deadline | None = None, turn: Ticket | None = None) -> Iterator[Event]:
    """The typed events of one generation: the request of `turn`'s visitor on the batch (BATCHED: its events read
    from the batch's own stream as its thread makes them; bad input raises TriForceError here), else a run alone,
    one at a time once `turn` has its seat in the app's line, on a thread of its own that hands its events over
    (_hand_over: the dicts a ZeroGPU worker sends). Either way rendering them never holds decoding up (a generator's
    consumer would otherwise be timed as decoding). While the run waits in line `deadline`'s clock stops, and once
    it has waited WAITING_S an InLine says its place (again as it moves up). While no event comes (a long prefill
    forward, the line), a Waiting comes every WAITING_S, so that the consumer yields and a Stop lands; a closed
    stream (Stop) ends its generation at the next event, or between two layers of a prefill forward, the others in
    the batch decoding on. Once `deadline` has passed (asked at each event and each Waiting) the generation stops
    the same way, the events it made until then standing, and an OutOfTime comes last unless it had finished."""
    stop = threading.Event()
    if BATCHED:
        server = batch_server(preset)
        visitor = turn.job.visitor if turn else "visitor"
        request = Request(f"{next(_runs)}:{visitor[:40]}", document, instruction, config=config, stop=stop)
        events = _shown_typed(server.engine.tokenizer, server.submit(request, idle=WAITING_S))
        try:
            yield from _followed(events, stop, functools.partial(server.position, request.key), server.slots,
                                 deadline)
        finally:
            trim_host_memory()
        return
    handed: queue.Queue = queue.Queue()
    generation = functools.partial(_event_dicts, *preset.sources(), document, instruction, config.to_dict(),
                                   None if ZERO_GPU else stop)
    threading.Thread(target=_hand_over, args=(generation, _turn(turn, stop), stop, handed),
                     name="triforce-generation", daemon=True).start()
    yield from _followed(_taken(handed), stop, turn.place if turn else lambda: None, 1, deadline)


def _shown_typed(tokenizer, events: Iterator[Event | None]) -> Generator[Event | None, None, None]:
    """The batch's events of one request as `shown` makes them (None: none came for a while); closing this closes
    `events`, which takes the request out of the batch."""
    with contextlib.closing(events):
        for event in events:
            yield None if event is None else shown(tokenizer, event)


def _taken(handed: queue.Queue) -> Generator[Event | Exception | None, None, None]:
    """The events a run alone hands over (_hand_over), typed again, one by one (None: none came for WAITING_S)."""
    for batch in drained(handed, WAITING_S, _DONE):
        if batch is None:
            yield None
        else:
            yield from (item if isinstance(item, Exception) else typed(item) for item in batch)


def _followed(events: Generator[Event | Exception | None, None, None], stop: threading.Event,
              place: Callable[[], int | None], together: int, deadline: Deadline | None) -> Iterator[Event]:
    """The generation's `events` for its consumer (stream_events says what comes when): `place` says where it waits
    in line (None once it has a seat, `together` decoding at once), `stop` ends the generation."""
    stopped_in_time = finished = False
    line = place()  # its place in line (the batch's, or the app's for a run alone); None once it has a seat
    shown_place = None  # the place an InLine said last: said once no event came for WAITING_S (a seat is taken at once)
    if line is not None and deadline is not None:
        deadline.wait()
    try:
        for event in events:
            if not stopped_in_time and deadline is not None and deadline.passed():
                stop.set()  # the generation stops at its next event or prefill layer; what it made until then stands
                stopped_in_time = True
            if line is not None:  # its first events, or the line, say when it has its seat
                line = None if event is not None else place()
                if line is None and deadline is not None:
                    deadline.go()
            if event is None:
                if line is not None and line != shown_place:
                    shown_place = line
                    yield InLine(line, together)
                else:
                    yield Waiting()
                continue
            if isinstance(event, Exception):
                raise event
            finished = finished or isinstance(event, Finished)
            yield event
        if stopped_in_time and not finished:
            yield OutOfTime()
    finally:
        stop.set()
        events.close()
