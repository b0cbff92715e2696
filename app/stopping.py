"""Stop that always says so. Gradio's `cancels` is sent by the page without waiting for it, so a Stop handler that
writes its status at once can reach the page before the cancelled run's last frame, which then overwrites it (the
status frozen on "Decoding: 18 tokens", the stats "live"). Here each visitor's run of a tab is registered while it
streams: Stop raises the run's flag, the run sends no frame after it, and Stop writes its status only once the run
has ended, so that its words are the last to arrive."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

# Stop waits at most this long for the run to end: its next frame is at most a Waiting (0.25 s) away, and a frame
# that comes later (one being drawn on a busy CPU) is dropped by the run's own flag, so Stop still says so in time.
STOP_WAIT_S = 0.5


@dataclass
class Run:
    """One visitor's streaming run on one tab: Stop's flag, its end, and the last frame it sent by output name."""

    stop: threading.Event = field(default_factory=threading.Event)
    ended: threading.Event = field(default_factory=threading.Event)
    sent: dict[str, Any] = field(default_factory=dict)


_runs: dict[tuple[str, str], Run] = {}  # the run of each (visitor's session, tab) now streaming
_lock = threading.Lock()


def started(session: str, tab: str) -> Run:
    """Register a new run of `session` on `tab` (a later run of the same tab replaces an earlier one)."""
    run = Run()
    with _lock:
        _runs[(session, tab)] = run
    return run


def ended(session: str, tab: str, run: Run) -> None:
    """Mark `run` ended and forget it, unless a later run of the tab has replaced it."""
    run.ended.set()
    with _lock:
        if _runs.get((session, tab)) is run:
            del _runs[(session, tab)]


def stop(session: str, tab: str, wait_s: float = STOP_WAIT_S) -> Run | None:
    """Stop the run of `session` on `tab` and wait (at most `wait_s`) until it has sent its last frame; the run, or
    None where none was streaming (one still in Gradio's line is removed by the event's `cancels`)."""
    with _lock:
        run = _runs.get((session, tab))
    if run is not None:
        run.stop.set()
        run.ended.wait(wait_s)
    return run
