"""Fair service (app.service): one visitor cannot hold the others back. Through the served app, with a client per
session: a flood from one session is refused job by job while its one run is cut at its time bound, and another
visitor is served right after that run; many sessions of one address (a proxy on the loopback forwarding it) are
refused past the address's share while another address is served; a full queue refuses in one line with the wait;
an admitted job that waits is told its place; a job whose client vanished leaves the line long before its bound.
Alone: the queue's arithmetic, the app's own line, a generation stopped at its bound with its answer kept, and the
upload bounds. Order is asserted (who is served when, who is refused), never how many seconds something took."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from core.events import Tokens

from app import inference, service
from app.presets import EMBEDDED
from app.service import (Job, Jobs, Line, ServiceError, UploadBudget, admission, forget_session, keep_upload,
                         run_seconds)
from app.state import InLine
from tests.served import served

ROOT = Path(__file__).resolve().parent.parent
DOC = (ROOT / "assets" / "docs" / "us_declaration_of_independence.txt").read_text(encoding="utf-8")[:600]
HANG_S = 600  # only against a hang: a job that never reaches the state waited for fails the test instead


# ---------------------------------------------------------------- the queue's arithmetic


def job(visitor: str, address: str | None = None) -> Job:
    """A job of `visitor`, from `address` or else from an address of its own."""
    return Job(visitor, address or f"address of {visitor}")


def jobs(visitors: str, address: str | None = None) -> list[Job]:
    """A job for each visitor named by a letter, from `address` or else from an address of their own."""
    return [job(v, address) for v in visitors]


def test_a_visitor_holding_a_job_is_refused_another_with_the_wait() -> None:
    running = Line(running=jobs("a"), waiting=jobs("bc"), elapsed=30.0, typical=40.0, bound=180.0)
    assert admission(running, job("a")).startswith("Your earlier run is still going (one run at a time per "
                                                   "visitor); it ends within 3 min.")
    assert admission(running, job("c")) == ("Your earlier run is still waiting (one run at a time per visitor): it "
                                            "starts in about 50 s, at most 6 min. Wait for it, or press Stop and run "
                                            "again.")
    assert admission(running, job("d")) is None


def test_a_full_queue_refuses_everyone_with_when_a_place_frees(monkeypatch) -> None:
    monkeypatch.setattr(service, "WAITING_JOBS", 2)
    full = Line(running=jobs("a"), waiting=jobs("bc"), elapsed=100.0, typical=None, bound=180.0)
    assert admission(full, job("d")) == ("The queue is full (2 runs waiting for the one device): a place frees in "
                                         "at most 80 s. Try again then.")


def test_one_address_holds_at_most_its_share_of_the_places_whatever_its_sessions() -> None:
    """Sessions are the client's to choose, its address is not: many sessions of one address are refused past the
    address's share, with when to retry, while another address is admitted."""
    most = service.address_jobs(8)
    assert most == (8 + service.WAITING_JOBS) // service.ADDRESS_SHARE and service.address_jobs(1) >= 1
    now = Line(running=jobs("abcdefgh"[:most], "10.0.0.1") + jobs("xy"), waiting=[], elapsed=0.0, typical=None,
               bound=180.0, seats=8)
    assert admission(now, job("z", "10.0.0.1")) == (
        f"Too many runs from your address ({most} running or waiting; at most {most} per address, so that every "
        "visitor gets a seat): the first of them ends within 3 min of its start. Try again then.")
    assert admission(now, job("z", "10.0.0.2")) is None
    alone = Line(running=jobs("a", "10.0.0.1"), waiting=jobs("bcd", "10.0.0.1"), elapsed=60.0, typical=None,
                 bound=180.0, seats=1)
    assert admission(alone, job("e", "10.0.0.1")).endswith("the first of them ends within 2 min. Try again then.")


@pytest.mark.parametrize("value", ["abc", "0", "-5", "nan", "inf", "1e9"])
def test_a_bad_run_bound_setting_is_refused_in_one_line(value: str) -> None:
    with pytest.raises(ServiceError, match=r"^TRIFORCE_RUN_SECONDS must be a number of seconds above 0 and at "
                                           r"most 86400, got '"):
        run_seconds({"TRIFORCE_RUN_SECONDS": value})
    assert run_seconds({}) == service.RUN_SECONDS and run_seconds({"TRIFORCE_RUN_SECONDS": " 2.5 "}) == 2.5


# ---------------------------------------------------------------- the app's own line


def test_no_module_of_the_app_touches_gradios_private_queue() -> None:
    """Admission is the app's own (app.service.Jobs): no module of the app imports Gradio's queue or its server
    messages, or reaches for a Blocks' private queue."""
    import ast

    private = ("gradio.queueing", "gradio.server_messages")
    for path in [ROOT / "app.py", *sorted((ROOT / "app").glob("*.py"))]:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        imported = [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names]
        imported += [f"{node.module}.{alias.name}" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                     for alias in node.names]
        assert not [name for name in imported if name.startswith(private)], path
        assert not [node for node in ast.walk(tree) if isinstance(node, ast.Attribute) and node.attr == "_queue"], path


def request(session: str, host: str = "10.0.0.9") -> SimpleNamespace:
    """A gr.Request as the admission reads it: its session and its client's address."""
    return SimpleNamespace(session_hash=session, client=SimpleNamespace(host=host))


def test_the_apps_line_seats_jobs_in_order_of_arrival_and_a_job_leaves_it_however_its_handler_ends() -> None:
    import gradio as gr

    line = Jobs(seats=1)
    stop = threading.Event()
    with line.admitted(request("a")) as a, line.admitted(request("b")) as b:
        c = line.admit(Job("c", "10.0.0.8"))
        assert [a.place(), b.place(), c.place()] == [None, 1, 2] and a.seat(stop)
        with pytest.raises(gr.Error) as refused:
            line.admit(Job("a", "10.0.0.7"))
        assert refused.value.message.startswith("Your earlier run is still going (one run at a time per visitor)")
        stop.set()
        assert not c.seat(stop)  # a stopped job gives up its wait
        with pytest.raises(RuntimeError), line.admitted(request("d")):
            raise RuntimeError("the handler failed")
        assert [t.job.visitor for t in line.tickets] == ["a", "b", "c"]  # d left with its handler
    assert line.tickets == [c] and c.place() is None and c.seat(threading.Event())
    line.release(c)
    assert line.tickets == [] and line.line(180.0).typical is not None


def test_a_run_alone_waits_for_its_seat_in_the_apps_line_before_the_engine_starts(monkeypatch) -> None:
    """On ZeroGPU each run goes alone, in order of arrival in the app's line: a run admitted behind another is told
    its place, and its engine starts only once the run before has left."""
    started = threading.Event()

    def engine(*args, **kwargs):
        started.set()
        yield Tokens([7], ["t7"], ["target"], 0).to_dict()

    monkeypatch.setattr(inference, "_event_dicts", engine)
    monkeypatch.setattr(inference, "BATCHED", False)
    line = Jobs(seats=1)
    first, second = line.admit(Job("a", "10.0.0.1")), line.admit(Job("b", "10.0.0.2"))
    events = inference.stream_events(SimpleNamespace(sources=lambda: (None, None)), "doc", "q",
                                     inference.GenerationConfig(), turn=second)
    assert next(event for event in events if not isinstance(event, inference.Waiting)) == InLine(1, 1)
    assert not started.is_set()
    line.release(first)
    assert [event.ids for event in events if isinstance(event, Tokens)] == [[7]] and started.is_set()


def test_a_batched_run_shows_the_same_events_typed_as_a_run_alone_hands_over_as_dicts() -> None:
    """The batch's events reach the page typed, with what the page adds (a proposed token's text, a prompt chunk's
    text without special tokens) made in one place; a run alone's dicts rebuild the same events."""
    from app.state import ShownVerdict, typed
    from core.events import PromptReady, Verdict

    class Tokenizer:
        """Decodes a token id as its digits in brackets; "<|end|>" is its special token."""

        all_special_tokens = ["<|end|>"]

        def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
            return f"[{ids[0]}]"

    events = [Verdict(2, 1, [5, 6], 1, 7, False), PromptReady(9, 8, 0, 64, 4, 8, ["a<|end|>", "b"]),
              Tokens([7], ["x"], ["target"], 0)]
    typed_events = [inference.shown(Tokenizer(), event) for event in events]
    assert typed_events[0] == ShownVerdict(2, 1, [5, 6], 1, 7, False, proposed_texts=["[5]", "[6]"])
    assert typed_events[1].chunk_texts == ["a", "b"] and typed_events[2] is events[2]
    assert [typed(data) for data in inference._shown(Tokenizer(), events)] == typed_events


# ---------------------------------------------------------------- a generation stopped at its bound


def test_a_generation_stops_at_its_bound_and_keeps_what_it_made(monkeypatch) -> None:
    """A stand-in engine makes a token per event for as long as it is let run; the bound passes once the consumer
    has read three tokens: the stream ends with an OutOfTime after those tokens (and any the engine had already
    handed over), and the engine was stopped, not left running."""
    closed = threading.Event()

    def engine(*args, **kwargs):
        try:
            for i in itertools.count():
                yield Tokens([i], [f"t{i}"], ["target"], i).to_dict()
                time.sleep(0.001)
        finally:
            closed.set()

    monkeypatch.setattr(inference, "_event_dicts", engine)
    monkeypatch.setattr(inference, "BATCHED", False)  # a run alone, as on ZeroGPU (the batch's bound: test_visitors)
    seen: list = []
    bound = SimpleNamespace(passed=lambda: len(seen) >= 3)  # a Deadline that passes after three events
    for event in inference.stream_events(SimpleNamespace(sources=lambda: (None, None)), "doc", "q",
                                         inference.GenerationConfig(), bound):
        seen.append(event)
    tokens = [e for e in seen if isinstance(e, Tokens)]
    assert isinstance(seen[-1], inference.OutOfTime) and len(tokens) >= 3
    assert [t.ids[0] for t in tokens] == list(range(len(tokens)))  # every token made kept, in order
    assert closed.wait(HANG_S)


# ---------------------------------------------------------------- uploads


def test_uploads_are_bounded_per_address_before_they_are_read() -> None:
    """An address may upload its budget per window; the next upload is refused (429, one line saying when it may
    upload again) without the app behind reading a byte, and another address is not affected."""
    served: list[str] = []
    now = [0.0]

    async def app(scope, receive, send) -> None:
        served.append(scope["client"][0])

    budget = UploadBudget(app, budget=100, window=60.0, clock=lambda: now[0])

    def upload(address: str, length: int | None, at: float) -> list[dict]:
        sent: list[dict] = []

        async def send(message: dict) -> None:
            sent.append(message)

        now[0] = at
        headers = [] if length is None else [(b"content-length", str(length).encode())]
        asyncio.run(budget({"type": "http", "method": "POST", "path": "/gradio_api/upload", "headers": headers,
                            "client": (address, 1)}, None, send))
        return sent

    assert upload("1.1.1.1", 60, 0.0) == [] and upload("1.1.1.1", 40, 1.0) == []
    refused = upload("1.1.1.1", 1, 2.0)
    assert refused[0]["status"] == 429 and refused[1]["body"].decode() == (
        "Upload refused: at most 100 bytes per 60 s from one address (100 bytes uploaded, 1 byte more asked); try "
        "again in 58 s.")
    assert upload("2.2.2.2", 100, 2.0) == []
    assert upload("1.1.1.1", 50, 60.5) == []  # the first upload has left the window
    assert upload("1.1.1.1", None, 62.0)[0]["status"] == 411
    assert served == ["1.1.1.1", "1.1.1.1", "2.2.2.2", "1.1.1.1"]


def test_a_sessions_uploads_are_deleted_past_the_newest_and_when_it_ends(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("GRADIO_TEMP_DIR", str(tmp_path))
    files = []
    for i in range(service.UPLOADS_KEPT + 2):
        (tmp_path / f"h{i}").mkdir()
        files.append(tmp_path / f"h{i}" / "doc.txt")
        files[-1].write_text("x")
        keep_upload("s", files[-1])
    kept = files[-service.UPLOADS_KEPT:]
    assert [f.exists() for f in files] == [f in kept for f in files] and not (tmp_path / "h0").exists()
    outside = tmp_path.parent / "not-an-upload.txt"
    outside.write_text("x")
    keep_upload("s", outside)  # a path outside Gradio's upload folder is never deleted
    forget_session(type("Request", (), {"session_hash": "s"})())
    assert not any(f.exists() for f in files) and outside.exists()


# ---------------------------------------------------------------- the served app, a client per session


@pytest.fixture(scope="module")
def url():
    """The app on a free loopback port, its embedded model loaded by one run; its batch has one seat, so that one
    run's bound is what another visitor waits for (with more seats, tests/test_visitors.py)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(inference, "SEATS", 1)
        mp.setattr(inference, "_servers", {})
        with served() as address:
            client(address).predict(**run_kwargs(), api_name="/triforce")
            yield address


def run_kwargs(**overrides) -> dict:
    """/triforce arguments: the embedded model, 4 greedy tokens."""
    return {"document": DOC, "instruction": "Who wrote this?", "preset_name": EMBEDDED, "max_new_tokens": 4,
            "budget": 64, "chunk_size": 8, "greedy": True, **overrides}


LONG = {"max_new_tokens": 4000, "greedy": False, "temperature": 2.0}  # ends at the bound, not at EOS


def client(url: str, address: str | None = None):
    """A new visitor: gradio_client's Client is one session; from `address` as a proxy on the loopback (which
    uvicorn trusts unless FORWARDED_ALLOW_IPS says otherwise) forwards it."""
    from gradio_client import Client

    return Client(url, verbose=False, headers={"X-Forwarded-For": address} if address else None)


def running(job) -> None:
    """Wait until `job` is being served: its first frame has come (its time bound is set by then)."""
    started = time.monotonic()
    while not job.outputs():
        assert not job.done() and time.monotonic() - started < HANG_S, job.status()
        time.sleep(0.02)


def queued(job) -> None:
    """Wait until `job` is admitted behind another: its client has been told its place in the queue."""
    started = time.monotonic()
    while not any("ahead of yours" in line for line in logs(job)):
        assert time.monotonic() - started < HANG_S, job.status()
        time.sleep(0.02)


def logs(job) -> list[str]:
    """The toasts (gr.Info and the like) a job's client received."""
    updates = job.communicator.updates
    return [u.log[0] for u in [updates.get_nowait() for _ in range(updates.qsize())] if getattr(u, "log", None)]


def test_a_flood_from_one_session_puts_one_bounded_run_ahead_of_another_visitor(url: str, monkeypatch) -> None:
    """One session starts a run that would last minutes, then sends ten more; each of the ten is refused at once
    in one line. Another visitor's 4-token run, sent after them, is served right after the first run, which
    stopped at its bound."""
    from gradio_client.exceptions import AppError

    flooder, visitor = client(url), client(url)
    monkeypatch.setenv("TRIFORCE_RUN_SECONDS", "3")
    long = flooder.submit(**run_kwargs(**LONG), api_name="/triforce")
    running(long)
    monkeypatch.setenv("TRIFORCE_RUN_SECONDS", str(service.RUN_SECONDS))  # the bound of the jobs that start later
    for job in [flooder.submit(**run_kwargs(), api_name="/triforce") for _ in range(10)]:
        with pytest.raises(AppError) as refused:
            job.result(timeout=HANG_S)
        assert str(refused.value).startswith("Your earlier run is still going (one run at a time per visitor)")
        assert len(str(refused.value).splitlines()) == 1
    mine = visitor.submit(**run_kwargs(), api_name="/triforce")
    assert mine.result(timeout=HANG_S)[0].startswith("✅ Finished")
    assert long.result(timeout=HANG_S)[0].startswith("⏱️ Stopped at the time bound of a run (3 s")
    assert any(line.startswith("1 run ahead of yours: it starts in ") for line in logs(mine))


def test_a_full_queue_refuses_in_one_line_with_the_wait(url: str, monkeypatch) -> None:
    from gradio_client.exceptions import AppError

    monkeypatch.setattr(service, "WAITING_JOBS", 1)
    monkeypatch.setenv("TRIFORCE_RUN_SECONDS", "3")
    first, second, third = (client(url, f"10.0.1.{i}") for i in (1, 2, 3))  # three visitors, three addresses
    long = first.submit(**run_kwargs(**LONG), api_name="/triforce")
    running(long)
    waiting = second.submit(**run_kwargs(), api_name="/triforce")
    queued(waiting)
    with pytest.raises(AppError) as refused:
        third.predict(**run_kwargs(), api_name="/triforce")
    assert str(refused.value).startswith("The queue is full (1 run waiting for the one device): a place frees in ")
    assert len(str(refused.value).splitlines()) == 1
    assert waiting.result(timeout=HANG_S)[0].startswith(("✅ Finished", "⏱️ Stopped at the time bound"))
    assert long.result(timeout=HANG_S)[0].startswith("⏱️ Stopped at the time bound")
    assert third.predict(**run_kwargs(), api_name="/triforce")[0]  # served once there is room


def test_many_sessions_of_one_address_leave_another_address_served(url: str, monkeypatch) -> None:
    """One address opens a session per run, past its share of the places: the runs beyond its share are refused at
    once in one line that says why and when to retry, and a visitor from another address is admitted and served."""
    from gradio_client.exceptions import AppError

    most = service.address_jobs(1)
    monkeypatch.setenv("TRIFORCE_RUN_SECONDS", "3")
    flood = [client(url, "10.0.0.1") for _ in range(most + 2)]
    long = flood[0].submit(**run_kwargs(**LONG), api_name="/triforce")
    running(long)
    admitted = [session.submit(**run_kwargs(), api_name="/triforce") for session in flood[1:most]]
    for job in admitted:
        queued(job)
    for session in flood[most:]:
        with pytest.raises(AppError) as refused:
            session.predict(**run_kwargs(**LONG), api_name="/triforce")
        assert str(refused.value).startswith(f"Too many runs from your address ({most} running or waiting; at most "
                                             f"{most} per address, so that every visitor gets a seat): the first of "
                                             "them ends within ")
        assert str(refused.value).endswith("Try again then.") and len(str(refused.value).splitlines()) == 1
    other = client(url, "10.0.0.2").submit(**run_kwargs(), api_name="/triforce")
    assert other.result(timeout=HANG_S)[0].startswith("✅ Finished")
    assert all(job.result(timeout=HANG_S)[0].startswith("✅ Finished") for job in admitted)
    assert long.result(timeout=HANG_S)[0].startswith("⏱️ Stopped at the time bound of a run (3 s")


GONE_CLIENT = """
import json, sys, time
from gradio_client import Client
job = Client(sys.argv[1], verbose=False, headers={"X-Forwarded-For": "10.0.3.1"}).submit(**json.loads(sys.argv[2]),
                                                                                        api_name="/triforce")
while not job.outputs():
    time.sleep(0.02)
print("running", flush=True)
time.sleep(600)
"""  # a visitor whose run has started, then its process is killed: its connection goes without a Stop


def test_a_visitor_whose_connection_goes_leaves_the_line_at_once(url: str, monkeypatch) -> None:
    """A job leaves the app's line when its handler ends, however it ends: a run whose client vanished (killed, no
    Stop) frees the only place long before its time bound, and another visitor is admitted."""
    import json
    import subprocess
    import sys

    from gradio_client.exceptions import AppError

    monkeypatch.setattr(service, "WAITING_JOBS", 0)  # one place in all: the run that holds it refuses every other
    monkeypatch.setenv("TRIFORCE_RUN_SECONDS", "300")
    gone = subprocess.Popen([sys.executable, "-c", GONE_CLIENT, url, json.dumps(run_kwargs(**LONG))],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert gone.stdout.readline().strip() == "running"
    finally:
        gone.kill()
        gone.wait()
    killed = time.monotonic()
    while True:
        try:
            assert client(url, "10.0.3.2").predict(**run_kwargs(), api_name="/triforce")[0].startswith("✅ Finished")
            break
        except AppError as refused:
            assert str(refused).startswith("The queue is full")
            assert time.monotonic() - killed < 200, "the vanished run held its place until its bound"
            time.sleep(0.5)
