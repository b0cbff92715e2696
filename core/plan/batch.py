"""Method auto for a batch: one γ2 for the batch's requests on method auto, priced by what the batch's steps cost.

A batch's level-3 step reads the weights once and every request's full cache; its level-2 step the weights once and
every drafting request's retrieval cache. So where the caches outweigh the weights (many requests, long prompts)
level 2 costs a fraction of level 3 even for a small model, and drafting pays where it did not for one request. The
model: a round drafts γ_i tokens for request i (0: an autoregressive step), level 2 steps max γ_i times over the
requests still drafting, level 3 verifies Σ (γ_i + 1) rows once; request i emits E(α_i, γ_i) tokens. The planner
picks the γ for the auto requests that maximises tokens per millisecond of the batch.
"""

from __future__ import annotations

from core.plan.cost import GAMMAS, expected_tokens
from core.plan.estimate import LEVEL2_PRIOR, PRIOR_WEIGHT, StepCurve

EXPLORE_GAMMA = 4  # the γ2 a batch measures level 2 with before it can price any (within the γs auto mostly takes)
SWITCH_GAIN = 1.05  # a new γ must promise this much more throughput than the current one (hysteresis, as in Auto)


def alpha(verified: int, accepted: int) -> float:
    """A request's per-token acceptance from level 3's verifications of its drafts so far, the prior LEVEL2_PRIOR
    worth PRIOR_WEIGHT verifications until measured."""
    return (accepted + LEVEL2_PRIOR * PRIOR_WEIGHT) / (verified + PRIOR_WEIGHT)


class BatchPlanner:
    """Learns a batch's step costs (level 3 by the rows it verifies, level 2 by the requests it drafts for) and chooses
    the auto requests' γ2. `most`: the longest draft (DECODE_TOKENS - 1 rows per request)."""

    def __init__(self, most: int):
        self.level3 = StepCurve()
        self.level2 = StepCurve()
        self.gammas = [g for g in GAMMAS if g <= most]
        self.gamma = 0  # the auto requests' current γ2
        self.reason = ""

    def observe(self, level3_rows: int, level3_ms: float, level2_slots: int, level2_steps: int, level2_ms: float
                ) -> None:
        """One round's costs: level 3's step and, where level 2 drafted, its steps' mean."""
        self.level3.add(level3_rows, level3_ms)
        if level2_steps:
            self.level2.add(level2_slots, level2_ms / level2_steps)

    def rate(self, auto: list[float], fixed: list[int], gamma: int) -> float | None:
        """Tokens per millisecond with the auto requests (acceptances `auto`) at `gamma` beside requests whose γ2 is
        `fixed` (0: autoregressive); None while a cost it needs is unknown."""
        gammas = [gamma] * len(auto) + fixed
        l3, l2 = self.level3.line(), self.level2.line()
        if l3 is None or (any(gammas) and l2 is None):
            return None
        alphas = auto + [LEVEL2_PRIOR] * len(fixed)
        ms = l3(sum(g + 1 for g in gammas)) + sum(l2(sum(g > j for g in gammas)) for j in range(max(gammas)))
        return sum(expected_tokens(a, g) if g else 1.0 for a, g in zip(alphas, gammas)) / ms

    def choose(self, auto: list[tuple[int, int]], fixed: list[int]) -> int:
        """The γ2 for the next round of the auto requests (each one's drafts verified and accepted so far) beside
        requests of `fixed` γ2: measure an autoregressive step, then level 2 at EXPLORE_GAMMA,
        then the best by the model, changed only for SWITCH_GAIN more."""
        if not auto:
            return self.gamma
        alphas = [alpha(*seen) for seen in auto]
        if not self.level3.measured:
            self.gamma, self.reason = 0, "measuring an autoregressive step of the batch"
        elif not self.level2.measured:
            self.gamma, self.reason = EXPLORE_GAMMA, f"measuring level 2 at γ2 {EXPLORE_GAMMA}"
        else:
            rates = {g: self.rate(alphas, fixed, g) for g in [0, *self.gammas]}
            rates = {g: r for g, r in rates.items() if r is not None}
            best = max(rates, key=rates.get)
            now = rates.get(self.gamma)
            if now is None or rates[best] > SWITCH_GAIN * now:
                self.gamma = best
            self.reason = f"γ2 {self.gamma}: {rates[self.gamma]:.3g} tokens/ms for the batch " \
                          f"(autoregressive {rates[0]:.3g})"
        return self.gamma
