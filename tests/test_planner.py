"""The planner of method auto: its cost model (pure functions of measured step costs and acceptance), its choices
(autoregressive where speculation cannot pay, TriForce where the full step dominates, a switch only for a clear
gain), and exactness while it switches hierarchies round by round (greedy token-identical to autoregressive, the
sampled distribution the target's)."""

import itertools
import time

import pytest
import torch

import core.triforce
from core.config import GenerationConfig
from core.cuda_graphs import Graphs
from core.events import Finished, PlanChosen
from core.model import Transformer
from core.planner import (AUTOREGRESSIVE, MIN_ROUNDS, WEIGH_EVERY_MS, Costs, Estimate, Estimates, Hierarchy, Planner,
                          best, candidates, expected_tokens, prior, rate)
from tests.lossless import GATED_DRAWS, emitted_pairs, target_pairs, tiny_engine
from tests.stats import chi_square_p


def estimates(level1: float, level2: float, level3: dict[int, float], a1: float, a2: float) -> Estimates:
    return Estimates(Costs(level1, level2, level3), prior(a1), prior(a2))


def test_expected_tokens_of_a_verification_follow_the_geometric_series():
    assert expected_tokens(0.0, 6) == 1.0
    assert expected_tokens(1.0, 6) == 7.0
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)


def test_acceptance_counts_only_the_drafts_that_were_verified():
    a = Estimate(0.0, 0.0)
    a.add(proposed=6, accepted=2)  # the third was rejected, the last three never verified
    a.add(proposed=6, accepted=6)
    assert (a.verified, a.accepted) == (9, 8)


def test_a_level_3_cost_between_measured_sizes_is_interpolated():
    c = Costs(level3={1: 10.0, 7: 16.0})
    assert c.verify(4) == pytest.approx(13.0) and c.verify(1) == 10.0 and c.verify(13) == pytest.approx(22.0)
    assert Costs(level3={7: 16.0}).verify(1) == 16.0 and Costs().verify(1) is None


def test_a_level_3_cost_outside_the_measured_sizes_never_falls_below_the_nearest_one():
    """Below the smallest measured size (a streamed run never measures one token), the smallest's cost; above the
    largest, on through the two largest, never lower (a noisy larger size must not make more tokens cheaper)."""
    c = Costs(level3={7: 40.0, 13: 90.0, 16: 100.0})
    assert c.verify(1) == 40.0 and c.verify(10) == pytest.approx(65.0) and c.verify(19) == pytest.approx(110.0)
    assert Costs(level3={7: 40.0, 13: 30.0}).verify(16) == 40.0
    assert rate(AUTOREGRESSIVE, Estimates(Costs(level3={7: 40.0, 13: 90.0}))) == pytest.approx(1 / 40.0)


def test_autoregressive_wins_where_no_speculative_candidate_gains_its_cost():
    """A small model on a CPU: a retrieval step costs 95 % of a full one, the draft 40 %, acceptance modest."""
    e = estimates(level1=4.0, level2=9.5, level3={1: 10.0, 7: 18.0}, a1=0.4, a2=0.7)
    h, r = best(candidates(True, 2, 15), e)
    assert h == AUTOREGRESSIVE and r == pytest.approx(1 / 10.0)


def test_triforce_wins_where_the_full_step_dominates():
    """A long cache offloaded: the full step 300 ms, the retrieval one 8 ms, the draft 1 ms."""
    e = estimates(level1=1.0, level2=8.0, level3={1: 300.0, 13: 305.0}, a1=0.6, a2=0.9)
    h, r = best(candidates(True, 2, 15), e)
    assert h.level1 and h.level2 and h.gamma2 >= 10 and r > 5 * rate(AUTOREGRESSIVE, e)


def test_two_model_speculation_wins_where_the_retrieval_level_saves_nothing():
    e = estimates(level1=1.0, level2=9.8, level3={1: 10.0, 7: 10.5}, a1=0.8, a2=0.95)
    h, _ = best(candidates(True, 2, 15), e)
    assert h.level1 and not h.level2


def test_the_planner_measures_first_then_switches_only_for_a_clear_gain():
    p = Planner(Estimates(), level1=True, gamma1_max=2, gamma2_max=15)
    first = p.choose()
    assert first.level1 and first.level2 and p.reason.startswith("measuring")
    p.observe(2, 2.0, 2, 19.0, first.gamma2 + 1, 12.0, 0.5)  # a level-1 token 1 ms, a level-2 step 9.5 ms
    assert p.choose() == AUTOREGRESSIVE  # the one-row step is measured next
    p.observe(0, 0.0, 0, 0.0, 1, 10.0, 0.0)
    chosen = p.choose()
    assert chosen != first and "autoregressive" in p.reason
    for _ in range(MIN_ROUNDS - 1):  # not settled yet: kept, whatever the estimates say
        p.observe(0, 0.0, 0, 0.0, 1, 10.0, 0.0)
        p.estimates.costs.level3[1] = 1000.0
        assert p.choose() == chosen


def test_a_fast_model_s_plan_is_weighed_again_only_after_enough_decoding_time():
    """Weighing every candidate costs a fraction of a millisecond of Python: with 1 ms rounds the planner waits for
    WEIGH_EVERY_MS of them, not MIN_ROUNDS, before it looks again."""
    p = Planner(estimates(level1=0.9, level2=0.95, level3={1: 1.0, 7: 1.2}, a1=0.3, a2=0.5), level1=True,
                gamma1_max=2, gamma2_max=31)
    assert p.choose() == AUTOREGRESSIVE
    p.estimates.costs.level2, p.estimates.a2 = 0.1, Estimate(100.0, 99.0)  # now level 2 → 3 would be far faster
    rounds = 0
    while p.choose() == AUTOREGRESSIVE:
        p.observe(0, 0.0, 0, 0.0, 1, 1.0, 0.0)
        rounds += 1
    assert rounds == WEIGH_EVERY_MS > MIN_ROUNDS and p.current.level2 and p.current.gamma2 > 15


def test_with_the_full_cache_streamed_the_planner_takes_the_verification_for_an_autoregressive_step():
    """Offloaded, an AR step would cost a whole pass over the cache for one token: it is not measured."""
    p = Planner(Estimates(), level1=True, gamma1_max=2, gamma2_max=15, streamed=True)
    first = p.choose()
    p.observe(2, 2.0, 2, 200.0, first.gamma2 + 1, 1000.0, 0.5)  # a pass over the cache: 1 s, whatever it verifies
    chosen = p.choose()
    assert chosen != AUTOREGRESSIVE and chosen.level2 and 1 not in p.estimates.costs.level3
    assert "a level-2 step costs 10% of a full one" in p.reason  # 100 ms beside the measured pass


def test_graph_captures_are_not_counted_in_the_costs_the_planner_weighs(monkeypatch):
    """A step shape's first use captures a CUDA graph (and compiles: seconds on a GPU). That time is warm-up: counted
    in a level's cost, one capture made the level look expensive for the rest of the run and to the next runs. Here
    every first use of a (cache, step size) takes 100 ms and reports it as a capture, as Graphs does."""
    engine, prompt = tiny_engine()
    engine.graphs = Graphs()
    step, seen = Transformer.step, set()

    def capturing_step(model, ids, cache, *args, **kwargs):
        if (id(cache), len(ids)) not in seen:
            seen.add((id(cache), len(ids)))
            time.sleep(0.1)
            engine.graphs.capture_s += 0.1
        return step(model, ids, cache, *args, **kwargs)

    monkeypatch.setattr(Transformer, "step", capturing_step)
    base = dict(greedy=True, max_new_tokens=24, budget=8, chunk_size=4, sink_tokens=4, window_tokens=12)
    with torch.no_grad():
        for method in ("ar", "auto"):
            list(engine.generate_ids(prompt, GenerationConfig(method=method, **base)))
    measured = [ms for rows in engine.costs.level3.values() for ms in rows.values()]
    measured += [ms for levels in engine.costs.levels.values() for ms in levels[:2] if ms is not None]
    assert len(seen) > 4 and measured and max(measured) < 50.0, measured


class Cycling(Planner):
    """Every round a different hierarchy, whatever was measured: switching is exact or nothing is."""

    order = itertools.cycle([AUTOREGRESSIVE, Hierarchy(True, False, 0, 3), Hierarchy(False, True, 0, 2),
                             Hierarchy(True, True, 2, 3), Hierarchy(True, False, 0, 1)])

    def choose(self) -> Hierarchy:
        self.reason = "cycling"
        self.current = next(self.order)
        return self.current


def test_greedy_auto_equals_autoregressive_with_real_and_cycling_plans(monkeypatch):
    engine, prompt = tiny_engine()
    base = dict(greedy=True, max_new_tokens=40, budget=8, chunk_size=4, sink_tokens=4, window_tokens=12)
    with torch.no_grad():
        ar = next(e for e in engine.generate_ids(prompt, GenerationConfig(method="ar", **base))
                  if isinstance(e, Finished))
        auto = list(engine.generate_ids(prompt, GenerationConfig(method="auto", **base)))
        assert auto[-1].token_ids == ar.token_ids and any(isinstance(e, PlanChosen) for e in auto)
        monkeypatch.setattr(core.triforce, "Planner", Cycling)
        for drafter in ("model", "ngram", "none"):
            events = list(engine.generate_ids(prompt, GenerationConfig(method="auto", drafter=drafter, **base)))
            plans = {e.plan for e in events if isinstance(e, PlanChosen)}
            assert events[-1].token_ids == ar.token_ids and len(plans) >= 3, drafter


def test_switching_hierarchies_every_round_is_lossless(monkeypatch, one_thread):
    engine, prompt = tiny_engine()
    monkeypatch.setattr(core.triforce, "Planner", Cycling)
    with torch.no_grad():
        expected = target_pairs(engine, prompt)
        counts, levels = emitted_pairs(engine, prompt, GATED_DRAWS, method="auto")
    assert 0 < levels["l2_accepted"] < levels["l2_proposed"] and 0 < levels["l1_accepted"] < levels["l1_proposed"]
    p_ok = chi_square_p(counts, expected, GATED_DRAWS)
    assert p_ok > 1e-3, f"switching sampler rejected (p={p_ok:.2e})"
