"""What method auto knows: what each kind of step costs (one fitted line per level and kind of step) and how often
each level's drafts are accepted (a Beta estimate per level and drafter), learnt from the rounds' records, and
carried from one run to the next by the engine's CostBook. The numbers in parentheses cite docs/method-auto.md."""

from __future__ import annotations

import copy
import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from itertools import combinations
from typing import Iterable, NamedTuple, TypeVar

from core.config import DECODE_TOKENS
from core.decode.round import Forwards, RoundRecord
from core.events import verified
from core.plan.cost import Drafter, Figures, Line

T = TypeVar("T")

RECENT = 9  # samples behind each measured figure (10)
PRIOR_WEIGHT = 4.0  # pseudo-observations behind a default acceptance, or one borrowed from another kind of run (8)
CARRIED_WEIGHT = 16.0  # the most observations a run carries of an acceptance to the next run of its kind (8)
# A prior line with no record of the pairs behind it counts its slope as one pair of single samples spanning a
# decode step (2 and DECODE_TOKENS rows); a fitted one counts as the pairs it was fitted from (its evidence) (11).
SLOPE_PRIOR = float((DECODE_TOKENS - 2) ** 2)
LEVEL2_PRIOR = 0.9  # level 3's acceptance of level 2's tokens before any is measured (13)
FIRST_SAMPLE = 0.01  # a step size's first sample, against a repeated one: a first use may pay one-time work (12)


@dataclass
class Estimate:
    """Drafts verified and accepted at one level. A draft after a rejection is never verified, so accepted /
    verified estimates the per-token acceptance probability α (accepted / proposed would underrate long drafts)."""

    verified: float = PRIOR_WEIGHT
    accepted: float = PRIOR_WEIGHT / 2

    @property
    def rate(self) -> float:
        return self.accepted / self.verified

    def lower(self, caution: float) -> float:
        """The rate less `caution` standard deviations of a Beta posterior over the observations behind it: the same
        rate seen over few drafts counts for less than over many."""
        p = self.rate
        return max(0.0, p - caution * math.sqrt(p * (1.0 - p) / (self.verified + 1.0)))

    def add(self, proposed: int, accepted: int) -> None:
        self.verified += verified(proposed, accepted)
        self.accepted += accepted


def prior(alpha: float) -> Estimate:
    """An acceptance before any verification: α worth PRIOR_WEIGHT observations."""
    return Estimate(PRIOR_WEIGHT, PRIOR_WEIGHT * alpha)


def carried(seen: Estimate, borrowed: bool) -> Estimate:
    """What an earlier run observed, as the next run's prior: worth up to CARRIED_WEIGHT observations where that run
    was of the same kind, PRIOR_WEIGHT where it is `borrowed` from another kind."""
    weight = PRIOR_WEIGHT if borrowed else min(seen.verified, CARRIED_WEIGHT)
    return Estimate(weight, weight * seen.rate)


def weighted_median(values: Iterable[tuple[float, float]]) -> float:
    """The lower weighted median of (value, weight) pairs (not empty)."""
    ordered = sorted(values)
    half, total = sum(w for _, w in ordered) / 2.0, 0.0
    for value, weight in ordered:
        total += weight
        if total >= half:
            return value
    return ordered[-1][0]


def fit(points: dict[int, tuple[float, int]], prior: Line | None) -> Line | None:
    """The line through a step's measured sizes, rows -> (cost, samples), robust to a stray sample:
    - the slope is the weighted median of the slopes between every two sizes (Theil-Sen), a pair weighted by its
      samples and its squared gap (what it tells of a slope), the prior's slope one more pair weighted by the pairs
      behind it (its `evidence`; SLOPE_PRIOR for a line without that record): sizes measured in different runs
      differ by the machine's load between those runs as much as by their rows, so a slope between two sizes of a
      short span seen here is not preferred to one seen across a decode step in another kind of run; never
      negative, as a step over more rows reads as much and computes more;
    - the level is the weighted median of each size's cost less its rows' share, over the sizes above one row: one
      measured size sets it, so a prior from another length or kind is shifted by the first step measured here;
    - a one-row step keeps its own saving against that line (its kernels' own path), or the prior's; a one-row
      step measured above that line (a negative saving: the path it takes only ever saves) says the larger sizes'
      level was measured low, and the level is then the weighted median over every size, the one-row one included,
      so a larger size seen once (at a quiet moment of a busy machine) does not outweigh one row seen often;
    - a size's first sample counts FIRST_SAMPLE of a repeated one: a first use may pay one-time work.
    Without a point, the prior (None without one)."""
    if not points:
        return prior
    weights = {rows: n - 1 + FIRST_SAMPLE for rows, (_, n) in points.items()}
    pairs = [((points[a][0] - points[b][0]) / (a - b), weights[a] * weights[b] * (a - b) ** 2)
             for a, b in combinations(points, 2)]
    if prior is not None and prior.spans_rows:
        pairs.append((prior.per_row, prior.evidence or SLOPE_PRIOR))
    per_row = max(0.0, weighted_median(pairs)) if pairs else prior.per_row if prior else 0.0
    spans = len(points) > 1 or (prior is not None and prior.spans_rows)
    saving = prior.one_row_saving if prior is not None else None
    multi = [rows for rows in points if rows > 1]
    if multi:
        fixed = weighted_median((points[rows][0] - per_row * rows, weights[rows]) for rows in multi)
        if 1 in points and fixed + per_row < points[1][0]:  # a one-row step costlier than the larger steps' line
            fixed = weighted_median((points[rows][0] - per_row * rows, weights[rows]) for rows in points)
        if 1 in points:  # never above a two-row step: more rows cost no less
            saving = max(-per_row, fixed + per_row - points[1][0])
    else:  # one row only: the line through it with the prior's slope and saving
        saving = saving if saving is not None else 0.0
        fixed = points[1][0] + saving - per_row
    return Line(fixed, per_row, saving, spans, max(max(points), prior.largest if prior is not None else 1),
                sum(w for _, w in pairs))


def points(samples: dict[int, deque]) -> dict[int, tuple[float, int]]:
    """Each measured size's cost, the low median of its samples (a stall only ever adds time), and their count."""
    return {rows: (statistics.median_low(w), len(w)) for rows, w in samples.items()}


class StepCurve:
    """Milliseconds of one kind of step, by the rows it feeds: the RECENT latest samples of each size, each size's
    cost their low median (one stalled step, a GC pause or a busy CPU, only ever adds time), and the line fitted to
    them (`fit`) over a `prior` from the nearest kind of run or step (None: none)."""

    def __init__(self, prior: Line | None = None, samples: dict[int, deque] | None = None):
        self.prior = prior
        self.samples: dict[int, deque] = copy.deepcopy(samples) if samples else {}
        self._line: Line | None = None
        self._fresh = False

    def add(self, rows: int, ms: float) -> None:
        self.samples.setdefault(rows, deque(maxlen=RECENT)).append(ms)
        self._fresh = False

    def line(self) -> Line | None:
        """The fitted line (None while nothing is known)."""
        if not self._fresh:
            self._line, self._fresh = fit(points(self.samples), self.prior), True
        return self._line

    @property
    def measured(self) -> bool:
        """Whether this run (or an earlier one of its kind) measured it, not only a prior."""
        return bool(self.samples)


class Window:
    """The RECENT latest samples of one figure (milliseconds); its value is their low median."""

    def __init__(self, samples: Iterable[float] = ()):
        self.samples: deque = deque(samples, maxlen=RECENT)

    def add(self, ms: float) -> None:
        self.samples.append(ms)

    @property
    def value(self) -> float:
        return statistics.median_low(self.samples) if self.samples else 0.0


@dataclass
class Drafting:
    """What one level-1 drafter has shown: milliseconds per token asked of it (None until measured), the acceptance
    of its tokens at level 2 (a1) and at level 3 directly (a13: a1's until measured), the share of tokens asked that
    it proposes (`offered`); `samples`: (ms, tokens asked) of its latest rounds."""

    ms: float | None = None
    a1: Estimate = field(default_factory=lambda: prior(0.5))
    a13: Estimate | None = None
    offered: Estimate = field(default_factory=lambda: prior(1.0))
    samples: deque = field(default_factory=lambda: deque(maxlen=RECENT), repr=False)

    def timed(self, asked: int, ms: float) -> None:
        """One round's time for the tokens asked of it. A token's cost is a mix (a copied one costs next to nothing,
        one the draft model makes a forward), so it is the window's time per token, less its costliest round once it
        holds three (a single stall then does not steer it)."""
        self.samples.append((ms, asked))
        kept = sorted(self.samples, key=lambda r: r[0] / r[1])[:-1] if len(self.samples) >= 3 else self.samples
        self.ms = sum(m for m, _ in kept) / sum(c for _, c in kept)

    def checked(self, by: int, asked: int, proposed: int, accepted: int) -> None:
        """Asked for `asked` tokens it proposed `proposed`, of which level `by` (2, or 3 directly) kept `accepted`."""
        self.offered.verified += asked
        self.offered.accepted += proposed
        if by == 2:
            self.a1.add(proposed, accepted)
            return
        if self.a13 is None:
            self.a13 = copy.copy(self.a1)
        self.a13.add(proposed, accepted)

    def shadowed(self, asked: int, proposed: int, accepted: int) -> None:
        """What it would have proposed, checked against the tokens level 3 emitted: it stands in for both
        acceptances, level 2 being the target on most of the same context."""
        self.checked(3, asked, proposed, accepted)
        self.a1.add(proposed, accepted)

    def observed(self) -> dict[str, Estimate]:
        """The acceptances it observed (not priors), by field name: what a next run of its kind starts from."""
        return {name: copy.copy(a) for name in ("a1", "a13", "offered")
                if (a := getattr(self, name)) is not None and a.verified > PRIOR_WEIGHT}

    def figures(self, caution: float) -> Drafter:
        return Drafter(self.ms, self.a1.lower(caution), (self.a13 or self.a1).lower(caution),
                       self.offered.lower(caution))


# The kinds of step a run measures, each a fitted line: level 3's, and a level-2 forward checking level 1 or
# drafting alone chained on the device, each by itself or beside level 3's pass.
LEVEL2_KINDS = ("level2", "chained", "level2_beside", "chained_beside")
STEP_KINDS = ("level3", *LEVEL2_KINDS)


@dataclass
class Estimates:
    """One run's knowledge: a StepCurve per kind of step, the per-round overhead and post-pass time, level 3's
    acceptance of level 2 (a2), how often level 3 emits level 2's guess after a whole draft, and each level-1
    drafter's figures. `level2_cuts`: level 2's cache leaves part of the prompt out (else level 3 accepts nearly
    all it drafts, which says nothing of a prompt retrieval must cut: its acceptance is not learnt)."""

    curves: dict[str, StepCurve] = field(default_factory=lambda: {kind: StepCurve() for kind in STEP_KINDS})
    overhead: Window = field(default_factory=Window)
    post: Window = field(default_factory=Window)
    # level 2 is the target on the chunks its own queries chose: the real Qwen pair's level 3 accepted 0.90-0.99 of
    # its drafts on prose, code and a pass key; the paper reports ~0.9 and above (13)
    a2: Estimate = field(default_factory=lambda: prior(LEVEL2_PRIOR))
    # a guess is a draw from level 2's distribution checked like a draft: it stands about as often as one (13)
    guess: Estimate = field(default_factory=lambda: prior(0.9))
    level1: dict[str, Drafting] = field(default_factory=dict)
    level2_cuts: bool = True

    def observe(self, r: RoundRecord) -> None:
        """Learn one round's costs and acceptances."""
        if r.level1_asked:
            self.drafter(r.plan.level1).timed(r.level1_asked, r.level1_ms + r.level1_beside_ms)
        for by, asked, proposed, kept in r.level1_checks:
            self.drafter(r.plan.level1).checked(by, asked, proposed, kept)
        for name, (checks, ms) in r.in_passing.items():
            d = self.drafter(name)
            for check in checks:
                d.shadowed(*check)
            if asked := sum(asked for asked, _, _ in checks):
                d.timed(asked, ms)
        for f in r.level2:
            self.curves[kind_of(f)].add(f.rows, f.ms / f.count)
        if r.level2:
            self.overhead.add(r.overhead_ms)
        if r.post_ms is not None:
            self.post.add(r.post_ms)
        self.curves["level3"].add(r.rows, r.level3_ms)
        if r.plan.level2 and self.level2_cuts:
            self.a2.add(r.drafted, r.accepted)
            if r.guess is not None:
                self.guess.add(1, int(r.guess))

    def drafter(self, name: str) -> Drafting:
        return self.level1.setdefault(name, Drafting())

    def line(self, kind: str) -> Line | None:
        """A kind of step's line; a level-2 kind not known yet takes the nearest kind's: a chained forward costs at
        most a looped one and a looped one at least a chained one (bounds, until measured), and one beside level
        3's pass its own speed."""
        own = self.curves[kind].line()
        if own is not None or kind == "level3":
            return own
        if kind.endswith("_beside"):
            return self.line(kind.removesuffix("_beside"))
        return self.curves["level2" if kind == "chained" else "chained"].line()

    def figures(self, caution: float = 0.0) -> Figures:
        """A snapshot for the cost model, acceptances `caution` standard deviations below their estimates."""
        return Figures(**{kind: self.line(kind) for kind in STEP_KINDS}, overhead=self.overhead.value,
                       post=self.post.value, drafters={name: d.figures(caution) for name, d in self.level1.items()},
                       a2=self.a2.lower(caution), guess=self.guess.lower(caution))


def kind_of(f: Forwards) -> str:
    """The StepCurve a group of level-2 forwards is measured in."""
    return ("chained" if f.chained else "level2") + ("_beside" if f.beside else "")


class Regime(NamedTuple):
    """The kind of run a step cost belongs to: the full cache offloaded or not, the prompt's length (its power of
    two; a batch's: all its requests' tokens), greedy or sampled (a sampled row pays for its distribution), and one
    request or a batch (a batched step's rows belong to several requests, each over its own caches)."""

    offloaded: bool
    length: int
    greedy: bool
    batched: bool = False

    @classmethod
    def of(cls, offloaded: bool, prompt_tokens: int, greedy: bool, batched: bool = False) -> Regime:
        return cls(offloaded, prompt_tokens.bit_length(), greedy, batched)


class CostBook:
    """What earlier runs of one engine measured, so that a run starts from it: each kind of step's samples by regime
    (level 2's and the drafters' also by budget), and the acceptances a run of each kind ended with. What no run of
    a kind measured, the nearest kind stands in for as a prior (`_nearest`): a first auto run on a new document then
    starts as a second one would, instead of spending rounds on measuring."""

    def __init__(self):
        self.steps: dict[tuple, dict[int, deque]] = {}  # (kind, regime[, budget]) -> samples by rows
        self.drafting: dict[tuple, Drafting] = {}  # (regime, budget, drafter) -> its time
        self.acceptance: dict[tuple, dict[str, Estimate]] = {}  # (regime, budget[, drafter]) -> observed acceptances
        self.windows: dict[tuple, tuple[deque, deque]] = {}  # (regime, budget) -> overhead, post samples

    @staticmethod
    def _nearest(table: dict[tuple, T], key: tuple, document: bool = False) -> tuple[T | None, bool]:
        """The entry of `key`, and False; else that of the nearest kind alike in all but prompt length and sampling,
        and True (borrowed): the same sampling first, then the nearest length, or for an acceptance (`document`) the
        nearest length first (how well drafts match is the document's, whatever the sampling, while a sampled
        step's cost is its sampling's); else (None, False). A key is (..., Regime, ...): its Regime is compared."""
        if key in table:
            return table[key], False
        others = CostBook._others(table, key, document)
        return (table[others[0]], True) if others else (None, False)

    @staticmethod
    def _others(table: dict[tuple, T], key: tuple, document: bool = False) -> list[tuple]:
        """The keys of `table` of other kinds alike in all but prompt length and sampling, nearest first (as
        _nearest weighs them)."""
        at = next(i for i, part in enumerate(key) if isinstance(part, Regime))
        mine = key[at]

        def alike(k: tuple) -> bool:
            return k != key and len(k) == len(key) and k[:at] + k[at + 1:] == key[:at] + key[at + 1:] and \
                (k[at].offloaded, k[at].batched) == (mine.offloaded, mine.batched)

        def distance(k: tuple) -> tuple:
            length, sampling = abs(k[at].length - mine.length), k[at].greedy != mine.greedy
            return (length, sampling) if document else (sampling, length)

        return sorted((k for k in table if alike(k)), key=distance)

    def estimates(self, regime: Regime, budget: int, drafters: Iterable[str] = (), shadowed: Iterable[str] = (),
                  level2_cuts: bool = True) -> Estimates:
        """A run's starting knowledge: each kind of step's samples of its own kind of run, over a prior from the other
        kinds' lines, the nearest's first (what it lacks, a farther one's gives: a slope, a one-row step's cost);
        acceptances carried from the nearest kind of run (a drafter measured in passing by every run, `shadowed`,
        borrows the lower of the two nearest kinds': how often an answer quotes the document depends on the sampling
        too, and a guess too low costs little while the run measures it anyway)."""
        e = Estimates(level2_cuts=level2_cuts)
        for kind in STEP_KINDS:
            key = (kind, regime) if kind == "level3" else (kind, regime, budget)
            prior = None  # each other kind's line over the next nearer one's: what one lacks, a farther one gives
            for other in reversed(self._others(self.steps, key)):
                prior = fit(points(self.steps[other]), prior)
            e.curves[kind] = StepCurve(prior, self.steps.get(key))
        if (windows := self.windows.get((regime, budget))) is not None:
            e.overhead, e.post = Window(windows[0]), Window(windows[1])
        seen, far = self._nearest(self.acceptance, (regime, budget), document=True)
        for name in ("a2", "guess"):
            if (a := (seen or {}).get(name)) is not None:
                setattr(e, name, carried(a, far))
        for name in drafters:
            known, far = self._nearest(self.drafting, (regime, budget, name))
            e.level1[name] = Drafting(known.ms, samples=copy.deepcopy(known.samples)) if known and not far \
                else Drafting(known.ms if known else None)
            seen, far = self._nearest(self.acceptance, (regime, budget, name), document=True)
            if far and name in shadowed:
                seen = _lower(seen, self._nearest(self.acceptance, (regime, budget, name))[0])
            for field_name, a in (seen or {}).items():
                setattr(e.level1[name], field_name, carried(a, far))
        return e

    def learn(self, regime: Regime, budget: int, e: Estimates) -> None:
        """Keep a run's measurements: each kind of step's samples (sizes the run did not measure keep the book's),
        the drafters' times, the acceptances it observed (a run that observed none, all autoregressive, leaves
        what a nearby kind saw)."""
        for kind, curve in e.curves.items():
            if curve.samples:
                key = (kind, regime) if kind == "level3" else (kind, regime, budget)
                self.steps[key] = self.steps.get(key, {}) | copy.deepcopy(curve.samples)
        if e.overhead.samples or e.post.samples:
            self.windows[(regime, budget)] = (copy.copy(e.overhead.samples), copy.copy(e.post.samples))
        observed = {name: copy.copy(a) for name in ("a2", "guess") if (a := getattr(e, name)).verified > PRIOR_WEIGHT}
        if observed:
            self.acceptance[(regime, budget)] = observed
        for name, d in e.level1.items():
            if d.ms is not None:
                self.drafting[(regime, budget, name)] = Drafting(d.ms, samples=copy.deepcopy(d.samples))
            if seen := d.observed():
                key = (regime, budget, name)
                self.acceptance[key] = self.acceptance.get(key, {}) | seen

    def figures(self) -> list[float]:
        """Every cost the book would weigh, in milliseconds: each step size's (its samples' low median) and each
        drafter's per token."""
        return [ms for samples in self.steps.values() for ms, _ in points(samples).values()] + \
            [d.ms for d in self.drafting.values() if d.ms is not None]


def _lower(a: dict[str, Estimate] | None, b: dict[str, Estimate] | None) -> dict[str, Estimate]:
    """Two kinds' acceptances of one drafter, field by field the lower (a field one of them lacks: the other's)."""
    a, b = a or {}, b or {}
    return {name: min((e[name] for e in (a, b) if name in e), key=lambda x: x.rate) for name in {*a, *b}}
