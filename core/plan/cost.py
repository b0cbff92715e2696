"""The cost model of method auto: how many tokens a plan is expected to emit per millisecond, from what its steps
cost and how often each level's drafts are accepted. Pure arithmetic: core.plan.estimate supplies the figures and
core.plan.policy acts on the result.

A verification of γ drafts, each accepted with probability α, emits 1 + α + ... + α^γ tokens (the accepted ones and
one correction or bonus; Leviathan et al., 2023). A round costs its drafting and its verification; divided, that is
a plan's speed. Every plan verifies exactly as the others do, so a plan changes the speed, never the output.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Sequence

from core.decode.round import AUTOREGRESSIVE, Hierarchy

# The draft lengths weighed: every length up to the longest would triple the weighing's Python for little gain
# (docs/method-auto.md, 5).
GAMMAS = (1, 2, 3, 4, 6, 8, 10, 12, 15, 20, 25, 31)


@dataclass(frozen=True)
class Line:
    """What one kind of step costs by the rows it feeds (its new tokens): `fixed` + `per_row` × rows, less
    `one_row_saving` for a step of one row (a decode step of one row takes its own, cheaper path through the kernels;
    None: no one-row step measured). `spans_rows`: the slope was measured over several sizes (else it is a guess);
    `largest`: the most rows measured behind it; `evidence`: the weight of the pairs of sizes behind the slope (what
    a line fitted over this one as its prior counts it for; core.plan.estimate.fit)."""

    fixed: float
    per_row: float = 0.0
    one_row_saving: float | None = None
    spans_rows: bool = False
    largest: int = 1
    evidence: float = 0.0

    def __call__(self, rows: float) -> float:
        saving = self.one_row_saving if rows == 1 and self.one_row_saving is not None else 0.0
        return self.fixed + self.per_row * rows - saving


@dataclass(frozen=True)
class Drafter:
    """One level-1 drafter's figures: milliseconds per token asked of it (None: unmeasured), the acceptance of its
    tokens at level 2 (`a1`) and at level 3 directly (`a13`), and the share of tokens asked that it proposes
    (`offered`: prompt lookup proposes nothing without a match)."""

    ms: float | None
    a1: float
    a13: float
    offered: float


@dataclass(frozen=True)
class Figures:
    """Everything the cost model prices a plan with: step costs (milliseconds) and acceptance probabilities.
    `level3`: a level-3 step by rows; `level2`: a level-2 forward checking level 1 (rows: the proposals + 1),
    `chained`: one drafting alone, chained on the device (TriForce.draft_alone), each also `_beside` level 3's pass
    (drafting ahead: the two share the device); `overhead`: a round's bookkeeping where level 2 drafts; `post`: what
    follows level 3's pass (its head, distributions and verification), which drafting ahead cannot hide; `a2`:
    level 3's acceptance of level 2's tokens; `guess`: how often level 3, having accepted a whole draft, accepts
    the token level 2 guessed would follow it."""

    level3: Line | None
    level2: Line | None = None
    chained: Line | None = None
    level2_beside: Line | None = None
    chained_beside: Line | None = None
    overhead: float = 0.0
    post: float = 0.0
    drafters: dict[str, Drafter] = field(default_factory=dict)
    a2: float = 0.9
    guess: float = 0.9

    def level2_step(self, rows: float, alone: bool) -> tuple[Line | None, Line | None]:
        """The lines of a level-2 forward by itself and beside level 3's pass: chained when it drafts alone and
        chains, else checking level 1."""
        own, beside = (self.chained, self.chained_beside) if alone else (self.level2, self.level2_beside)
        return own, beside or own


def expected_tokens(alpha: float, gamma: float) -> float:
    """Tokens a verification of `gamma` drafts emits on average: the accepted ones and one correction or bonus."""
    return gamma + 1.0 if alpha >= 1.0 else (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def rate(h: Hierarchy, f: Figures) -> float | None:
    """Expected tokens per millisecond of `h` (None while a cost it needs is unknown)."""
    d = f.drafters.get(h.level1)
    if f.level3 is None or (h.level1 and (d is None or d.ms is None)):
        return None
    verify = f.level3(h.gamma2 + 1)
    if not h.gamma2:
        return 1.0 / verify if verify > 0 else None
    if not h.level2:  # level 1 drafts for level 3 directly: classic two-model speculative decoding
        return expected_tokens(d.a13, d.offered * h.gamma2) / (h.gamma2 * d.ms + verify)
    # level 2 makes γ2 tokens, each forward checking γ1 level-1 tokens when level 1 drafts (a forward then feeds its
    # proposals and the token before them)
    rows = 1 + (d.offered * h.gamma1 if d else 0)
    own, beside = f.level2_step(rows, alone=d is None)
    if own is None:
        return None
    per_forward = expected_tokens(d.a1, d.offered * h.gamma1) if d else 1.0
    level1 = h.gamma1 * d.ms if d else 0.0  # level 1's drafting for one level-2 forward
    forward = own(rows) + level1
    drafting = h.gamma2 * forward / per_forward
    tokens = expected_tokens(f.a2, h.gamma2)
    if not h.ahead:
        return tokens / (drafting + verify + f.overhead)
    # While level 3 verifies, level 2 guesses the token level 3 will emit after the draft (one forward) and drafts
    # the next round after it, at its speed beside level 3's pass: that draft stands when level 3 accepts every
    # draft and the guess, so a round drafts for itself only otherwise. Level 3's head, distributions and
    # verification wait for both the pass and the drafting.
    ahead = beside(rows) + drafting * (beside(rows) + level1) / forward
    kept = f.a2 ** h.gamma2 * f.guess
    return tokens / ((1.0 - kept) * drafting + max(verify, ahead + f.post) + f.overhead)


def candidates(drafters: Sequence[str], gamma1_max: int, gamma2_max: int, level2: bool = True, ahead: bool = False
               ) -> list[Hierarchy]:
    """The hierarchies and γs a run weighs: level 1 by each of its drafters, level 2 only where its cache leaves part
    of the prompt out, each level-2 plan also drafting ahead where level 2 can (`ahead`)."""
    gammas = [g for g in GAMMAS if g < gamma2_max] + [gamma2_max]
    out = [AUTOREGRESSIVE]
    if level2:
        out += [Hierarchy("", True, 0, g) for g in gammas]
    for name in drafters:
        out += [Hierarchy(name, False, 0, g) for g in gammas]
        if level2:
            out += [Hierarchy(name, True, g1, g2) for g1 in range(1, gamma1_max + 1) for g2 in gammas]
    return out + ([replace(h, ahead=True) for h in out if h.level2] if ahead else [])


def best(options: Sequence[Hierarchy], f: Figures) -> tuple[Hierarchy, float] | None:
    """The option with the highest expected rate, and that rate (None while no option's rate is known)."""
    rated = [(r, h) for h in options if (r := rate(h, f)) is not None]
    return max(rated, key=lambda x: x[0])[::-1] if rated else None


def batch_rate(gammas: Sequence[int], alphas: Sequence[float], level3: Line, level2: Line | None) -> float | None:
    """Expected tokens per millisecond of a batched round that drafts gammas[i] tokens for request i (0: its
    autoregressive step), each accepted with probability alphas[i]: level 2 steps max γ_i times, each step one row
    for every request still drafting; level 3 verifies Σ (γ_i + 1) rows in one step; request i emits E(α_i, γ_i).
    A batch's steps read the weights once for all its requests, so level 2 may cost a fraction of level 3 where the
    requests' full caches outweigh the weights, even for a small model. None while a cost it needs is unknown."""
    if any(gammas) and level2 is None:
        return None
    ms = level3(sum(g + 1 for g in gammas)) + \
        sum(level2(sum(g > j for g in gammas)) for j in range(max(gammas, default=0)))
    return sum(expected_tokens(a, g) for a, g in zip(alphas, gammas)) / ms if ms > 0 else None
