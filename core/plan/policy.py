"""Who chooses each round's hierarchy: method triforce's fixed one (`Fixed`), or method auto's planner (`Auto`),
which measures what it does not know, weighs every candidate with the cost model and switches only for a clear
gain; in a batch, `BatchAuto` by the same rules. All learn every round's costs and acceptances into Estimates, which
the engine's CostBook keeps for the next run. The numbers in parentheses cite docs/method-auto.md, where each
constant has its reason."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Sequence

from core.decode.round import AUTOREGRESSIVE, Ask, BatchRecord, Hierarchy, RoundRecord
from core.model.parallel import agree
from core.plan.cost import GAMMAS, Figures, batch_rate, best, candidates, rate
from core.plan.estimate import CostBook, Estimate, Estimates, Regime

SWITCH_GAIN = 1.10  # another plan must be expected this much faster to replace the current one (1)
MIN_ROUNDS = 4  # rounds a plan runs before it is weighed again (2) ...
WEIGH_EVERY_MS = 20.0  # ... and decoding time between two weighings, doubled each time the plan is kept (3) ...
WEIGH_MOST_MS = 160.0  # ... up to this (3)
SETTLE_MS = 200.0  # ... or this much decoding, where rounds are slow (4)
CHAIN_WORTH = 0.5  # drafting alone is measured only where a level-2 step costs under this share of a full one (6)
MAX_SWITCHES = 6  # switches per run once the costs are measured; after that only back to autoregressive (7)
CAUTION = 1.0  # plans are weighed at acceptances this many standard deviations below what was seen (9)


def level2_words(step_ms: float, full_ms: float, of: str = "", beside: str = "") -> str:
    """A level-2 step against a full one, in words: its share, or, where it saves nothing, both in milliseconds (a
    share above 100 % reads as nonsense). `of`: what the step feeds; `beside`: a note on the share."""
    if step_ms >= full_ms:
        return (f"level 2 saves nothing here: a step{of} took {step_ms:.3g} ms against {full_ms:.3g} ms for a full "
                "one (it reads the same weights; the cache it skips saved less than these measurements vary)")
    return f"a level-2 step{of} costs {step_ms / full_ms:.0%} of a full one{beside}"


@dataclass
class Fixed:
    """Method triforce: every round the same hierarchy (1 → 2 → 3, or 2 → 3 with drafter none); it only records what
    the levels cost and accepted (a next auto run starts from them)."""

    plan: Hierarchy
    estimates: Estimates
    reason: str = ""
    in_passing: bool = False

    def choose(self) -> Hierarchy:
        return self.plan

    def observe(self, record: RoundRecord) -> None:
        self.estimates.observe(record)


@dataclass
class Auto:
    """Method auto's planner. While a cost it needs is unknown it measures: a round of the fullest hierarchy
    drafting one token, then, where level 2's forwards chain when it drafts alone (`chained`) and a level-2 step is
    cheap enough for that to pay, a round of level 2 drafting alone, then an autoregressive step (unless the full
    cache is `streamed` from host memory: a step then costs what its copies do however few rows it verifies, so the
    verification measured stands for it). Then, once a plan has run MIN_ROUNDS rounds (or SETTLE_MS of decoding) and
    weigh_every_ms have passed since it was last weighed, it weighs every candidate again and switches when another
    is expected SWITCH_GAIN times faster, at most MAX_SWITCHES times. A drafting plan is taken only when expected
    SWITCH_GAIN times faster than autoregressive decoding. `drafters`: the level-1 drafters there, the first measured
    first (the others in passing); `level2`: level 2's cache leaves part of the prompt out (else it reads what level
    3 reads, for nothing); `ahead`: level 2 can draft the next round while level 3 verifies."""

    estimates: Estimates
    drafters: Sequence[str]
    gamma1_max: int
    gamma2_max: int
    streamed: bool = False
    level2: bool = True
    ahead: bool = False
    chained: bool = False
    caution: float = CAUTION
    in_passing: bool = True
    current: Hierarchy | None = None
    reason: str = ""  # why the current plan was chosen
    rounds: int = 0  # of the current plan
    switches: int = 0
    since_weighed_ms: float = 0.0
    weigh_every_ms: float = WEIGH_EVERY_MS
    expected: float | None = None  # the current plan's expected rate when it was last weighed
    options: list[Hierarchy] = field(init=False)

    def __post_init__(self):
        self.options = candidates(self.drafters, self.gamma1_max, self.gamma2_max, self.level2, self.ahead)
        for name in self.drafters:
            self.estimates.drafter(name)

    def choose(self) -> Hierarchy:
        """The next round's hierarchy; under tensor parallelism every rank takes rank 0's (timings differ)."""
        h = self._choose()
        names = ["", *self.drafters]
        mine = (names.index(h.level1), h.level2, h.gamma1, h.gamma2, h.ahead)
        if (agreed := agree(*mine)) != mine:
            h = Hierarchy(names[agreed[0]], bool(agreed[1]), agreed[2], agreed[3], bool(agreed[4]))
        return h

    def observe(self, record: RoundRecord) -> None:
        self.rounds += 1
        self.since_weighed_ms += record.ms
        self.estimates.observe(record)

    def figures(self, caution: float | None = None) -> Figures:
        return self.estimates.figures(self.caution if caution is None else caution)

    def _choose(self) -> Hierarchy:
        if self.current is not None and not self.measuring and not self._due():
            return self.current  # most rounds: nothing to decide
        if self.options == [AUTOREGRESSIVE]:
            return self._set(AUTOREGRESSIVE, "no level can draft: the retrieval budget covers the whole prompt "
                                             "(level 2 would read what level 3 reads) and no level-1 drafter is there")
        if (unknown := self._unmeasured()) is not None:
            return self._set(*unknown)
        fresh = self.current is None or self.measuring
        self.since_weighed_ms = 0.0
        f = self.figures()
        h, r = best(self.options, f)
        ar = rate(AUTOREGRESSIVE, f) or 0.0
        # a drafting plan must clearly beat AR to be taken; out of switches, only a way back to AR is left
        if (h.gamma2 and r < SWITCH_GAIN * ar) or (not fresh and self.switches >= MAX_SWITCHES):
            h, r = AUTOREGRESSIVE, ar
        now = rate(self.current, f) if self.current else None
        # another plan must be clearly faster to replace the current one, unless the current one is now expected
        # slower than autoregressive decoding (which the planner never knowingly stays with)
        if fresh or now is None or (h != self.current and (r > SWITCH_GAIN * now or now < ar)):
            self.weigh_every_ms, self.expected = WEIGH_EVERY_MS, r
            return self._set(h, self.explain(h))
        # kept: weighed again later while it stays the best, soon while another comes close
        self.weigh_every_ms = min(2 * self.weigh_every_ms, WEIGH_MOST_MS) if h == self.current else WEIGH_EVERY_MS
        self.expected = now
        return self.current

    @property
    def measuring(self) -> bool:
        return self.reason.startswith("measuring")

    def _unmeasured(self) -> tuple[Hierarchy, str] | None:
        """The measuring round due, and why; None once every cost the plans need is known. The first drafts one
        token through every level (each token more would be drafted at costs not yet known)."""
        e, first = self.estimates, self.drafters[0] if self.drafters else ""
        level3 = e.line("level3")
        if (self.level2 and e.line("level2" if first else "chained") is None) or \
                (first and e.drafter(first).ms is None) or level3 is None or level3.largest < 2:
            return Hierarchy(first, self.level2, self.gamma1_max if first and self.level2 else 0, 1,
                             self.ahead and self.level2), "measuring what each level costs"
        # Level 2 drafting alone chains its forwards on the device: it is measured by the best plan that drafts alone,
        # its forwards priced as looped ones until then (a bound), so the measuring round pays as a plan does. Where
        # a level-2 step costs about a full one, no saving from chaining makes drafting alone pay.
        if self.chained and first and self.level2 and not e.curves["chained"].measured and \
                e.line("level2")(1) < CHAIN_WORTH * level3(1):
            alone, _ = best([h for h in self.options if h.level2 and not h.level1], self.figures())
            return alone, "measuring level 2 drafting alone"
        if level3.one_row_saving is None and not self.streamed:
            return AUTOREGRESSIVE, "measuring an autoregressive step"
        return None

    def _due(self) -> bool:
        """Whether the current plan has run long enough to be weighed again: after weigh_every_ms of decoding, or as
        soon as MIN_ROUNDS rounds show it falling short of what it was chosen for."""
        spare = self.switches < MAX_SWITCHES
        if self.rounds >= MIN_ROUNDS and self.current.gamma2 and self.expected:
            f = self.figures()
            now, ar = rate(self.current, f) or 0.0, rate(AUTOREGRESSIVE, f) or 0.0
            if now < ar or (spare and SWITCH_GAIN * now < self.expected):
                return True
        settled = self.rounds >= MIN_ROUNDS or self.since_weighed_ms >= SETTLE_MS
        return spare and settled and self.since_weighed_ms >= self.weigh_every_ms

    def explain(self, h: Hierarchy) -> str:
        """One line on why `h` was chosen: its expected speed over autoregressive decoding (at the acceptances seen;
        the choice weighed them with caution) and the costs behind it, each step against a full one of as many
        rows."""
        f = self.figures(0.0)
        ar, r = rate(AUTOREGRESSIVE, f), rate(h, f)
        parts = [f"expected {r / ar:.2f}× autoregressive" if ar and r else ""]
        d = f.drafters.get(h.level1 or (self.drafters[0] if self.drafters else ""))
        rows = 1 + (h.gamma1 if h.level1 and h.level2 else 0)
        step, beside = f.level2_step(rows, alone=not h.level1)
        if step is not None and f.level3 is not None:
            full = f.level3(rows)
            more = f" ({beside(rows) / full:.0%} beside level 3's pass)" if h.ahead else ""
            parts.append(level2_words(step(rows), full, f" of {rows} row{'s' if rows > 1 else ''}", more))
        if d is not None and d.ms is not None and f.level3 is not None:
            parts.append(f"a level-1 token {d.ms / f.level3(1):.0%} of a full step")
        if h.level1 and not h.level2:
            parts.append(f"acceptance of level 1 at level 3 {d.a13:.2f}")
        elif h.gamma2:
            parts.append((f"acceptance L1 {d.a1:.2f}, " if h.level1 else "") + f"L2 {f.a2:.2f}")
        return "; ".join(p for p in parts if p)

    def _set(self, h: Hierarchy, reason: str) -> Hierarchy:
        if h != self.current:
            if self.current is not None and not self.measuring:
                self.switches += 1
            self.current, self.rounds = h, 0
        self.reason = reason
        return h


@dataclass
class BatchAuto:
    """Method auto for a batch (docs/method-auto.md, "A batch"): each round one γ2 for the requests it plans (each kept
    within its own γ2 bound; a request whose level 2 would read its whole prompt never drafts), beside requests whose
    settings fix theirs, priced by cost.batch_rate from the batch's own step costs: level 3 by the rows it verifies,
    level 2 drafting alone by the requests it drafts for. By Auto's rules: it measures what neither this batch nor
    the cost book knows (a round drafting one token, then an autoregressive step), weighs acceptances CAUTION
    standard deviations low, takes a drafting plan only when SWITCH_GAIN times faster than autoregressive decoding,
    replaces the current γ only for SWITCH_GAIN more, weighs again after MIN_ROUNDS rounds and switches at most
    MAX_SWITCHES times. Its estimates live in `book` under the batched regime of the batch's context (one length
    bucket of all its requests' tokens): every batch, of fixed γs too, teaches the next."""

    book: CostBook
    caution: float = CAUTION
    gamma: int = 0
    reason: str = ""
    rounds: int = 0  # since the γ was last weighed
    switches: int = 0
    measuring: bool = False
    key: tuple[Regime, int] | None = None  # the regime and budget of the estimates held
    estimates: Estimates | None = None
    prior: Estimate | None = None  # level 2's acceptance the regime started from (a request's own verdicts join it)

    def choose(self, asks: list[Ask]) -> list[int]:
        """Each request's γ2 this round (0: an autoregressive step)."""
        drafting = [a for a in asks if a.level2]
        key = (Regime.of(False, sum(a.tokens for a in asks), all(a.greedy for a in asks), batched=True),
               max((a.budget for a in drafting), default=0))
        if key != self.key:
            self.finish()
            self.key, self.estimates = key, self.book.estimates(*key)
            self.prior = copy.copy(self.estimates.a2)
        if any(a.planned and a.level2 and a.gamma2 for a in asks):
            self.gamma = agree(self._choose(asks))[0]
        elif any(a.planned for a in asks):
            self.gamma, self.reason = 0, ("nothing to draft: the retrieval budget covers the whole prompt (level 2 "
                                          "would read what level 3 reads)")
        return self.each(asks, self.gamma)

    def observe(self, record: BatchRecord) -> None:
        self.rounds += 1
        e = self.estimates
        e.curves["level3"].add(record.rows, record.level3_ms)
        if record.level2_steps:
            e.curves["chained"].add(record.drafting, record.level2_ms / record.level2_steps)
        for drafted, accepted in record.verdicts:  # the next batch's prior (a request's own verdicts: its Ask)
            e.a2.add(drafted, accepted)

    def finish(self) -> None:
        """The batch emptied or changed its regime: what it measured goes into the cost book."""
        if self.estimates is not None:
            self.book.learn(*self.key, self.estimates)

    @staticmethod
    def each(asks: list[Ask], gamma: int) -> list[int]:
        """Each request's γ2 with the planned ones at `gamma`: within its own bound, none where its level 2 would read
        its whole prompt; the others keep their settings'."""
        return [(min(gamma, a.gamma2) if a.level2 else 0) if a.planned else a.gamma2 for a in asks]

    def alpha(self, a: Ask) -> float:
        """A request's acceptance as weighed: the batch regime's prior joined by its own verdicts, CAUTION low."""
        return Estimate(self.prior.verified + a.verified, self.prior.accepted + a.accepted).lower(self.caution)

    def rates(self, asks: list[Ask], gammas: list[int]) -> dict[int, float]:
        """Tokens per millisecond of the batch with its planned requests at each γ of `gammas` (those priced)."""
        e = self.estimates
        level3, level2 = e.line("level3"), e.line("chained")
        alphas = [self.alpha(a) for a in asks]
        out = {}
        for g in gammas:
            if (r := batch_rate(self.each(asks, g), alphas, level3, level2)) is not None:
                out[g] = r
        return out

    def _choose(self, asks: list[Ask]) -> int:
        e = self.estimates
        level3, level2 = e.line("level3"), e.line("chained")
        if level3 is None or level2 is None:
            return self._set(1, "measuring what each level of the batch costs")
        plain = sum(1 if a.planned else a.gamma2 + 1 for a in asks)  # level 3's rows with the planned ones plain
        if plain not in e.curves["level3"].samples and not level3.spans_rows:
            return self._set(0, "measuring an autoregressive step of the batch")
        fresh = self.measuring or not self.reason
        if not fresh and self.rounds < MIN_ROUNDS:
            return self.gamma
        most = max(a.gamma2 for a in asks if a.planned and a.level2)
        rates = self.rates(asks, [0, *(g for g in GAMMAS if g < most), most])
        if 0 not in rates:  # the line from the sizes measured prices the plain step at nothing: measure it
            return self._set(0, "measuring an autoregressive step of the batch")
        ar = rates[0]
        pick = max(rates, key=rates.get)
        if (pick and rates[pick] < SWITCH_GAIN * ar) or (not fresh and self.switches >= MAX_SWITCHES):
            pick = 0
        now = rates.get(self.gamma)
        self.rounds = 0
        if fresh or now is None or (pick != self.gamma and (rates[pick] > SWITCH_GAIN * now or now < ar)):
            return self._set(pick, self.explain(asks, pick, rates))
        return self.gamma

    def explain(self, asks: list[Ask], gamma: int, rates: dict[int, float]) -> str:
        """One line on why `gamma`: its expected speed over autoregressive decoding, what a level-2 step costs
        against a full step of as many requests, and the acceptance weighed."""
        e, n = self.estimates, len(asks)
        whom = "this request" if n == 1 else f"these {n} requests"
        level3, level2 = e.line("level3"), e.line("chained")
        drafting = sum(1 for a in asks if a.level2 and (a.gamma2 if not a.planned else max(gamma, 1)))
        step = level2_words(level2(drafting), level3(n)) if drafting else ""
        alpha = sum(self.alpha(a) for a in asks) / n
        best_drafting = max((g for g in rates if g), key=rates.get, default=None)
        if gamma:
            lead = f"expected {rates[gamma] / rates[0]:.2f}× autoregressive for {whom}"
        elif best_drafting is not None:
            lead = f"drafting would not pay for {whom}: the best draft length, γ2 {best_drafting}, is expected at " \
                   f"{rates[best_drafting] / rates[0]:.2f}× autoregressive"
        else:
            lead = f"nothing to draft for {whom}"
        return "; ".join(p for p in (lead, step, f"acceptance L2 {alpha:.2f}") if p)

    def _set(self, gamma: int, reason: str) -> int:
        measuring = reason.startswith("measuring")
        if gamma != self.gamma and not self.measuring and not measuring and self.reason:
            self.switches += 1
        self.gamma, self.reason, self.measuring, self.rounds = gamma, reason, measuring, 0
        return gamma
