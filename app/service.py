"""Fair service: one visitor cannot hold the others back.

Generation jobs share one device. Off a ZeroGPU Space they decode together in one batch of `seats`
(app.inference.BATCHED: core.serving.BatchServer): every admitted job's handler runs at once, reading its own request's
stream, and the jobs past the seats wait in the batch's line, first come first served, each told its place. On ZeroGPU
there is no batch: one seat, and the admitted jobs' handlers wait for it in the app's own line (Jobs), in order of
arrival. Admission is the app's own, decided by the generation handler as it starts (Jobs.admitted, from the public
gr.Request), never by Gradio's queue, which runs every generation handler at once (handlers): the admitted jobs are at
most VISITOR_JOBS per visitor (Gradio's session), running or waiting, at most a share of the places (seats and waiting)
per address (address_jobs: a client chooses its session, not its address), and WAITING_JOBS waiting beyond the seats;
a job past any bound is refused at once (gr.Error), in one line that says why and how long the wait is, and an
admitted job that has to wait is told its place and the wait. A job leaves the line when its handler ends, however it
ends (finished, refused later, stopped, its client gone). A job's generation stops after a bound of time with a seat
(run_seconds; waiting in line does not count), its answer so far kept. With one job per visitor and a bounded run, a
flood from one session holds at most one seat, and one from many sessions of one address at most its share, so
another visitor waits at most for seats to turn over. The address is the client's as uvicorn gives it: behind a proxy
the forwarded one only where FORWARDED_ALLOW_IPS trusts the proxy (as for uploads).

Uploads: the bytes one address may upload in a window are bounded before Gradio reads them (UploadBudget), and the
files a session used are deleted when it ends (or when it has uploaded UPLOADS_KEPT newer ones)."""

from __future__ import annotations

import collections
import contextlib
import math
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import gradio as gr
from gradio.utils import get_upload_folder

from app.documents import MAX_UPLOAD_BYTES
from app.refusals import cut, log

VISITOR_JOBS = 1  # generation jobs one visitor may hold, its running one included
WAITING_JOBS = 16  # generation jobs waiting in all (those with a seat aside)
ADDRESS_SHARE = 4  # one address holds at most 1/ADDRESS_SHARE of the places: at least this many addresses fit at once
QUEUE_EVENTS = 64  # every kind of event waiting at once: Gradio's own max_size, a backstop behind the bounds above
REFUSING = 8  # generation handlers beyond the admitted jobs', so that a job past the bounds is refused at once
SEAT_POLL_S = 0.1  # a job waiting for its seat in the app's line looks this often whether it was stopped
REFUSED_TITLE = "Please wait your turn"  # the title of an admission's refusal
RUN_SECONDS_ENV = "TRIFORCE_RUN_SECONDS"
RUN_SECONDS = 180.0  # a job's generation time, by default: a few hundred tokens of the embedded model on a CPU
MAX_RUN_SECONDS = 24 * 3600.0
UPLOADS_KEPT = 2  # files one session keeps on disk; an older one is deleted when a newer one comes
UPLOAD_SESSIONS = 10_000  # sessions whose uploads are remembered: past that the oldest one's are deleted
UPLOAD_WINDOW_S = 600.0
UPLOAD_BUDGET_BYTES = 4 * MAX_UPLOAD_BYTES  # bytes one address may upload per UPLOAD_WINDOW_S
UPLOAD_ADDRESSES = 10_000  # addresses whose recent uploads are remembered (the oldest forgotten first)


class ServiceError(ValueError):
    """A bad service setting (TRIFORCE_RUN_SECONDS); the message says what to set."""


def run_seconds(environ: dict[str, str] | None = None) -> float:
    """How long one generation job may run, in seconds: TRIFORCE_RUN_SECONDS, else RUN_SECONDS. A value that is no
    number of seconds above 0 (and at most a day) raises ServiceError."""
    text = (os.environ if environ is None else environ).get(RUN_SECONDS_ENV, "").strip()
    if not text:
        return RUN_SECONDS
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not 0 < seconds <= MAX_RUN_SECONDS:  # NaN fails this too
        raise ServiceError(f"{RUN_SECONDS_ENV} must be a number of seconds above 0 and at most {MAX_RUN_SECONDS:g}, "
                           f"got {text[:40]!r}")
    return seconds


def span(seconds: float) -> str:
    """A duration as people say it: "40 s", "3 min", "1 h 5 min" (rounded up: a wait is not promised short)."""
    seconds = math.ceil(max(seconds, 0))
    if seconds < 100:
        return f"{seconds} s"
    minutes = math.ceil(seconds / 60)
    return f"{minutes} min" if minutes < 60 else f"{minutes // 60} h {minutes % 60} min"


@dataclass
class Deadline:
    """The end of one job's time: `seconds` (run_seconds) on its clock, which runs from when it is made except while
    the job waits in the batch's line (`wait`, then `go`): a visitor's bound is spent decoding, not waiting."""

    seconds: float
    spent: float = field(init=False, default=0.0)
    since: float | None = field(init=False, default=None)  # when the clock last started; None while it waits

    def __post_init__(self) -> None:
        self.go()

    def wait(self) -> None:
        """Stop the clock: the job waits for a seat."""
        if self.since is not None:
            self.spent += time.monotonic() - self.since
            self.since = None

    def go(self) -> None:
        """Start the clock again: the job has its seat."""
        if self.since is None:
            self.since = time.monotonic()

    def passed(self) -> bool:
        """Whether the job's time is up."""
        running = time.monotonic() - self.since if self.since is not None else 0.0
        return self.spent + running >= self.seconds


def size(n: float) -> str:
    """A number of bytes as people say it: "512 bytes", "1.5 MiB"."""
    return plural(int(n), "byte") if n < 1024 else f"{n / 2**10:.3g} KiB" if n < 2**20 else f"{n / 2**20:.3g} MiB"


def plural(n: int, noun: str) -> str:
    """"1 run", "2 runs"."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def out_of_time_line(seconds: float, tokens: int) -> str:
    """The status of a job stopped at its wall-time bound."""
    return (f"⏱️ Stopped at the time bound of a run ({span(seconds)}, so that every visitor gets a turn): the "
            f"answer so far is kept ({tokens} tokens). Ask for fewer new tokens to finish within it.")


class Job(NamedTuple):
    """An admitted generation job: whom it is counted against (visitor) and the address it came from."""

    visitor: str
    address: str


def address_jobs(seats: int) -> int:
    """Generation jobs one address may hold, running or waiting: its share of the places (seats and waiting), and
    never less than one visitor's."""
    return max(VISITOR_JOBS, (seats + WAITING_JOBS) // ADDRESS_SHARE)


@dataclass
class Line:
    """The generation jobs at one moment (Jobs.line): those with a seat and those waiting for one (first come
    first), for how long the oldest running job has run (0 with several seats: unknown per job, so a wait is not
    promised short), how long a job has taken with its seat on average (None before one finished), the bound on a
    job's run, and the seats: the first `seats` jobs decode, the others wait (in the app's line with one seat; in the
    batch's line with several), every handler running."""

    running: list[Job]
    waiting: list[Job]
    elapsed: float
    typical: float | None
    bound: float
    seats: int = 1

    @property
    def jobs(self) -> list[Job]:
        """Every admitted job, first come first."""
        return self.running + self.waiting

    def held_by(self, visitor: str) -> int:
        """Jobs of `visitor` running or waiting."""
        return sum(job.visitor == visitor for job in self.jobs)

    def from_address(self, address: str) -> int:
        """Jobs from `address` running or waiting."""
        return sum(job.address == address for job in self.jobs)

    def ends(self, position: int) -> str:
        """When the job at `position` (first come first) ends at the latest: its wait for a seat, then its bound."""
        left = max(self.bound - self.elapsed, 0.0) if self.running else 0.0
        if position < self.seats:
            return f"within {span(left)}" if self.seats == 1 else f"within {span(self.bound)} of its start"
        return f"within {span(left + ((position - self.seats) // self.seats + 1) * self.bound)}"

    def wait(self, ahead: int) -> str:
        """How long a job waits for a seat with `ahead` jobs waiting before it: "about X, at most Y". Seats turn over
        `seats` at a time, each within a run's bound (runs are cut at the bound, loading a model aside); only the
        most before a job has finished."""
        if not ahead and len(self.running) < self.seats:
            return "no time"
        turns = ahead // self.seats  # whole turnovers of the seats before its own
        left = max(self.bound - self.elapsed, 0.0) if self.running else 0.0
        most = left + turns * self.bound
        if self.typical is None:
            return f"at most {span(most)}"
        typical = min(self.typical, self.bound)
        about = (min(max(typical - self.elapsed, 0.0), left) if self.running else 0.0) + turns * typical
        return f"about {span(about)}, at most {span(most)}"


def visitor(session_hash: str | None, request: Any) -> str:
    """Whom a job is counted against: its session, or its client's address where it came without one (Gradio's REST
    route lets a caller leave the session out)."""
    if session_hash:
        return session_hash
    client = getattr(request, "client", None)
    return f"address {getattr(client, 'host', None) or 'unknown'}"


def address(request: Any) -> str:
    """The address a request came from, as uvicorn gives it (a proxy's forwarded one only where FORWARDED_ALLOW_IPS
    trusts the proxy)."""
    client = getattr(request, "client", None)
    return getattr(client, "host", None) or "unknown"


def admission(now: Line, new: Job) -> str | None:
    """Why the job `new` is refused (one line, with the wait), or None when it is admitted."""
    who = new.visitor
    if now.held_by(who) >= VISITOR_JOBS:
        position = [job.visitor for job in now.jobs].index(who)
        ahead = position - now.seats  # jobs waiting before it; below 0: it has a seat
        if ahead < 0 and any(job.visitor == who for job in now.running):
            return (f"Your earlier run is still going (one run at a time per visitor); it ends {now.ends(position)}. "
                    f"Wait for it, or press Stop and run again.")
        return (f"Your earlier run is still waiting (one run at a time per visitor): it starts in "
                f"{now.wait(max(ahead, 0))}. Wait for it, or press Stop and run again.")
    if (held := now.from_address(new.address)) >= (most := address_jobs(now.seats)):
        first = [job.address for job in now.jobs].index(new.address)
        return (f"Too many runs from your address ({held} running or waiting; at most {most} per address, so that "
                f"every visitor gets a seat): the first of them ends {now.ends(first)}. Try again then.")
    if len(now.jobs) >= now.seats + WAITING_JOBS:
        device = "the one device" if now.seats == 1 else "a seat in the batch"
        return (f"The queue is full ({plural(len(now.jobs) - now.seats, 'run')} waiting for {device}): a place "
                f"frees in {now.wait(0)}. Try again then.")
    return None


def concurrent_jobs(seats: int) -> int:
    """Generation jobs admitted at once, their handlers all running: those with a seat and those waiting for one (in
    the batch's line, or the app's own with one seat)."""
    return seats + WAITING_JOBS


def handlers(seats: int) -> int:
    """Generation handlers Gradio runs at once: every admitted job's, and REFUSING more, so that a job past the
    bounds reaches its handler, which refuses it, without waiting in Gradio's queue."""
    return concurrent_jobs(seats) + REFUSING


@dataclass(eq=False)
class Ticket:
    """An admitted job's place in the app's line (Jobs): the job, and since when it has had a seat (None while it
    waits for one)."""

    job: Job
    line: Jobs
    seated: float | None = None

    def place(self) -> int | None:
        """Where it waits for a seat (1: next), None once it has one."""
        return self.line.place(self)

    def seat(self, stop: threading.Event) -> bool:
        """Wait until it has a seat (True), or until `stop` is set (False)."""
        return self.line.seat(self, stop)


class Jobs:
    """The generation jobs admitted now, in order of arrival: the first `seats` have a seat, the others wait for one
    (off ZeroGPU in the batch's line, their handlers reading their streams; on ZeroGPU here, one seat, each waiting
    for its turn with Ticket.seat). The handlers admit and release their own job (admitted): no other code counts."""

    def __init__(self, seats: int = 1) -> None:
        self.seats = seats
        self.tickets: list[Ticket] = []
        self.changed = threading.Condition()  # guards the tickets; notified when one leaves
        self.finished, self.seated_s = 0, 0.0  # jobs that ended after a seat, and their seconds with it

    def line(self, bound: float) -> Line:
        """The jobs as admission sees them, `bound` the run bound (the caller holds `changed`)."""
        jobs = [ticket.job for ticket in self.tickets]
        first = self.tickets[0].seated if self.tickets and self.seats == 1 else None  # several seats: unknown per job
        return Line(jobs[:self.seats], jobs[self.seats:], time.monotonic() - first if first is not None else 0.0,
                    self.seated_s / self.finished if self.finished else None, bound, self.seats)

    def admit(self, job: Job) -> Ticket:
        """Admit `job` (last in line) or refuse it with a gr.Error in one line (admission's); a job that has to wait
        is told its place and the wait (gr.Info)."""
        with self.changed:
            now = self.line(run_seconds())
            if refusal := admission(now, job):
                log.warning("refused (queue): %s from %s: %s", cut(repr(job.visitor), 40), job.address, refusal)
                raise gr.Error(refusal, title=REFUSED_TITLE, print_exception=False)
            ticket = Ticket(job, self)
            self.tickets.append(ticket)
            self._seat()
        if len(now.jobs) >= self.seats:  # no seat free: it waits
            together = f" ({self.seats} decode at once)" if self.seats > 1 else ""
            gr.Info(f"{plural(len(now.jobs), 'run')} ahead of yours{together}: it starts in "
                    f"{now.wait(len(now.jobs) - self.seats)} (every run stops at {span(now.bound)}).",
                    title="Queued", duration=10)
        return ticket

    def release(self, ticket: Ticket) -> None:
        """The job's handler ended: it leaves the line, the next one takes its seat."""
        with self.changed:
            if ticket.seated is not None:
                self.finished += 1
                self.seated_s += time.monotonic() - ticket.seated
            self.tickets.remove(ticket)
            self._seat()
            self.changed.notify_all()

    @contextlib.contextmanager
    def admitted(self, request: Any) -> Iterator[Ticket]:
        """The job of a generation handler's request (gr.Request: its session and address) admitted for as long as
        the handler runs, however it ends; refused with a gr.Error past the bounds."""
        ticket = self.admit(Job(visitor(getattr(request, "session_hash", None), request), address(request)))
        try:
            yield ticket
        finally:
            self.release(ticket)

    def place(self, ticket: Ticket) -> int | None:
        """Where `ticket` waits for a seat (1: next), None once it has one."""
        with self.changed:
            at = self.tickets.index(ticket) if ticket in self.tickets else 0
        return at - self.seats + 1 if at >= self.seats else None

    def seat(self, ticket: Ticket, stop: threading.Event) -> bool:
        """Wait until `ticket` has a seat (True), or until `stop` is set (False)."""
        with self.changed:
            while self.place(ticket) is not None:
                if stop.is_set():
                    return False
                self.changed.wait(SEAT_POLL_S)
        return True

    def _seat(self) -> None:
        """Give the first `seats` jobs their seat's start (the caller holds `changed`)."""
        for ticket in self.tickets[:self.seats]:
            if ticket.seated is None:
                ticket.seated = time.monotonic()


def serve(demo: gr.Blocks) -> gr.Blocks:
    """Queue `demo` through Gradio's public settings: QUEUE_EVENTS at most and one job at a time by default (the
    generation events set their own concurrency: handlers); each session's uploads are deleted when it ends."""
    demo.queue(default_concurrency_limit=1, max_size=QUEUE_EVENTS)
    demo.unload(forget_session)
    return demo


_uploads: collections.OrderedDict[str, collections.deque[Path]] = collections.OrderedDict()  # newest session last
_uploads_lock = threading.Lock()


def _delete_upload(path: Path) -> None:
    """Delete an upload, and its folder once empty (Gradio keeps each upload in a folder named by its content's
    hash); nothing outside Gradio's upload folder."""
    root, path = Path(get_upload_folder()).resolve(), path.resolve()
    if root not in path.parents:
        return
    path.unlink(missing_ok=True)
    if path.parent != root:
        with contextlib.suppress(OSError):  # another file is still in it
            path.parent.rmdir()


def keep_upload(session_hash: str | None, path: str | Path) -> None:
    """Record an upload a session read; its uploads beyond the newest UPLOADS_KEPT are deleted, and so are those of
    the sessions beyond the newest UPLOAD_SESSIONS (a client that never opens the page never ends its session)."""
    if not session_hash:
        _delete_upload(Path(path))  # no session to end: nothing would delete it later
        return
    with _uploads_lock:
        kept = _uploads.pop(session_hash, collections.deque())
        _uploads[session_hash] = kept
        kept.append(Path(path))
        old = [kept.popleft() for _ in range(len(kept) - UPLOADS_KEPT)]
        while len(_uploads) > UPLOAD_SESSIONS:
            old.extend(_uploads.popitem(last=False)[1])
    for path in old:
        _delete_upload(path)


def forget_session(request: gr.Request) -> None:
    """A session ended (its tab closed): delete the uploads it read."""
    with _uploads_lock:
        kept = _uploads.pop(request.session_hash or "", ())
    for path in kept:
        _delete_upload(path)


class UploadBudget:
    """ASGI middleware before Gradio's upload route: an address may upload UPLOAD_BUDGET_BYTES per UPLOAD_WINDOW_S,
    counted from each request's declared length before its body is read; past that the request is refused (HTTP
    429, one line saying when uploads are taken again), as is a request that does not declare its length (411).
    Behind a proxy, the address is the one uvicorn takes from the proxy's headers (FORWARDED_ALLOW_IPS)."""

    def __init__(self, app: Any, budget: int = UPLOAD_BUDGET_BYTES, window: float = UPLOAD_WINDOW_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.app, self.budget, self.window, self.clock = app, budget, window, clock
        self.spent: collections.OrderedDict[str, collections.deque[tuple[float, int]]] = collections.OrderedDict()

    def refusal(self, address: str, length: int) -> str | None:
        """Why an upload of `length` bytes from `address` is refused now, or None (and then it is counted)."""
        now = self.clock()
        spent = self.spent.pop(address, collections.deque())
        while spent and spent[0][0] <= now - self.window:
            spent.popleft()
        used = sum(n for _, n in spent)
        self.spent[address] = spent  # most recent last: the least recent address is forgotten first
        while len(self.spent) > UPLOAD_ADDRESSES:
            self.spent.popitem(last=False)
        if used + length > self.budget:
            again = spent[0][0] + self.window - now if spent else self.window
            return (f"Upload refused: at most {size(self.budget)} per {span(self.window)} from one address "
                    f"({size(used)} uploaded, {size(length)} more asked); try again in {span(again)}.")
        spent.append((now, length))
        return None

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or not scope["path"].endswith("/gradio_api/upload"):
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length", b"")
        address = (scope.get("client") or ("unknown",))[0]
        if not length.isdigit():
            status, message = 411, "Upload refused: the request must say its length (Content-Length)."
        else:
            status, message = 429, self.refusal(address, int(length))
        if message is None:
            return await self.app(scope, receive, send)
        log.warning("refused (upload): %s: %s", address, message)
        body = message.encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"text/plain; charset=utf-8"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
