"""Concurrent visitors in one batch (issue #50): the served app with a batch of two seats and the embedded model,
a client per visitor. Two visitors at once each get their own answer, the one each would get alone (greedy); one
visitor's Stop leaves the other's run finishing; a third visitor beyond the seats is told its place in line, then
runs; Compare says of each run whether it had the device to itself; visitors finishing together each get the
download of their own run. Alone: the queue's arithmetic with several seats, a job's clock stopped while it waits,
the raw-stats files kept, and the Compare verdict's words. Order is asserted (who waits, who
finishes), never how many seconds something took."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from app import callbacks, inference, service
from app.presets import EMBEDDED, preset_by_name
from app.service import Deadline, Line, admission
from app.state import RunState
from core import GenerationConfig
from core.events import Finished
from core.serving import BatchServer
from tests.served import served
from tests.test_app import finished_event, run_stats
from tests.test_fair import job, jobs

ROOT = Path(__file__).resolve().parent.parent
DOC = (ROOT / "assets" / "docs" / "us_declaration_of_independence.txt").read_text(encoding="utf-8")[:600]
SEATS = 2
HANG_S = 300  # only against a hang: a job that never reaches the state waited for fails the test instead
LONG = {"max_new_tokens": 4000, "greedy": False, "temperature": 2.0}  # ends at its bound or a Stop, not at EOS


# ---------------------------------------------------------------- alone: the line with several seats


def test_the_line_with_several_seats_admits_until_the_seats_and_the_waiting_are_full(monkeypatch) -> None:
    monkeypatch.setattr(service, "WAITING_JOBS", 2)
    seated = Line(running=jobs("abcd"), waiting=[], elapsed=0.0, typical=None, bound=180.0, seats=4)
    assert admission(seated, job("e")) is None  # beyond the seats: it waits in the batch's line
    assert admission(seated, job("a")).startswith("Your earlier run is still going (one run at a time per "
                                                  "visitor); it ends within 3 min of its start.")
    full = Line(running=jobs("abcdef"), waiting=[], elapsed=0.0, typical=60.0, bound=180.0, seats=4)
    assert admission(full, job("f")) == ("Your earlier run is still waiting (one run at a time per visitor): it "
                                         "starts in about 60 s, at most 3 min. Wait for it, or press Stop and run "
                                         "again.")
    assert admission(full, job("g")) == ("The queue is full (2 runs waiting for a seat in the batch): a place frees "
                                         "in about 60 s, at most 3 min. Try again then.")
    assert full.wait(4) == "about 2 min, at most 6 min"  # the fifth in line waits for the seats to turn over twice
    assert service.concurrent_jobs(8) == 8 + service.WAITING_JOBS  # every admitted job's handler runs at once
    assert service.handlers(8) > service.concurrent_jobs(8)  # and more: a job past the bounds is refused at once


def test_a_jobs_clock_stops_while_it_waits_in_line() -> None:
    deadline = Deadline(0.2)
    deadline.wait()
    time.sleep(0.3)
    assert not deadline.passed()
    deadline.go()
    time.sleep(0.25)
    assert deadline.passed()


def test_compare_says_which_run_shared_the_device_and_which_ran_alone() -> None:
    runs = {method: RunState(method=method, batched=True) for method in ("ar", "triforce", "auto")}
    for (method, state), beside in zip(runs.items(), (0, 2, 1)):
        state.final_stats = run_stats(method=method, tokens_per_s=2.0, shared_with=beside)
        state.token_ids = [1, 2]
    text, summary = callbacks.comparison_summary(runs, greedy=True)
    assert ("Autoregressive ran alone. · TriForce (levels 1 → 2 → 3) ran beside 2 other requests — its ratio is not a "
            "clean single-request figure. · Method auto (the planner picks the levels) ran beside 1 other request — "
            "its ratio is not a clean single-request figure.") in text
    assert [summary["runs"][method]["shared_with"] for method in runs] == [0, 2, 1]


def test_a_run_that_decoded_beside_another_runs_prefill_says_why_it_slowed_and_never_that_it_ran_alone() -> None:
    from app.state import apply_event
    from app.views import prefill_words, stats_for, status_markdown
    from core.batching import PACE_BESIDE_PREFILL
    from core.cli.main import _stats_line
    from core.events import PrefillBeside, Tokens

    state = RunState(method="ar", batched=True)
    apply_event(state, Tokens([1], ["A"], ["target"], 0))
    apply_event(state, PrefillBeside(6087, "cpu"))  # another visitor's long document, read between its rounds
    assert status_markdown(state).startswith("▶️ Decoding: 1 token · slower while the CPU also reads another run's "
                                             f"6,087-token prompt (about {PACE_BESIDE_PREFILL:.0%} of its pace")
    apply_event(state, PrefillBeside(0, "cpu"))  # it joined the batch
    assert status_markdown(state) == "▶️ Decoding: 1 token"
    apply_event(state, finished_event([1], method="ar", device="cpu", prefills_beside=1, prefill_beside_s=6.1))
    words = "the CPU also read 1 other run's prompt, 6.1 s of its decoding"
    assert f"| decoded beside other runs (most at once) | none; {words} |" in stats_for(state)[0]
    assert callbacks.sharing_line(state) == (f"Autoregressive {words} — its ratio is not a clean single-request "
                                             "figure")
    assert "1 other request prefilled beside it (6.1 s of its decoding)" in _stats_line(state.final_stats)
    assert prefill_words(3, 2.0, "cuda:0") == "the GPU also read 3 other runs' prompts, 2.0 s of its decoding"


def test_a_prompt_read_between_other_runs_steps_says_why_its_prefill_is_slow() -> None:
    from app.state import apply_event
    from app.views import status_markdown
    from core.batching import DEVICE_SHARE_BESIDE_DECODING
    from core.events import PrefillProgress

    state = RunState(method="triforce", batched=True)
    state.stage, state.prompt_tokens = "prefill", 6087
    apply_event(state, PrefillProgress(609, 6086, 4.7, 0, decoding_beside=1))
    assert status_markdown(state) == ("⏳ Prefill: 10% of the 6,087-token prompt (4.7 s) · slower while 1 other run "
                                      "decodes: the prompt is read between its steps, in about "
                                      f"{DEVICE_SHARE_BESIDE_DECODING:.0%} of the time")
    apply_event(state, PrefillProgress(1217, 6086, 9.0, 0, decoding_beside=2))
    assert "slower while 2 other runs decode: the prompt is read between their steps" in status_markdown(state)
    apply_event(state, PrefillProgress(1826, 6086, 9.5, 0))  # they finished: it has the device to itself
    assert status_markdown(state) == "⏳ Prefill: 30% of the 6,087-token prompt (9.5 s)"


def test_raw_stats_files_are_kept_for_every_run_that_can_finish_together_and_no_other_file_is_touched(
        tmp_path: Path, monkeypatch) -> None:
    """Each run's file has a name of its own; the newest RAW_FILES_KEPT of this process's are kept, at least as many
    as can finish at once; a file this process did not write (another process's, or one gone meanwhile) is never
    read or deleted."""
    assert callbacks.RAW_FILES_KEPT >= service.concurrent_jobs(callbacks.MAX_SLOTS)
    monkeypatch.setattr(callbacks, "RAW_DIR", tmp_path)
    monkeypatch.setattr(callbacks, "RAW_FILES_KEPT", 3)
    monkeypatch.setattr(callbacks, "_raw_files", type(callbacks._raw_files)())
    foreign = tmp_path / "raw-stats-another-process.json"
    foreign.write_text("{}")
    made = [Path(callbacks.raw_stats_file(RunState(method="ar"))) for _ in range(5)]
    assert len(set(made)) == 5 and [path.exists() for path in made] == [False, False, True, True, True]
    assert foreign.exists() and json.loads(made[-1].read_text())["answer"]["token_ids"] == []


# ---------------------------------------------------------------- the served app, a client per visitor


@pytest.fixture(scope="module")
def url():
    """The app on a free loopback port with a batch of SEATS seats, its embedded model loaded by one run."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(inference, "SEATS", SEATS)
        mp.setattr(inference, "_servers", {})  # a batch of SEATS seats, whatever an earlier test made
        with served() as address:
            client(address).predict(**run_kwargs(), api_name="/triforce")
            yield address


def run_kwargs(**overrides) -> dict:
    """/triforce arguments: the embedded model, 24 greedy tokens of TriForce."""
    return {"document": DOC, "instruction": "Who wrote this?", "preset_name": EMBEDDED, "max_new_tokens": 24,
            "budget": 64, "chunk_size": 8, "greedy": True, "method": "triforce", **overrides}


def client(url: str):
    """A new visitor: gradio_client's Client is one session."""
    from gradio_client import Client

    return Client(url, verbose=False)


def server() -> BatchServer:
    """The served app's batch (this process serves it)."""
    return inference.batch_server(preset_by_name(EMBEDDED))


def decoding(job) -> None:
    """Wait until `job`'s run decodes: a frame says so."""
    started = time.monotonic()
    while not any(str(frame[0]).startswith("▶️ Decoding") for frame in job.outputs()):
        assert not job.done() and time.monotonic() - started < HANG_S, job.status()
        time.sleep(0.02)


def answer(result: tuple) -> tuple[list[int], dict]:
    """A finished /triforce result's token ids and figures, from its full-data download."""
    data = json.loads(Path(result[-1]).read_text())
    return data["answer"]["token_ids"], data["stats"]


def alone(engine, instruction: str, settings: dict) -> list[int]:
    """The tokens a run alone gives (engine.generate, the batch idle), with the settings the batched run used."""
    config = GenerationConfig(**settings)
    return next(e for e in engine.generate(DOC, instruction, config) if isinstance(e, Finished)).token_ids


def idle(within: float = 30.0) -> bool:
    """Whether the batch decodes no request within `within` seconds."""
    batch = server()
    ends = time.monotonic() + within
    while batch.decoding() and time.monotonic() < ends:
        time.sleep(0.05)
    return not batch.decoding()


def test_two_visitors_at_once_each_get_their_own_answer(url: str, embedded) -> None:
    first, second = client(url), client(url)
    questions = ("Who wrote this?", "What does it declare?")
    jobs = [visitor.submit(**run_kwargs(instruction=q), api_name="/triforce") for visitor, q in
            zip((first, second), questions)]
    results = [job.result(timeout=HANG_S) for job in jobs]
    assert all(result[0].startswith("✅ Finished") for result in results)
    answers = [answer(result) for result in results]
    assert max(stats["shared_with"] for _, stats in answers) == 1  # they decoded in one batch
    assert idle()
    for (tokens, stats), question in zip(answers, questions):
        assert tokens == alone(embedded, question, stats["settings"])  # greedy: the answer it gets alone


def test_one_visitors_stop_leaves_the_others_run_finishing(url: str, embedded, monkeypatch) -> None:
    monkeypatch.setenv("TRIFORCE_RUN_SECONDS", "120")  # a run not stopped would hold the batch for minutes
    stopper, other = client(url), client(url)
    long = stopper.submit(**run_kwargs(**LONG), api_name="/triforce")
    decoding(long)
    mine = other.submit(**run_kwargs(max_new_tokens=48), api_name="/triforce")
    decoding(mine)
    long.cancel()  # the Stop button's request
    result = mine.result(timeout=HANG_S)
    assert result[0].startswith("✅ Finished")
    tokens, stats = answer(result)
    assert stats["shared_with"] == 1 and idle()  # it decoded beside the stopped run, which left the batch
    assert tokens == alone(embedded, "Who wrote this?", stats["settings"])


def test_a_visitor_beyond_the_seats_sees_its_place_in_line_then_runs(url: str, monkeypatch) -> None:
    from tests.test_fair import logs

    # the holders' bound: long enough that each is seen decoding on a loaded machine (a 4 s bound once ran out in
    # the prefill), short enough that the one beyond them is served soon after
    monkeypatch.setenv("TRIFORCE_RUN_SECONDS", "20")
    holders = [client(url).submit(**run_kwargs(**LONG), api_name="/triforce") for _ in range(SEATS)]
    for holder in holders:
        decoding(holder)
    third = client(url).submit(**run_kwargs(max_new_tokens=8), api_name="/triforce")
    statuses = [str(frame[0]) for frame in third]
    assert any(status.startswith(f"⏳ Waiting: 1st in line for the batch (up to {SEATS} runs decode at once")
               for status in statuses), statuses
    assert third.outputs()[-1][0].startswith("✅ Finished")
    seen = logs(third)
    assert any(line.startswith(f"{SEATS} runs ahead of yours ({SEATS} decode at once): it starts in ")
               for line in seen), seen
    assert all(job.result(timeout=HANG_S)[0].startswith("⏱️ Stopped at the time bound") for job in holders)


def test_compare_says_each_run_decoded_beside_another_visitors(url: str, monkeypatch) -> None:
    from tests.test_app import compare_frame

    monkeypatch.setenv("TRIFORCE_RUN_SECONDS", "120")
    busy = client(url).submit(**run_kwargs(**LONG), api_name="/triforce")
    decoding(busy)
    job = client(url).submit(**{k: v for k, v in run_kwargs(max_new_tokens=8).items() if k != "method"},
                             api_name="/compare")
    out = compare_frame(job.result(timeout=HANG_S))
    busy.cancel()
    verdict, runs = out["verdict"], out["compare_json"]["runs"]
    assert [runs[method]["shared_with"] for method in ("ar", "triforce", "auto")] == [1, 1, 1], runs
    assert "Autoregressive ran beside 1 other request — its ratio is not a clean single-request figure" in verdict
    assert out["compare_json"]["identical"] == {"triforce": True, "auto": True}  # greedy, beside another run
    assert idle()


def test_every_visitor_finishing_together_gets_the_download_of_its_own_run(url: str) -> None:
    """More visitors than seats at once, each run a different length: every finished run links a readable file
    holding its own run's data."""
    lengths = range(4, 4 + 2 * SEATS)
    jobs = [client(url).submit(**run_kwargs(max_new_tokens=n), api_name="/triforce") for n in lengths]
    results = [job.result(timeout=HANG_S) for job in jobs]
    assert all(result[0].startswith("✅ Finished") for result in results)
    assert [answer(result)[1]["settings"]["max_new_tokens"] for result in results] == list(lengths)
