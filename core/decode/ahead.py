"""Drafting ahead: while level 3 verifies a round's draft, level 2 guesses the token level 3 will emit after it and
drafts the next round after that guess, on another stream of the GPU. A pass over a full cache streamed from CPU
memory mostly waits on its copies, so the next round's drafting comes nearly free where it stands."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from core.decode.round import Forwards, Hierarchy
from core.events import Event, Provenance
from core.model import parallel


@dataclass
class Draft:
    """What level 2 (or level 1 directly) hands level 3 in one round: its tokens, their distributions q and
    provenance, and what drafting them took: level 1's time and the tokens asked of it, level 2's forwards, each
    check of level 1 (asked, proposed, accepted) and level 2's hidden state that produced the last token."""

    tokens: list[int] = field(default_factory=list)
    q: list[torch.Tensor] = field(default_factory=list)
    provenance: list[Provenance] = field(default_factory=list)
    level1_s: float = 0.0
    asked: int = 0
    forwards: list[Forwards] = field(default_factory=list)
    checks: list[tuple[int, int, int]] = field(default_factory=list)
    feature: torch.Tensor | None = None

    @property
    def level2_s(self) -> float:
        return sum(f.ms for f in self.forwards) / 1e3

    @property
    def level2_forwards(self) -> int:
        return sum(f.count for f in self.forwards)


@dataclass
class Ahead:
    """Level 2's draft of the next round, made while level 3 verified this one, after level 2's `guess` at the token
    level 3 would emit next (drawn from `q` and checked like one more draft); its events held back until a round
    uses it; `spent`: the drafting it took, the guess's included (no tokens)."""

    plan: Hierarchy
    guess: int
    q: torch.Tensor
    draft: Draft
    events: list[Event]
    spent: Draft


def drafts_ahead(setting: str, streamed: bool, device: torch.device) -> bool:
    """Whether level 2 drafts ahead under `setting` (GenerationConfig.draft_ahead): auto where level 3's pass waits
    on copies from CPU memory to a GPU, and not under tensor parallelism, whose ranks must run their collectives in
    one order."""
    return setting == "on" or (setting == "auto" and streamed and device.type == "cuda" and parallel.ACTIVE is None)


class Overlap:
    """Level 3 on a stream of its own, so that level 2 drafts ahead meanwhile: a GPU runs both at once. Elsewhere the
    two run one after the other."""

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        if self.stream is not None:
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self.host_ms = 0.0

    @contextlib.contextmanager
    def level3(self) -> Iterator[None]:
        """Queue level 3's work on its stream (after everything queued before it)."""
        t0 = time.perf_counter()
        if self.stream is None:
            yield
        else:
            self.stream.wait_stream(torch.cuda.current_stream())
            self.start.record(self.stream)
            with torch.cuda.stream(self.stream):
                yield
            self.end.record(self.stream)
        self.host_ms = (time.perf_counter() - t0) * 1e3

    def join(self, *tensors: torch.Tensor) -> None:
        """Make the current stream wait for level 3 before it reads `tensors`, which level 3 computed."""
        if self.stream is not None:
            current = torch.cuda.current_stream()
            current.wait_stream(self.stream)
            for t in tensors:
                t.record_stream(current)

    def level3_ms(self) -> float:
        """What level 3's pass took, once done (the host waits for it): on a GPU its stream's time, else the host's."""
        if self.stream is None:
            return self.host_ms
        self.end.synchronize()
        return self.start.elapsed_time(self.end)
