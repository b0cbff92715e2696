"""The planner method auto had before core.plan, kept only for bench.simulate's comparison of the two (new over
old); the pieces the two share unchanged are taken from core. What it said of itself:

Choosing the hierarchy as a run goes: which levels a round uses and how many tokens each drafts, from measured
step costs and the acceptance seen so far.

TriForce pays only where reading the full KV cache is the expensive part of a step; elsewhere its extra levels are
overhead. So each round the planner picks among four hierarchies -- autoregressive (level 3 alone), level 1 → 3
(classic two-model speculative decoding), level 2 → 3 (self-speculation on the retrieval cache) and 1 → 2 → 3
(TriForce) -- their γs, and which drafter drafts at level 1 where a run holds two (a draft model and prompt
lookup). Every one verifies exactly as the others do, so a plan changes the speed, never the output distribution.
A verification of γ drafts, each accepted with probability α, emits 1 + α + ... + α^γ tokens (Leviathan et al.,
2023); divided by the round's cost, measured level by level, that is each candidate's speed. The planner weighs it at
acceptances a standard deviation below what it has seen (CAUTION): what little it has seen is a guess.
"""

from __future__ import annotations

import copy
import statistics
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Sequence, TypeVar

from core.decode.round import AUTOREGRESSIVE, Hierarchy
from core.plan.cost import candidates
from core.plan.estimate import Drafting, Estimate, carried, prior

T = TypeVar("T")

SWITCH_GAIN = 1.10  # another plan must be expected this much faster to replace the current one
MIN_ROUNDS = 4  # rounds a plan runs before the planner considers leaving it (and between two reconsiderations)
# ... and the decoding time between two reconsiderations: weighing every candidate takes ~0.35 ms of Python, which
# every 4 one-token rounds of a small model on a GPU (~1.3 ms each) would add ~7 %. The planner waits WEIGH_EVERY_MS
# after a change of plan, and twice as long each time a weighing keeps the plan, up to WEIGH_MOST_MS: a plan that keeps
# winning costs ~0.2 % to re-check, and one that stops winning is still left within WEIGH_MOST_MS.
WEIGH_EVERY_MS = 20.0
WEIGH_MOST_MS = 160.0
# ... or, where rounds are slow, this much decoding: a round that streams a long cache from host memory takes ~0.3 s,
# and four of a plan that its first round already showed wrong (drafts level 3 rejects) cost over a second.
SETTLE_MS = 200.0
GAMMAS = (1, 2, 3, 4, 6, 8, 10, 12, 15, 20, 25, 31)  # the draft lengths weighed (all of 1-31: more cost than use)
CHAIN_GAMMA = 4  # the draft length of the round that measures level 2 drafting alone ...
CHAIN_WORTH = 0.5  # ... where a level-2 step checking level 1 costs less than this share of a full step
MAX_SWITCHES = 6  # per run, once the costs are measured
PRIOR_WEIGHT = 4.0  # pseudo-observations behind each acceptance prior
# ... and at most this many behind one that a run of the same kind observed: a second click on a document starts
# from what the first one saw, and one unlucky round (a rejection at the first token) must not overturn it; another
# question on the document drafts differently, and a few rounds still show that.
CARRIED_WEIGHT = 16.0
CARRIED = ("a2", "guess")  # the acceptances of a whole run (Estimates' fields) that a next run of its kind starts from
# The planner weighs plans on acceptances this many standard deviations below what it has seen. A plan's speed is
# steep in the acceptance near 1 (a 31-token draft emits 27 tokens at 0.99, 16 at 0.95), and what it has seen is
# often little, or carried from another answer: prompt lookup's 0.37 from an answer that quoted the document, where
# the next one quoted nothing (0.09). Taken at face value, such estimates started runs of the real pair on drafts that
# lost a third of their speed; one deviation below, they wait until the run itself has shown them.
CAUTION = 1.0


# Samples behind each measured cost: their low median is the cost, so that one stalled round (a GC pause, a busy CPU,
# a UI thread holding the GIL: delays only ever add time) does not steer the plan, and a lasting change wins within a
# few rounds.
RECENT = 9


@dataclass
class Costs:
    """Measured milliseconds of levels 2 and 3 (None until seen): a level-2 forward checking level 1, a level-3
    forward by its number of new tokens (its pass over the cache, then its head, distributions and verification),
    the per-round overhead of keeping level 2's cache in step, a level-2 forward made while level 3's pass runs beside
    it (drafting ahead: the two share the device), what follows that pass (`post`: level 3's head, distributions and
    verification, which drafting ahead cannot hide), and a level-2 forward when level 2 drafts alone, by itself and
    beside the pass (`alone`: its forwards chain on the device, TriForce.draft_alone; on the real Qwen pair 25 %
    cheaper than those that wait for a check of level 1). Each is the low median of its RECENT latest samples:
    `samples` holds them by figure name, `level3_samples` by rows."""

    level2: float | None = None
    level3: dict[int, float] = field(default_factory=dict)
    overhead: float = 0.0
    samples: dict[str, deque] = field(default_factory=dict, repr=False)
    level3_samples: dict[int, deque] = field(default_factory=dict, repr=False)
    borrowed: bool = False  # level3 was measured at another prompt length: its first measurement here rescales it
    level2_ahead: float | None = None  # until measured, a plan drafting ahead expects level 2's own speed
    post: float = 0.0
    alone: float | None = None
    alone_ahead: float | None = None

    def level2_step(self, alone: bool) -> tuple[float | None, float | None]:
        """A level-2 forward's milliseconds by itself and beside level 3's pass, checking level 1 or drafting
        `alone`. A kind not measured yet borrows the other kind's figures (a forward that checks level 1 costs at
        least one that does not), and a forward beside the pass not measured yet its own speed, slowed as the other
        kind's was."""
        own, other = ((self.alone, self.alone_ahead), (self.level2, self.level2_ahead)) if alone else \
            ((self.level2, self.level2_ahead), (self.alone, self.alone_ahead))
        step = own[0] if own[0] is not None else other[0]
        if step is None or own[1] is not None:
            return step, own[1] if own[1] is not None else step
        slowed = other[1] / other[0] if None not in other else 1.0
        return step, step * slowed

    def verify(self, rows: int) -> float | None:
        """A level-3 forward over `rows` new tokens: measured, else linear through the nearest measured sizes, or
        beyond the largest on along the line through the smallest and the largest, never below either; below the
        smallest, the smallest's (a step over fewer tokens reads the same weights and cache: it costs no less than
        nothing, and about as much). Beyond the largest, the widest span sets the slope: through two neighbouring
        sizes (11 and 13 rows, say) the noise of one pass would be multiplied by the distance over their gap, and a
        1 ms wobble in a 30 ms pass had priced 32 rows at 1.6 passes, keeping long drafts out of the plans."""
        if rows in self.level3 or not self.level3:
            return self.level3.get(rows)
        sizes = sorted(self.level3)
        if rows < sizes[0] or len(sizes) == 1:
            return self.level3[sizes[0]]
        if rows < sizes[-1]:  # between two measured sizes
            a, b = max(r for r in sizes if r < rows), min(r for r in sizes if r > rows)
            ca, cb = self.level3[a], self.level3[b]
            return max(ca, ca + (cb - ca) * (rows - a) / (b - a))
        a, b = sizes[0], sizes[-1]
        ca, cb = self.level3[a], self.level3[b]
        return max(ca, cb, cb + (cb - ca) * (rows - b) / (b - a))

    def observe(self, level2_forwards: int, level2_ms: float, level3_rows: int, level3_ms: float,
                overhead_ms: float, ahead_forwards: int = 0, ahead_ms: float = 0.0, post_ms: float | None = None,
                alone: bool = False) -> None:
        """One round's measurements: level 2's time for its forwards (those it drafted ahead, beside level 3's pass,
        apart; `alone`: it drafted without level 1), the level-3 forward over `level3_rows` new tokens (`post_ms` of
        it after its pass, where level 2 drafted ahead), and the round's overhead. A step size's first use
        may pay one-time work (a kernel module loaded, a cuBLAS heuristic, an allocation: 0.2 s once on a 16-row step
        of the real pair offloaded, twelve times a pass), so its first sample stands only where the other sizes do not
        predict it (by interpolation, or beyond the largest); else the prediction holds until a second sample, of two
        the lower, replaces it. Taken as it came, that one sample had priced the size, and every larger one
        extrapolated from it, out of the plans for good."""
        step, beside = ("alone", "alone_ahead") if alone else ("level2", "level2_ahead")  # fields and their samples
        if level2_forwards:
            setattr(self, step, _sample(self.samples, step, level2_ms / level2_forwards))
        if ahead_forwards:
            setattr(self, beside, _sample(self.samples, beside, ahead_ms / ahead_forwards))
        if level2_forwards or ahead_forwards:
            self.overhead = _sample(self.samples, "overhead", overhead_ms)
        if post_ms is not None:
            self.post = _sample(self.samples, "post", post_ms)
        if self.borrowed and (then := self.verify(level3_rows)):  # a longer prompt scales every size alike
            self.level3 = {rows: ms * level3_ms / then for rows, ms in self.level3.items()}
        self.borrowed = False
        predicted = len(self.level3) >= 2 and level3_rows > min(self.level3)
        first = level3_rows not in self.level3 and level3_rows not in self.level3_samples
        ms = _sample(self.level3_samples, level3_rows, level3_ms)
        if not (first and predicted):
            self.level3[level3_rows] = ms

    def figures(self) -> list[float]:
        """Every cost measured, in milliseconds."""
        return [ms for ms in (self.level2, self.level2_ahead, self.alone, self.alone_ahead, *self.level3.values())
                if ms is not None]


class CostBook:
    """What earlier runs of one engine measured, so that a run starts from it: step costs (their recent samples too)
    and the acceptances a run of the same kind ended with (as priors: a second run on a document starts from what
    the first one saw). Level-3 steps are kept by regime: offloaded or not, prompt length (its power of two),
    greedy or sampled (a sampled row pays for its distribution); level 2 and its acceptance also by budget, and each
    drafter's figures by budget and drafter."""

    def __init__(self):
        self.level3: dict[tuple, Costs] = {}
        self.levels: dict[tuple, Costs] = {}
        self.drafting: dict[tuple, Drafting] = {}
        self.acceptance: dict[tuple, dict[str, Estimate]] = {}  # by run kind ("a2"), drafter (Drafting.observed)

    @staticmethod
    def _keys(offloaded: bool, prompt_tokens: int, greedy: bool, budget: int) -> tuple[tuple, tuple]:
        regime = (offloaded, prompt_tokens.bit_length(), greedy)
        return regime, (*regime, budget)

    @staticmethod
    def _nearest(table: dict[tuple, T], key: tuple, other: bool = False, document: bool = False
                 ) -> tuple[T | None, bool]:
        """The entry of `key` (unless `other`); else, and True (borrowed), that of the nearest kind alike in all but
        prompt length and sampling: the same sampling first, then the nearest length; else None. For an acceptance
        (`document`) the nearest length comes first: how well drafts match is the document's, whatever the sampling,
        while a sampled step's cost is its sampling's."""
        if key in table and not other:
            return table[key], False
        alike = [k for k in table if k[:1] + k[3:] == key[:1] + key[3:] and k != key]

        def distance(k: tuple) -> tuple:
            length, sampling = abs(k[1] - key[1]), k[2] != key[2]
            return (length, sampling) if document else (sampling, length)

        nearest = min(alike, key=distance, default=None)
        return (table[nearest], True) if nearest is not None else (None, False)

    def estimates(self, offloaded: bool, prompt_tokens: int, greedy: bool, budget: int,
                  drafters: Sequence[str] = (), shadowed: Sequence[str] = ()) -> Estimates:
        """What is known for a run of this kind with these level-1 drafters (a copy: the run's measurements go back
        through learn). What no run of this kind measured, the nearest kind's figures stand in for (_nearest),
        without their samples (the run's first measurements replace them); its level-3 sizes scaled by a size both
        lengths measured (an autoregressive run on the document, say), else by the run's first level-3
        measurement. A first auto run on a new document then starts as a second one would, instead of spending
        rounds on measuring. A drafter the run measures in passing (`shadowed`: prompt lookup, TriForce.shadow)
        borrows the lower of its acceptances in the two nearest kinds: how often an answer quotes the document
        depends on the sampling too (random weights decoded greedily repeat themselves: prompt lookup's 0.98 there
        had the served app's first sampled click at 8K start with it, at 0.93× AR), and a guess too low costs little
        while the run measures the drafter without drafting with it."""
        regime, run = self._keys(offloaded, prompt_tokens, greedy, budget)
        own, near = self.level3.get(regime, Costs()), self._nearest(self.level3, regime, other=True)[0]
        level3, borrowed = dict(own.level3), False
        if near is not None and set(near.level3) - set(level3):
            # Scaled by a size measured here: one both lengths measured, else the smallest here against what the
            # other length's curve says for it (an offloaded run never measures one-row steps, while the
            # autoregressive run of a Compare click measured only those)
            anchor = next((rows for rows in level3 if rows in near.level3), min(level3, default=None))
            then = near.verify(anchor) if anchor is not None else None
            scale = level3[anchor] / then if then else 1.0
            level3, borrowed = {rows: ms * scale for rows, ms in near.level3.items()} | level3, not then
        levels, far = self._nearest(self.levels, run)
        levels = levels or Costs()
        # level 2's figures as the nearest kind measured them (its samples only if this kind's own), level 3's here
        e = Estimates(copy.deepcopy(replace(levels, level3=level3, samples={} if far else levels.samples,
                                            level3_samples=own.level3_samples, borrowed=borrowed)))
        seen, far = self._nearest(self.acceptance, run, document=True)
        for name in CARRIED:
            if (a := (seen or {}).get(name)) is not None:
                setattr(e, name, carried(a, far))
        for name in drafters:
            known, far = self._nearest(self.drafting, (*run, name))
            d = e.level1[name] = Drafting(known.ms, samples=copy.deepcopy(known.samples)) if known and not far \
                else Drafting(known.ms if known else None)
            seen, far = self._nearest(self.acceptance, (*run, name), document=True)
            if far and name in shadowed:  # ... and the same sampling's nearest length: the lower of each
                seen = _lower(seen, self._nearest(self.acceptance, (*run, name))[0])
            for field_name, a in (seen or {}).items():
                setattr(d, field_name, carried(a, far))
        return e

    def learn(self, offloaded: bool, prompt_tokens: int, greedy: bool, budget: int, e: Estimates) -> None:
        """Keep a run's measurements: its level-3 sizes beside those of other runs of the regime, level 2's and
        each drafter's figures, the acceptances it observed (a run that observed none, all autoregressive, must not
        hide what a nearby kind saw)."""
        regime, run = self._keys(offloaded, prompt_tokens, greedy, budget)
        costs = e.costs
        full = self.level3.setdefault(regime, Costs())
        full.level3.update(costs.level3)
        full.level3_samples.update(copy.deepcopy(costs.level3_samples))
        if costs.level2 is not None or costs.alone is not None:  # level 3: self.level3
            # a kind of level-2 forward this run did not make (a fixed plan drafting alone never checks level 1)
            # keeps the book's figures for it: forgotten, it would borrow the other kind's, a bound, not a cost
            old = self.levels.get(run, Costs())
            kept = {name: getattr(costs, name) if getattr(costs, name) is not None else getattr(old, name)
                    for name in ("level2", "level2_ahead", "alone", "alone_ahead")}
            self.levels[run] = Costs(overhead=costs.overhead, samples=copy.deepcopy(old.samples | costs.samples),
                                     post=costs.post, **kept)
        observed = {name: copy.copy(a) for name in CARRIED if (a := getattr(e, name)).verified > PRIOR_WEIGHT}
        if observed:  # (a guess is counted only after level 3 verified a whole draft: never without a2)
            self.acceptance[run] = observed
        for name, d in e.level1.items():
            if d.ms is not None:
                self.drafting[(*run, name)] = Drafting(d.ms, samples=copy.deepcopy(d.samples))
            if seen := d.observed():
                self.acceptance[(*run, name)] = self.acceptance.get((*run, name), {}) | seen

    def figures(self) -> list[float]:
        """Every cost the book holds, in milliseconds."""
        return [ms for costs in (*self.level3.values(), *self.levels.values()) for ms in costs.figures()] + \
            [d.ms for d in self.drafting.values() if d.ms is not None]


def _lower(a: dict[str, Estimate], b: dict[str, Estimate] | None) -> dict[str, Estimate]:
    """Two kinds' acceptances of one drafter, field by field the lower (a field one of them lacks: the other's)."""
    b = b or {}
    return {name: min((e[name] for e in (a, b) if name in e), key=lambda x: x.rate) for name in {*a, *b}}


def _sample(windows: dict, figure: str | int, ms: float) -> float:
    """Add one measurement of a figure to its window; the figure's new value, the window's low median (of two
    samples the lower: a stall only ever adds time)."""
    window = windows.setdefault(figure, deque(maxlen=RECENT))
    window.append(ms)
    return statistics.median_low(window)


def expected_tokens(alpha: float, gamma: float) -> float:
    """Tokens a verification of `gamma` drafts emits on average: the accepted ones and one correction or bonus."""
    return gamma + 1.0 if alpha >= 1.0 else (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


@dataclass
class Estimates:
    """What the planner knows: the costs of levels 2 and 3, the acceptance of level 2 at level 3 (a2), what each
    level-1 drafter has shown, by name, and how often level 2 guesses the token level 3 emits after a whole draft."""

    costs: Costs = field(default_factory=Costs)
    # level 2 is the target itself on the chunks its own queries chose: the real Qwen pair's level 3 accepted 0.90-0.99
    # of its drafts on prose, code and a pass key (bench.real), the paper reports ~0.9 and above
    a2: Estimate = field(default_factory=lambda: prior(0.9))
    level1: dict[str, Drafting] = field(default_factory=dict)
    # how often level 3, having accepted a whole draft, accepts the token level 2 guessed would follow it (the draft
    # made ahead after it then stands): a draw from level 2's distribution checked like a draft, so about as often as
    # it accepts one
    guess: Estimate = field(default_factory=lambda: prior(0.9))


def rate(h: Hierarchy, e: Estimates, caution: float = 0.0) -> float | None:
    """Expected tokens per millisecond of `h` (None while a cost it needs is unmeasured), its acceptances taken
    `caution` standard deviations below their estimates."""
    c = e.costs

    def alpha(a: Estimate) -> float:
        return a.lower(caution)

    verify = c.verify(h.gamma2 + 1)
    d = e.level1.get(h.level1)
    step, beside = c.level2_step(alone=not h.level1)
    if verify is None or (h.level1 and (d is None or d.ms is None)) or (h.level2 and step is None):
        return None
    if not h.gamma2:
        return 1.0 / verify if verify > 0 else None
    if h.level2:  # level 2 makes γ2 tokens, each level-2 forward checking γ1 level-1 tokens when level 1 drafts
        per_forward = expected_tokens(alpha(d.a1), alpha(d.offered) * h.gamma1) if d else 1.0
        level1 = h.gamma1 * d.ms if d else 0.0  # level 1's drafting for one level-2 forward
        forward = step + level1
        drafting = h.gamma2 * forward / per_forward
        if not h.ahead:
            return expected_tokens(alpha(e.a2), h.gamma2) / (drafting + verify + c.overhead)
        # While level 3 verifies, level 2 guesses the token level 3 will emit after the draft (one forward) and drafts
        # the next round after it, at the speed it drafts beside level 3's pass: that draft stands when level 3
        # accepts every draft and then the guess, so a round drafts for itself, alone, only otherwise. Level
        # 3's head, distributions and verification wait for both the pass and the drafting.
        ahead = beside + drafting * (beside + level1) / forward
        kept = alpha(e.a2) ** h.gamma2 * alpha(e.guess)
        round_ms = (1.0 - kept) * drafting + max(verify, ahead + c.post) + c.overhead
        return expected_tokens(alpha(e.a2), h.gamma2) / round_ms
    return expected_tokens(alpha(d.a13 or d.a1), alpha(d.offered) * h.gamma2) / (h.gamma2 * d.ms + verify)


def best(options: list[Hierarchy], e: Estimates, caution: float = 0.0) -> tuple[Hierarchy, float] | None:
    """The option with the highest expected rate, and that rate (None while no option's rate is known)."""
    rated = [(r, h) for h in options if (r := rate(h, e, caution)) is not None]
    return max(rated, key=lambda x: x[0])[::-1] if rated else None


@dataclass
class Planner:
    """One run's hierarchy, round by round. While costs are unmeasured it measures: a round of the fullest
    hierarchy drafting one token, then, where level 2's forwards chain when it drafts alone (`chained`) and a
    level-2 step costs under CHAIN_WORTH of a full one, a round of level 2 drafting alone, then an autoregressive one
    (unless the full cache is `streamed` from host memory: a full step then costs what its copies do however few
    tokens it verifies, so the verification measured stands for an AR step, which would cost a whole pass over the
    cache for one token). Then, once a plan has run MIN_ROUNDS rounds
    (or SETTLE_MS of decoding) and weigh_every_ms have passed since it last looked, it weighs the candidates again and
    switches when another is expected SWITCH_GAIN times faster, at most MAX_SWITCHES times (after that only back to
    autoregressive decoding, when the plan falls below it). A drafting plan is taken only when expected SWITCH_GAIN
    times faster than autoregressive decoding, the first one too. `drafters`: the level-1 drafters there, the first
    measured first (the others' plans are weighed once their figures are known: see TriForce.shadow); `level2`:
    level 2's cache leaves part of the prompt out (else it reads what level 3 does, for nothing)."""

    estimates: Estimates
    drafters: Sequence[str]
    gamma1_max: int
    gamma2_max: int
    streamed: bool = False
    level2: bool = True
    ahead: bool = False  # level 2 can draft the next round while level 3 verifies, at once: plans that do are weighed
    chained: bool = False  # level 2 drafting alone chains its forwards on a GPU: a cost to measure apart
    fixed: Hierarchy | None = None  # the hierarchy of every round (method triforce): the planner then only records
    caution: float = CAUTION  # standard deviations below their estimates that plans' acceptances are weighed at
    current: Hierarchy | None = None
    rounds: int = 0  # in the current plan
    switches: int = 0
    reason: str = ""  # why the current plan was chosen
    since_weighed_ms: float = 0.0  # decoding time since the candidates were last weighed
    weigh_every_ms: float = WEIGH_EVERY_MS  # ... and how much of it the next weighing waits for
    expected: float | None = None  # the current plan's expected rate when it was last weighed
    options: list[Hierarchy] = field(init=False)  # the candidates it weighs

    def __post_init__(self):
        self.options = candidates(self.drafters, self.gamma1_max, self.gamma2_max, self.level2, self.ahead)
        for name in self.drafters:
            self.estimates.level1.setdefault(name, Drafting())

    def choose(self) -> Hierarchy:
        """The hierarchy of the next round."""
        if self.fixed is not None:
            return self.fixed
        if self.current is not None and not self.reason.startswith("measuring") and not self._due():
            return self.current  # most rounds: nothing to decide
        c = self.estimates.costs
        if self.options == [AUTOREGRESSIVE]:
            return self._set(AUTOREGRESSIVE, "no level can draft: the retrieval budget covers the whole prompt "
                                             "(level 2 would read what level 3 reads) and no level-1 drafter is there")
        # the measuring round drafts one token through every level: a level-1 token, a level-2 forward checking it,
        # a level-3 step over two rows; each token more would be drafted at costs not yet known (on the embedded
        # model's CPU a level-2 forward costs ~1.8 full steps: drafting six tokens to measure had cost a short
        # answer's first click 16 % of its speed)
        first = self.drafters[0] if self.drafters else ""
        fullest = Hierarchy(first, self.level2, self.gamma1_max if first and self.level2 else 0, 1,
                            self.ahead and self.level2)
        if (self.level2 and c.level2_step(alone=not first)[0] is None) or \
                (first and self.estimates.level1[first].ms is None) or not set(c.level3) - {1}:
            return self._set(fullest, "measuring what each level costs")
        # (a one-forward draft chains nothing; and where a level-2 step costs about a full one, as on small models
        # on chip, no saving from chaining makes drafting alone pay, and measuring it there cost a sampled click of
        # the served app at 8K more than half its speed)
        if self.chained and first and self.level2 and c.alone is None and c.level2 < CHAIN_WORTH * c.verify(1):
            return self._set(Hierarchy("", True, 0, CHAIN_GAMMA, self.ahead), "measuring level 2 drafting alone")
        if 1 not in c.level3 and not self.streamed:
            return self._set(AUTOREGRESSIVE, "measuring an autoregressive step")
        fresh = self.current is None or self.reason.startswith("measuring")  # else due (the first line)
        self.since_weighed_ms = 0.0
        h, r = best(self.options, self.estimates, self.caution)
        ar = self._autoregressive()
        # a drafting plan must clearly beat AR to be taken; out of switches, only a way back to AR is left
        if (h.gamma2 and r < SWITCH_GAIN * ar) or (not fresh and self.switches >= MAX_SWITCHES):
            h, r = AUTOREGRESSIVE, ar
        now = rate(self.current, self.estimates, self.caution) if self.current else None
        # another plan must be clearly faster to replace the current one, unless the current one is now expected
        # slower than autoregressive decoding (which the planner never knowingly stays)
        if fresh or now is None or (h != self.current and (r > SWITCH_GAIN * now or now < ar)):
            self.weigh_every_ms, self.expected = WEIGH_EVERY_MS, r
            return self._set(h, self.explain(h))
        # kept: looked at again later while it is the best, soon while another comes close
        self.weigh_every_ms = min(2 * self.weigh_every_ms, WEIGH_MOST_MS) if h == self.current else WEIGH_EVERY_MS
        self.expected = now
        return self.current

    def _due(self) -> bool:
        """Whether the current plan has run long enough to be weighed against the others again: after
        weigh_every_ms of decoding, or as soon as MIN_ROUNDS rounds show it falling short of what it was chosen for
        (drafts rejected that its prior expected accepted)."""
        spare = self.switches < MAX_SWITCHES
        if self.rounds >= MIN_ROUNDS and self.current.gamma2 and self.expected:
            now = rate(self.current, self.estimates, self.caution) or 0.0
            if now < self._autoregressive() or (spare and SWITCH_GAIN * now < self.expected):
                return True
        settled = self.rounds >= MIN_ROUNDS or self.since_weighed_ms >= SETTLE_MS
        return spare and settled and self.since_weighed_ms >= self.weigh_every_ms

    def _autoregressive(self) -> float:
        """Autoregressive decoding's expected rate (0 while its step is unmeasured)."""
        return rate(AUTOREGRESSIVE, self.estimates) or 0.0

    def explain(self, h: Hierarchy) -> str:
        """One line on why `h` was chosen: its expected speed over autoregressive decoding (at the acceptances seen;
        the choice weighed them with caution) and the costs behind it."""
        e = self.estimates
        c = e.costs
        ar, r = rate(AUTOREGRESSIVE, e), rate(h, e)
        parts = [f"expected {r / ar:.2f}× autoregressive" if ar and r else ""]
        full = c.verify(1)
        step, ahead = c.level2_step(alone=not h.level1)
        if step is not None and full:
            beside = f" ({ahead / full:.0%} beside level 3's pass)" if h.ahead else ""
            parts.append(f"a level-2 step costs {step / full:.0%} of a full one{beside}")
        d = e.level1.get(h.level1 or (self.drafters[0] if self.drafters else ""))
        if d is not None and d.ms is not None and full:
            parts.append(f"a level-1 token {d.ms / full:.0%}")
        if h.level1 and not h.level2:
            parts.append(f"acceptance of level 1 at level 3 {(d.a13 or d.a1).rate:.2f}")
        elif h.gamma2:
            parts.append((f"acceptance L1 {d.a1.rate:.2f}, " if h.level1 else "") + f"L2 {e.a2.rate:.2f}")
        return "; ".join(p for p in parts if p)

    def _set(self, h: Hierarchy, reason: str) -> Hierarchy:
        if h != self.current:
            if self.current is not None and not self.reason.startswith("measuring"):
                self.switches += 1
            self.current, self.rounds = h, 0
        self.reason = reason
        return h

    def observe(self, level1: str, level1_asked: int, level1_ms: float, level2_forwards: int, level2_ms: float,
                level3_rows: int, level3_ms: float, overhead_ms: float, ahead_forwards: int = 0,
                ahead_ms: float = 0.0, post_ms: float | None = None) -> None:
        """One round's measured costs: drafter `level1`'s time for the tokens asked of it, then as Costs.observe
        takes them (`ahead_*`: level 2's forwards made beside level 3's pass, which the round did not wait on)."""
        self.rounds += 1
        self.since_weighed_ms += level1_ms + level2_ms + level3_ms + overhead_ms
        if level1_asked:
            self.estimates.level1[level1].timed(level1_asked, level1_ms)
        self.estimates.costs.observe(level2_forwards, level2_ms, level3_rows, level3_ms, overhead_ms, ahead_forwards,
                                     ahead_ms, post_ms, alone=not level1)

    def level1_checked(self, drafter: str, by: int, asked: int, proposed: int, accepted: int) -> None:
        """Drafter `drafter` was asked for `asked` tokens, proposed `proposed`, and level `by` (2, or 3 directly)
        accepted `accepted` of them."""
        self.estimates.level1[drafter].checked(by, asked, proposed, accepted)

    def shadowed(self, drafter: str, checks: list[tuple[int, int, int]], ms: float) -> None:
        """What drafter `drafter` would have proposed this round, as (asked, proposed, accepted) checks against the
        tokens level 3 emitted, and the milliseconds asking it took."""
        d = self.estimates.level1[drafter]
        for check in checks:
            d.shadowed(*check)
        if asked := sum(asked for asked, _, _ in checks):
            d.timed(asked, ms)

    def level2_checked(self, proposed: int, accepted: int) -> None:
        """Level 3 accepted `accepted` of level 2's `proposed` tokens."""
        self.estimates.a2.add(proposed, accepted)

    def guessed(self, hit: bool) -> None:
        """Level 3 accepted a whole draft and then emitted (`hit`) or not the token level 2 had guessed."""
        self.estimates.guess.add(1, int(hit))
