"""What one round of decoding is: the hierarchy it runs (`Hierarchy`), what it measured (`RoundRecord`), and who
chooses the next one (`Policy`: method triforce's fixed hierarchy, or method auto's planner in core.plan)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Protocol

# How a plan's name calls each level-1 drafter (the registry's keys: core.decode.drafters.DRAFTERS)
DRAFTER_NAMES = {"model": "draft model", "ngram": "prompt lookup"}


@dataclass(frozen=True)
class Hierarchy:
    """The levels a round uses: `level1` names the drafter that drafts ("": none), `level2` (the target on the
    retrieval cache) checks level 1 and drafts for level 3; `gamma1` level-1 tokens per level-2 check, `gamma2`
    drafted tokens per level-3 check (0: autoregressive); `ahead`: level 2 drafts the next round while level 3
    verifies this one."""

    level1: str
    level2: bool
    gamma1: int = 0
    gamma2: int = 0
    ahead: bool = False

    @property
    def name(self) -> str:
        """How the app and the command line call it."""
        if not self.gamma2:
            return "autoregressive"
        by = f"{DRAFTER_NAMES.get(self.level1, self.level1)}, " if self.level1 else ""
        then = ", drafting ahead" if self.ahead else ""
        if self.level1 and self.level2:
            return f"levels 1 → 2 → 3 ({by}γ1 {self.gamma1}, γ2 {self.gamma2}{then})"
        return f"levels {1 if self.level1 else 2} → 3 ({by}γ {self.gamma2}{then})"


AUTOREGRESSIVE = Hierarchy("", False)


@dataclass
class Forwards:
    """Level-2 forwards of one kind in a round: how many, the rows each fed (its new tokens), their milliseconds."""

    count: int
    rows: int
    ms: float
    chained: bool = False  # fed one drawn token after another on the device (TriForce.draft_alone)
    beside: bool = False  # made while level 3's pass ran (drafting ahead)


@dataclass
class RoundRecord:
    """What one round did and measured, built once by the round loop and handed to the policy: the drafting (the
    level-1 tokens asked and their time, level 2's forwards, each check of level 1, what was drafted beside level 3's
    pass for the next round apart), level 3's verification (its rows, its time, and what followed its pass where
    level 2 drafted beside it), the bookkeeping around them, and what drafters asked in passing would have proposed.
    Milliseconds throughout."""

    plan: Hierarchy
    level1_asked: int = 0
    level1_ms: float = 0.0  # this round's own drafting ...
    level1_beside_ms: float = 0.0  # ... and the next round's, beside level 3's pass
    level2: list[Forwards] = field(default_factory=list)
    level1_checks: list[tuple[int, int, int, int]] = field(default_factory=list)  # (by level, asked, proposed, kept)
    drafted: int = 0  # tokens level 3 verified (level 2's guess apart)
    accepted: int = 0
    rows: int = 1  # level 3's step: the drafted tokens and the one before them
    level3_ms: float = 0.0  # its step; drafting ahead, its pass and what followed it, not the drafting beside it
    level3_wall_ms: float = 0.0  # what the round waited for level 3, drafting beside it included
    post_ms: float | None = None  # what followed level 3's pass (drafting ahead only)
    sync_ms: float = 0.0  # keeping level 2's cache in step with level 3's
    selection_ms: float = 0.0  # choosing level 2's chunks again
    reselect: bool = False
    guess: bool | None = None  # level 3 accepted the whole draft: whether it emitted level 2's guess after it
    in_passing: dict[str, tuple[list[tuple[int, int, int]], float]] = field(default_factory=dict)
    # ^ per drafter asked in passing: its checks (asked, proposed, kept) against the emitted tokens, and the time

    def took(self, draft, beside: bool = False) -> None:
        """Add what drafting `draft` (core.decode.ahead.Draft) took: this round's, or the next round's `beside`
        level 3's pass."""
        self.level1_asked += draft.asked
        if beside:
            self.level1_beside_ms += draft.level1_s * 1e3
        else:
            self.level1_ms += draft.level1_s * 1e3
        self.level2 += [replace(f, beside=beside) for f in draft.forwards]
        self.level1_checks += [(2, *check) for check in draft.checks]

    @property
    def level2_ms(self) -> float:
        """Level 2's own drafting this round."""
        return sum(f.ms for f in self.level2 if not f.beside)

    @property
    def overhead_ms(self) -> float:
        return self.sync_ms + self.selection_ms

    @property
    def ms(self) -> float:
        """The decoding time the round took (the drafting beside level 3's pass overlapped it)."""
        return self.level1_ms + self.level1_beside_ms + self.level2_ms + self.level3_ms + self.overhead_ms


class Policy(Protocol):
    """Chooses each round's hierarchy and learns from each round's record."""

    reason: str  # why the current hierarchy ("" where nothing was chosen: a fixed hierarchy)
    in_passing: bool  # whether rounds ask the drafters that need no model what they would have drafted

    def choose(self) -> Hierarchy: ...

    def observe(self, record: RoundRecord) -> None: ...


@dataclass(frozen=True)
class Ask:
    """What a batch's planner knows of one request when it chooses a round's draft lengths: whether a planner
    chooses for it (method auto) or its settings fix its γ2 (method triforce; 0: ar), its γ2 (the bound a planner
    keeps to, or the fixed one), whether its level 2 may draft (its retrieval cache leaves part of its prompt out),
    level 3's verdicts on its drafts so far, its context's tokens and retrieval budget, and whether it is greedy."""

    planned: bool
    gamma2: int
    level2: bool
    verified: int = 0
    accepted: int = 0
    tokens: int = 0
    budget: int = 0
    greedy: bool = True


@dataclass(frozen=True)
class BatchRecord:
    """What one batched round measured, handed to the batch's policy: level 3's rows and milliseconds, level 2
    drafting alone (one row per request it drafts for, chained): for how many requests, its steps and milliseconds,
    and level 3's verdict on each request's draft (drafted, accepted)."""

    rows: int
    level3_ms: float
    drafting: int = 0
    level2_steps: int = 0
    level2_ms: float = 0.0
    verdicts: tuple[tuple[int, int], ...] = ()


class BatchPolicy(Protocol):
    """Chooses each request's γ2 for a batched round and learns from each round's record."""

    reason: str

    def choose(self, asks: list[Ask]) -> list[int]: ...

    def observe(self, record: BatchRecord) -> None: ...

    def finish(self) -> None: ...
