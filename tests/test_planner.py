"""Method auto: its cost model (pure arithmetic over step costs and acceptances), its estimator (fitted step-cost
lines, Beta acceptances, the cost book carried between runs), its policy (measure, weigh, switch only for a clear
gain), checked as properties, on the regimes bench.simulate replays, and inside the engine (exact while it switches:
greedy token-identical to autoregressive, the sampled distribution the target's)."""

import argparse
import json
import random
import time
from dataclasses import replace

import pytest
import torch

import core.engine
from bench.common import RESULTS
from bench.planner import Scenario, scenario
from bench.simulate import batch_profiles, profiles, simulate, simulate_batch
from core.config import GenerationConfig
from core.decode.drafters import NgramDrafter
from core.decode.graphs import Graphs
from core.decode.round import AUTOREGRESSIVE, Forwards, Hierarchy, RoundRecord
from core.decode.triforce import SHADOW_GAMMA
from core.events import Finished, PlanChosen
from core.model.transformer import Transformer
from core.plan.cost import Drafter, Figures, Line, best, candidates, expected_tokens, rate
from core.plan.estimate import (CARRIED_WEIGHT, PRIOR_WEIGHT, RECENT, CostBook, Drafting, Estimate, Estimates,
                                Regime, StepCurve, fit, prior)
from core.plan.policy import MAX_SWITCHES, MIN_ROUNDS, SETTLE_MS, WEIGH_EVERY_MS, WEIGH_MOST_MS, Auto
from tests.lossless import CFG, GATED_DRAWS, emitted_pairs, target_pairs, tiny_engine
from tests.stats import chi_square_p

DRAFT = ["model"]
ON_CHIP, OFFLOADED = Regime(False, 14, False), Regime(True, 17, False)


def figures(level1: float | None, level2: float | None, level3: Line, a1: float = 0.5, a2: float = 0.9,
            **more) -> Figures:
    """Figures with the draft model at `level1` ms a token and a level-2 forward of `level2` ms whatever its rows."""
    drafters = {"model": Drafter(level1, a1, a1, 1.0)} if level1 is not None else {}
    step = Line(level2) if level2 is not None else None
    return Figures(level3, step, step, drafters=drafters, a2=a2, **more)


def record(h: Hierarchy, rows: int, level3_ms: float, level2: tuple[int, int, float] | None = None,
           accepted: int | None = None, **more) -> RoundRecord:
    """A round of `h` verifying rows - 1 drafts, `accepted` of them (default: all); `level2`: (forwards, rows each,
    ms in all)."""
    forwards = [Forwards(level2[0], level2[1], level2[2], chained=not h.level1)] if level2 else []
    return RoundRecord(h, rows=rows, drafted=rows - 1, accepted=rows - 1 if accepted is None else accepted,
                       level3_ms=level3_ms, level3_wall_ms=level3_ms, level2=forwards, **more)


# The cost model


def test_expected_tokens_of_a_verification_follow_the_geometric_series():
    assert expected_tokens(0.0, 6) == 1.0
    assert expected_tokens(1.0, 6) == 7.0
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)


def test_acceptance_counts_only_the_drafts_that_were_verified():
    a = Estimate(0.0, 0.0)
    a.add(proposed=6, accepted=2)  # the third was rejected, the last three never verified
    a.add(proposed=6, accepted=6)
    assert (a.verified, a.accepted) == (9, 8)


def test_drafting_ahead_hides_level_2_behind_a_streamed_verification_as_often_as_level_3_accepts_the_draft_and_guess():
    """A streamed verification of 13 rows takes 17 ms, a level-2 forward 2 ms: drafting 12 tokens (24 ms) before each
    verification, a round takes 41 ms; drafting ahead, a round waits for its own drafting only when level 3 rejected
    part of the last draft or the guess after it (1 - a2^12 * guess of rounds), and for the longer of the
    verification and the next round's drafting (with the guess's forward)."""
    h = Hierarchy("", True, 0, 12)
    for a2, guess in ((1.0, 1.0), (0.9, 0.9), (0.9, 0.5)):
        f = figures(None, 2.0, Line(17.0), a2=a2, guess=guess)
        tokens = expected_tokens(a2, 12)
        assert rate(h, f) == pytest.approx(tokens / 41.0)
        assert rate(replace(h, ahead=True), f) == pytest.approx(tokens / ((1 - a2 ** 12 * guess) * 24.0 + 26.0))
    # drafting ahead, the best plan expects more and drafts less a round: a draft made ahead stands only when level 3
    # accepted all of the one before, less likely the longer it is
    f = figures(None, 2.0, Line(16.0, 2.0 / 31), a2=0.95, guess=0.95)
    (ahead, r_ahead), (plain, r_plain) = best(candidates([], 2, 31, ahead=True), f), best(candidates([], 2, 31), f)
    assert ahead.ahead and r_ahead > r_plain and ahead.gamma2 < plain.gamma2


def test_drafting_ahead_pays_what_follows_level_3s_pass_after_the_longer_of_pass_and_drafting():
    """Level 3's head, distributions and verification wait for the pass and the drafting made beside it: a round whose
    drafting ahead (26 ms) outlasts the pass costs 26 ms and what follows the pass (2 ms)."""
    h = Hierarchy("", True, 0, 12, ahead=True)
    assert rate(h, figures(None, 2.0, Line(19.0), a2=1.0, guess=1.0)) == pytest.approx(13 / 26.0)
    assert rate(h, figures(None, 2.0, Line(19.0), a2=1.0, guess=1.0, post=2.0)) == pytest.approx(13 / 28.0)


def test_a_level_2_forward_is_priced_by_the_rows_it_feeds():
    """A forward checking γ1 level-1 tokens feeds γ1 + 1 rows: where each row costs (a CPU), checking two tokens per
    forward costs more than checking one, and the cost model weighs them apart."""
    level2 = Line(10.0, 5.0)
    f = Figures(Line(40.0, 8.0), level2, level2, drafters={"model": Drafter(1.0, 0.6, 0.6, 1.0)}, a2=0.9)
    one, two = Hierarchy("model", True, 1, 6), Hierarchy("model", True, 2, 6)
    per_forward = {h: expected_tokens(0.6, h.gamma1) for h in (one, two)}
    drafting = {h: 6 * (level2(h.gamma1 + 1) + h.gamma1) / per_forward[h] for h in (one, two)}
    for h in (one, two):
        assert rate(h, f) == pytest.approx(expected_tokens(0.9, 6) / (drafting[h] + f.level3(7)))


def test_autoregressive_wins_where_no_speculative_candidate_gains_its_cost():
    """A small model on a CPU: a retrieval step costs 95 % of a full one, the draft 40 %, acceptance modest."""
    f = figures(4.0, 9.5, Line(8.67, 1.33, 0.0), a1=0.4, a2=0.7)
    h, r = best(candidates(DRAFT, 2, 15), f)
    assert h == AUTOREGRESSIVE and r == pytest.approx(1 / 10.0)


def test_triforce_wins_where_the_full_step_dominates():
    """A long cache offloaded: the full step 300 ms, the retrieval one 8 ms, the draft 1 ms."""
    f = figures(1.0, 8.0, Line(300.0, 5.0 / 12), a1=0.6, a2=0.9)
    h, r = best(candidates(DRAFT, 2, 15), f)
    assert h.level1 and h.level2 and h.gamma2 >= 10 and r > 5 * rate(AUTOREGRESSIVE, f)


def test_two_model_speculation_wins_where_the_retrieval_level_saves_nothing():
    f = figures(1.0, 9.8, Line(10.0, 0.5 / 6), a1=0.8, a2=0.95)
    h, _ = best(candidates(DRAFT, 2, 15), f)
    assert h.level1 and not h.level2


def test_prompt_lookup_drafts_where_it_gives_more_tokens_per_millisecond_than_the_draft_model():
    """The real pair offloaded at 30K: a pass 17.5 ms, a level-2 step 2.6 ms, a draft-model token 1.2 ms accepted at
    0.6; prompt lookup costs microseconds a token, proposes for half the tokens asked and is accepted at 0.3. Lookup's
    tokens come nearly free, so they win; where it seldom finds a match, the model does."""
    f = figures(1.2, 2.6, Line(17.5, 0.5 / 15), a1=0.6, a2=0.95)
    lookup = replace(f, drafters={**f.drafters, "ngram": Drafter(0.003, 0.3, 0.3, 0.5)})
    both = ["model", "ngram"]
    h, r = best(candidates(both, 2, 15), lookup)
    assert h.level1 == "ngram" and h.level2 and r > best(candidates(DRAFT, 2, 15), lookup)[1]
    rare = replace(f, drafters={**f.drafters, "ngram": Drafter(0.003, 0.3, 0.3, 0.02)})
    assert best(candidates(both, 2, 15), rare)[0].level1 == "model"


# The estimator


def random_points(rng: random.Random) -> dict[int, tuple[float, int]]:
    """A few measured sizes of a step: costs along a line (or flat, or jagged), a few samples each."""
    fixed, slope = rng.uniform(1, 300), rng.choice([0.0, rng.uniform(0, 5)])
    sizes = rng.sample(range(1, 33), rng.randint(1, 6))
    return {r: (fixed + slope * r + rng.uniform(-0.1, 0.1) * fixed, rng.randint(1, RECENT)) for r in sizes}


def test_a_step_s_fitted_cost_never_falls_as_rows_grow():
    rng = random.Random(0)
    for _ in range(500):
        prior = fit(random_points(rng), None) if rng.random() < 0.5 else None
        line = fit(random_points(rng), prior)
        costs = [line(r) for r in range(1, 33)]
        assert all(a <= b + 1e-9 for a, b in zip(costs, costs[1:])), (line, costs)


def test_one_stray_sample_moves_no_fitted_cost():
    """A stall (a GC pause, the other thread) or a first use's one-time work only ever adds time: one such sample, at
    a size already measured or a new one, leaves every size's cost where it was, given a few samples of sizes that
    span a quarter of a decode step."""
    rng = random.Random(1)
    for _ in range(300):
        fixed, slope = rng.uniform(1, 300), rng.uniform(0, 3)
        curve = StepCurve()
        sizes = rng.sample(range(1, 33), rng.randint(2, 5))
        while max(sizes) - min(sizes) < 8:
            sizes = rng.sample(range(1, 33), len(sizes))
        for size in sizes:
            for _ in range(3):
                curve.add(size, (fixed + slope * size) * rng.uniform(0.98, 1.02))
        before = curve.line()
        curve.add(rng.randint(1, 32), (fixed + slope * 32) * rng.uniform(2, 20))
        after = curve.line()
        for rows in range(1, 33):
            assert after(rows) == pytest.approx(before(rows), rel=0.05), (rows, before, after)


def test_a_lasting_change_in_a_step_s_cost_is_taken_up_within_a_few_rounds():
    curve = StepCurve()
    for _ in range(RECENT):
        curve.add(7, 20.0)
    for rounds in range(1, RECENT + 1):
        curve.add(7, 30.0)
        if curve.line()(7) == 30.0:
            break
    assert rounds <= RECENT // 2 + 1


def test_the_first_step_measured_shifts_a_prior_from_another_kind_of_run():
    """A prior (another prompt length's line) gives the slope; the first step measured here sets the level."""
    prior_line = fit({1: (10.0, 9), 13: (16.0, 9)}, None)
    here = fit({1: (40.0, 1)}, prior_line)
    assert here(1) == pytest.approx(40.0) and here(13) - here(1) == pytest.approx(prior_line(13) - prior_line(1))


def test_a_one_row_step_keeps_its_own_cost_beside_the_line_of_larger_steps():
    """On a GPU a one-row decode step takes a cheaper path (2.16 ms on the real pair at 30K, where 2 rows cost 2.56
    and 32 rows 3.82): the line through the larger steps prices them, the one-row step stays what it was measured."""
    line = fit({1: (2.16, 9), 2: (2.56, 9), 7: (2.93, 9), 32: (3.82, 9)}, None)
    assert line(1) == pytest.approx(2.16) and line(32) == pytest.approx(3.82, rel=0.05) and line(2) > line(1)


def test_a_level_one_token_costs_the_mix_of_copied_and_drafted_tokens_and_one_stall_does_not_steer_it():
    """A drafter that copies most tokens (next to free) and drafts some with its model (a forward each) costs their
    mix per token, not the commoner kind's cost; a single stalled round still leaves the cost where it was."""
    d = Drafting()
    for i in range(9):  # every third round the draft model drafts its 6 tokens, the others copy them
        d.timed(6, 7.2 if i % 3 == 2 else 0.3)
    assert d.ms == pytest.approx((6 * 0.3 + 2 * 7.2) / (8 * 6))  # the costliest round left out
    steady = Drafting()
    for ms in (1.0, 1.0, 50.0, 1.0):
        steady.timed(2, 2 * ms)
    assert steady.ms == 1.0


def test_an_unmeasured_kind_of_level_2_forward_is_bounded_by_the_other():
    """A chained forward costs at most a looped one; a forward beside level 3's pass is priced at its own speed until
    measured; once measured each kind has its own cost."""
    e = Estimates()
    e.observe(record(Hierarchy("ngram", True, 2, 4), 5, 18.0, level2=(2, 3, 5.0)))
    f = e.figures()
    assert f.chained(1) == f.level2(1) and f.level2_beside(3) == f.level2(3)
    e.observe(record(Hierarchy("", True, 0, 4), 5, 18.0, level2=(4, 1, 6.0)))
    assert e.figures().chained(1) == pytest.approx(1.5) and e.figures().level2(3) == pytest.approx(2.5)


# The cost book


def book_with(regime: Regime, budget: int, *records: RoundRecord, drafters=()) -> CostBook:
    book = CostBook()
    e = book.estimates(regime, budget, drafters)
    for r in records:
        e.observe(r)
    book.learn(regime, budget, e)
    return book


def test_the_cost_book_keeps_greedy_and_sampled_runs_apart():
    """A sampled row pays for its distribution, a greedy one does not: greedy figures are a sampled run's prior only
    until it measures its own, and a sampled run's figures leave the greedy ones as they were."""
    greedy, sampled = Regime(False, 10, True), Regime(False, 10, False)
    book = book_with(greedy, 512, record(AUTOREGRESSIVE, 1, 4.0), record(Hierarchy("", True, 0, 6), 7, 9.0))
    e = book.estimates(sampled, 512)
    assert e.line("level3")(7) == pytest.approx(9.0) and not e.curves["level3"].measured
    for _ in range(3):
        e.observe(record(Hierarchy("", True, 0, 6), 7, 18.0))
    book.learn(sampled, 512, e)
    assert book.estimates(sampled, 512).line("level3")(7) == pytest.approx(18.0)
    assert book.estimates(greedy, 512).line("level3")(7) == pytest.approx(9.0)


def test_a_run_starts_from_the_acceptance_the_last_run_of_its_kind_saw():
    """Priors for a first run; a later run of the same kind starts from the rates the last one observed, worth no more
    than CARRIED_WEIGHT observations (an autoregressive run in between, which observed none, changes nothing)."""
    book, default = CostBook(), Estimates()
    first = book.estimates(ON_CHIP, 512, DRAFT)
    assert first.a2.rate == default.a2.rate
    first.a2.add(proposed=100, accepted=100)
    book.learn(ON_CHIP, 512, first)
    book.learn(ON_CHIP, 512, Estimates())
    second = book.estimates(ON_CHIP, 512, DRAFT)
    assert second.a2.rate == pytest.approx(first.a2.rate) and second.a2.verified == CARRIED_WEIGHT
    assert book.estimates(ON_CHIP, 1024, DRAFT).a2.rate == default.a2.rate  # another budget: its own kind
    assert book.estimates(ON_CHIP._replace(greedy=True), 512, DRAFT).a2.verified == PRIOR_WEIGHT  # borrowed


def test_prompt_lookup_borrows_its_lower_acceptance_of_the_two_nearest_kinds_and_a_draft_model_its_document_s():
    """Random weights decoded greedily repeat themselves, so prompt lookup matched most greedy answers on a document
    where sampled ones rarely quote it. Measured in passing by every run, prompt lookup borrows the lower of the two
    nearest kinds' figures; the draft model, measured only by drafting, borrows the document's."""
    book = CostBook()
    for regime, accepted in ((Regime(False, 13, True), 10), (Regime(False, 10, False), 0)):
        e = book.estimates(regime, 1024, ["model", "ngram"])
        for name in ("ngram", "model"):
            for _ in range(20):
                e.level1[name].shadowed(asked=10, proposed=10, accepted=accepted)
        book.learn(regime, 1024, e)
    first_sampled = book.estimates(Regime(False, 13, False), 1024, ["model", "ngram"], shadowed=["ngram"])
    assert first_sampled.level1["ngram"].a13.rate < 0.3 < 0.8 < first_sampled.level1["model"].a13.rate
    greedy_again = book.estimates(Regime(False, 13, True), 1024, ["model", "ngram"], shadowed=["ngram"])
    assert greedy_again.level1["ngram"].a13.rate > 0.8  # its own kind's figure, not a borrowed one


def test_a_first_run_at_a_new_prompt_length_spends_no_round_on_measuring():
    """The nearest length's costs stand in: a first auto run on a new document starts as a second one would."""
    h = Hierarchy("model", True, 2, 6)
    short = record(h, 7, 6.0, level2=(3, 3, 6.0), level1_asked=6, level1_ms=6.0)
    book = book_with(Regime(False, 10, False), 512, record(AUTOREGRESSIVE, 1, 4.0), short, drafters=DRAFT)
    p = Auto(book.estimates(Regime(False, 13, False), 512, DRAFT), DRAFT, 2, 15)
    p.choose()
    assert not p.measuring


def test_a_fixed_triforce_run_gives_method_auto_the_acceptances_it_saw():
    """The warm-up's runs and Compare clicks of method triforce run a fixed hierarchy: what its levels accepted
    becomes the next auto run's prior, so that a first auto request does not start from the defaults."""
    engine, prompt = tiny_engine()
    cfg = GenerationConfig(**{**CFG, "max_new_tokens": 40}, seed=0).validate()
    with torch.no_grad():
        stats = [e for e in engine.generate_ids(prompt, cfg) if isinstance(e, Finished)][0].stats
    regime = Regime.of(False, len(prompt), False)
    learnt = engine.costs.estimates(regime, cfg.budget, DRAFT)
    defaults = Estimates()
    for seen, rate_, default in ((stats.level1_acceptance, learnt.level1["model"].a1.rate, Drafting().a1.rate),
                                 (stats.level2_acceptance, learnt.a2.rate, defaults.a2.rate)):
        assert abs(seen - default) > 0.1 and abs(rate_ - seen) < abs(default - seen) / 2, (seen, rate_, default)


def test_a_run_whose_budget_covered_the_prompt_leaves_no_level_2_acceptance_for_a_longer_one():
    """Level 2 holding the whole prompt drafts as level 3 would decide: its acceptance there (near 1) is no prior for
    a document retrieval must cut, which then starts from the default; a run that cut it does leave its own."""
    engine, prompt = tiny_engine()
    for budget, leaves in ((64, False), (CFG["budget"], True)):  # the 48-token prompt in budget, then cut to 8
        cfg = GenerationConfig(**{**CFG, "max_new_tokens": 24, "budget": budget}, seed=0).validate()
        with torch.no_grad():
            stats = [e for e in engine.generate_ids(prompt, cfg) if isinstance(e, Finished)][0].stats
        assert stats.level2_verified > 0
        prior_a2 = engine.costs.estimates(Regime.of(False, 4 * len(prompt), False), budget, DRAFT).a2
        assert (prior_a2.rate != Estimates().a2.rate) == leaves, (budget, stats.level2_acceptance, prior_a2)


# The policy


def known(level1: float, level2: float, level3: dict[int, float], a1: float, a2: float) -> Estimates:
    """Estimates with these costs measured (several samples each) and acceptances seen over a hundred drafts."""
    e = Estimates(a2=Estimate(100.0, 100.0 * a2))
    e.level1["model"] = Drafting(level1, Estimate(100.0, 100.0 * a1))
    for rows, ms in level3.items():
        for _ in range(3):
            e.curves["level3"].add(rows, ms)
    for _ in range(3):
        e.curves["level2"].add(3, level2)
    return e


def test_the_planner_measures_first_then_switches_only_for_a_clear_gain():
    p = Auto(Estimates(), DRAFT, 2, 15, caution=0.0)
    first = p.choose()
    assert first.level1 and first.level2 and first.gamma2 == 1 and p.measuring
    p.observe(record(first, 2, 12.0, level2=(1, 3, 9.5), level1_asked=2, level1_ms=2.0))
    assert p.choose() == AUTOREGRESSIVE and p.measuring  # the one-row step is measured next
    p.observe(record(AUTOREGRESSIVE, 1, 10.0))
    chosen = p.choose()
    assert not p.measuring and "autoregressive" in p.reason
    for _ in range(MIN_ROUNDS - 1):  # not settled yet: kept, whatever the estimates say
        p.observe(record(chosen, chosen.gamma2 + 1, 10.0))
        assert p.choose() == chosen


def test_a_plan_that_keeps_winning_is_weighed_at_doubling_intervals_and_a_switch_starts_them_again(monkeypatch):
    """Each weighing that keeps the plan doubles the decoding time before the next, up to WEIGH_MOST_MS; a switch
    starts again at WEIGH_EVERY_MS."""
    elapsed, weighed, weigh = 0.0, [], core.plan.policy.best

    def counted(options, f):
        weighed.append(elapsed)
        return weigh(options, f)

    monkeypatch.setattr(core.plan.policy, "best", counted)
    p = Auto(known(0.9, 0.95, {1: 1.0, 7: 1.2}, a1=0.3, a2=0.5), DRAFT, 2, 31)
    while elapsed < 700:
        assert p.choose() == AUTOREGRESSIVE
        p.observe(record(AUTOREGRESSIVE, 1, 1.0))
        elapsed += 1.0
    gaps = [b - a for a, b in zip(weighed, weighed[1:])]
    assert gaps[:5] == [WEIGH_EVERY_MS, 2 * WEIGH_EVERY_MS, 4 * WEIGH_EVERY_MS, 8 * WEIGH_EVERY_MS, WEIGH_MOST_MS]
    assert set(gaps[4:]) == {WEIGH_MOST_MS}
    p.estimates.curves["level2"] = StepCurve(Line(0.1))
    p.estimates.a2 = Estimate(100.0, 99.0)  # level 2 → 3 now far faster
    while p.choose() == AUTOREGRESSIVE:
        p.observe(record(AUTOREGRESSIVE, 1, 1.0))
        elapsed += 1.0
    switched = weighed[-1]
    assert switched - weighed[-2] == WEIGH_MOST_MS
    while len(weighed) < len(gaps) + 3:
        p.observe(record(p.current, 32, 1.5, level2=(1, 1, 0.1)))
        elapsed += 1.6
        p.choose()
    assert weighed[-1] - switched == pytest.approx(WEIGH_EVERY_MS, abs=1.6)


def lookup_planner(switches: int = 0) -> tuple[Auto, Hierarchy]:
    """Prompt lookup as level 1 (nearly free, prior acceptance 0.5), no level 2, a 7-row step 10 % dearer than a
    one-row one: it starts drafting."""
    e = known(0.01, 1.0, {1: 1.0, 7: 1.1}, a1=0.5, a2=0.9)
    e.level1["model"].a1 = prior(0.5)
    p = Auto(e, DRAFT, 2, 6, level2=False, caution=0.0)
    p.switches = switches
    return p, p.choose()


def rejected_rounds(p: Auto, h: Hierarchy, rounds: int) -> list[tuple[Hierarchy, bool]]:
    """`rounds` rounds at their expected costs with every draft rejected; the plans they ran, each with whether it
    was then expected slower than autoregressive decoding."""
    plans = []
    for _ in range(rounds):
        r = record(h, h.gamma2 + 1, p.estimates.line("level3")(h.gamma2 + 1), accepted=0, level1_asked=h.gamma2,
                   level1_ms=0.01 * h.gamma2)
        if h.gamma2:
            r.level1_checks.append((3, h.gamma2, h.gamma2, 0))
        p.observe(r)
        plans.append((h, rate(h, p.figures()) < rate(AUTOREGRESSIVE, p.figures())))
        h = p.choose()
    return plans


def test_a_plan_expected_slower_than_autoregressive_is_left_within_min_rounds_however_fast_its_rounds():
    p, first = lookup_planner()
    assert first.level1 and first.gamma2 > 1
    below = longest = 0
    for _, slower in rejected_rounds(p, first, 60):
        below = below + 1 if slower else 0
        longest = max(longest, below)
    assert p.current != first and longest <= MIN_ROUNDS


def test_out_of_switches_the_planner_still_returns_to_autoregressive_decoding_and_nowhere_else():
    p, first = lookup_planner(switches=MAX_SWITCHES)
    plans = {h for h, _ in rejected_rounds(p, first, 60)}
    assert p.current == AUTOREGRESSIVE and plans == {first, AUTOREGRESSIVE}


def test_a_plan_of_slow_rounds_is_weighed_again_after_one_round_and_a_fast_one_after_min_rounds():
    """Offloaded at 120K a round takes ~0.3 s: SETTLE_MS of decoding is evidence enough; 10 ms rounds wait for
    MIN_ROUNDS."""
    for round_ms, expected in ((300.0, 1), (10.0, MIN_ROUNDS)):
        p = Auto(known(0.9 * round_ms, 0.95 * round_ms, {1: round_ms, 7: 1.2 * round_ms}, a1=0.3, a2=0.5), DRAFT,
                 2, 31)
        assert p.choose() == AUTOREGRESSIVE
        p.estimates.curves["level2"] = StepCurve(Line(0.1 * round_ms))
        p.estimates.a2 = Estimate(100.0, 99.0)  # now level 2 pays
        rounds = 0
        while p.choose() == AUTOREGRESSIVE:
            p.observe(record(AUTOREGRESSIVE, 1, round_ms))
            rounds += 1
        assert rounds == expected and p.current.level2, (round_ms, rounds)
    assert SETTLE_MS <= 300.0 and 10.0 * MIN_ROUNDS < SETTLE_MS


def test_with_the_full_cache_streamed_the_planner_takes_the_verification_for_an_autoregressive_step():
    """Offloaded, an autoregressive step would cost a whole pass over the cache for one token: it is not measured."""
    p = Auto(Estimates(), DRAFT, 2, 15, streamed=True)
    first = p.choose()
    p.observe(record(first, 2, 1000.0, level2=(1, 3, 100.0), level1_asked=2, level1_ms=2.0))
    chosen = p.choose()
    assert chosen != AUTOREGRESSIVE and chosen.level2 and not p.measuring
    assert p.estimates.line("level3").one_row_saving is None


def test_level_2_drafting_alone_is_measured_by_the_best_plan_drafting_alone_where_a_level_2_step_is_cheap():
    """Where forwards chain and a level-2 step costs under half a full one, the planner measures drafting alone with
    the plan that would draft alone best at a looped forward's cost; where a step costs about a full one, never."""
    for full, measures in ((5.0, False), (18.0, True)):
        p = Auto(Estimates(), ["ngram"], 2, 31, streamed=True, ahead=True, chained=True)
        first = p.choose()
        p.observe(record(first, 2, full, level2=(2, 3, 5.4), level1_asked=2, level1_ms=0.02))
        h = p.choose()
        assert (not h.level1 and h.level2 and h.gamma2 > 1) == measures and p.measuring == measures


def test_a_plan_is_weighed_at_acceptances_below_what_few_observations_show():
    """The same rate seen over few drafts counts for less than over many: an acceptance carried from one lucky answer
    does not start a run on the longest draft that it would pay at face value."""
    f = Line(17.5, 1.4 / 31)

    def plan(seen: float) -> Hierarchy:
        e = Estimates(a2=Estimate(seen, 0.99 * seen), guess=Estimate(seen, 0.8 * seen))
        for rows in (1, 32):
            e.curves["level3"].add(rows, f(rows))
        e.curves["level2"].add(3, 2.5)
        e.curves["chained"].add(1, 1.7)
        e.overhead.add(0.3)
        return Auto(e, [], 2, 31, streamed=True).choose()

    assert plan(10_000.0).gamma2 == 31 and plan(16.0).gamma2 < 31


def test_without_a_drafter_and_with_the_whole_prompt_in_budget_no_level_drafts():
    p = Auto(Estimates(), [], 2, 15, level2=False)
    assert p.choose() == AUTOREGRESSIVE and "covers the whole prompt" in p.reason
    p = Auto(Estimates(), DRAFT, 2, 15, level2=False)
    assert p.choose() == Hierarchy("model", False, 0, 1) and p.measuring
    assert not any(h.level2 for h in p.options)


# On the recorded regimes (bench.simulate)


@pytest.mark.parametrize("profile", profiles(), ids=lambda p: p.name)
def test_on_every_recorded_regime_auto_is_never_slower_than_autoregressive_nor_than_the_planner_it_replaced(profile):
    """Simulated on each regime bench/results recorded (bench.simulate's seeds, deterministic), on a first answer and
    on one after another answer's luckier acceptances: method auto keeps within 3 % of autoregressive decoding where
    nothing pays, and of the planner it replaced wherever that planner's rates were recorded on this very profile
    (the same seeds; a regime re-recorded since has none)."""
    r = simulate(profile, seeds=20, tokens=128, fixed=False)
    for s in (r, r["second_answer"]):
        assert s["auto_over_ar"] >= 0.97 and s.get("new_over_old", 1.0) >= 0.97, r


@pytest.mark.parametrize("profile", batch_profiles(), ids=lambda p: p.name)
def test_on_every_recorded_batch_auto_keeps_up_with_autoregressive_and_the_best_fixed_draft(profile):
    """Simulated on each batched setting bench/results recorded (its rounds' costs; random weights also at a real
    model's acceptance), on a first batch after the engine's warm-up and on a next one: the batch's method auto keeps
    within 3 % of batched autoregressive decoding and within 10 % of the best fixed γ2 in hindsight."""
    r = simulate_batch(profile, seeds=10, tokens=128)
    for s in (r, r["second_batch"]):
        assert s["auto_over_ar"] >= 0.97 and s["auto_over_best_fixed"] >= 0.9, r


# On the real-weight traces bench.planner recorded (bench/results/planner-real-<device>.json)

REGRET_COMMAND = ("python -m bench.planner --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b "
                  "--regimes onchip-30k offload-30k --record")


def noise_floor(cases: list[dict]) -> float:
    """The lowest ratio two runs of one plan gave on the machine that recorded `cases` (one file): where method auto
    ran autoregressive decoding throughout, its run and AR's are the same plan run twice, so their ratio is the
    machine's run-to-run noise (the planner's own time, which it adds, is checked apart); which of the two ran first
    is no property of the plan, so a ratio r says 1/r as well. 1.0 where no case ran the same plan twice: the
    file then shows no noise to allow for."""
    same = [c["auto_over_ar"] for c in cases if c["auto_plans"] == ["autoregressive"]]
    return min([1.0, *(min(r, 1.0 / r) for r in same)])


def recorded_cases(on_gpu: bool) -> list:
    """Every recorded case of the CPU's trace files or the GPUs', each its own parameter with its file's noise
    floor; none recorded: one parameter that skips and says how to record them."""
    files = [f for f in sorted(RESULTS.glob("planner-real-*.json")) if f.stem.endswith("-cpu") != on_gpu]
    cases = []
    for f in files:
        regimes = json.loads(f.read_text())["regimes"]
        floor = noise_floor([c for entry in regimes.values() for c in entry["cases"]])
        cases += [pytest.param(c, floor, id=f"{f.stem.removeprefix('planner-real-')} {regime} {c['doc']} "
                                            f"{c['sampling']} {c['new_tokens']} {c['answer']}")
                  for regime, entry in regimes.items() for c in entry["cases"]]
    where = "a GPU" if on_gpu else "a CPU"
    return cases or [pytest.param(None, 1.0, marks=pytest.mark.skip(
        reason=f"no real-weight trace recorded on {where} yet: {REGRET_COMMAND}"), id=f"none on {where}")]


@pytest.mark.parametrize("case, floor", recorded_cases(on_gpu=True) + recorded_cases(on_gpu=False))
def test_on_every_recorded_real_weight_case_auto_keeps_up_with_autoregressive_and_the_best_fixed_plan(case, floor):
    """Measured on real weights, each document, sampling and answer length, on a first answer and after another:
    method auto within 3 % of autoregressive decoding and within 10 % of the fastest fixed plan in hindsight, beyond
    what the recording machine's own noise can say (`floor`: the lowest ratio two runs of one plan gave in the same
    file; every run, the fixed plans' too, is one run on that machine). What auto adds of its own, the time its
    rounds leave to the planner and the events, stays within the same 3 %."""
    auto = case["runs"]["auto"]
    assert auto["outside_rounds_ms"] <= 0.03 * auto["new_tokens"] * auto["ms_per_token"], auto["outside_rounds_ms"]
    assert case["auto_over_ar"] >= 0.97 * floor, (floor, case["auto_plans"])
    assert case["auto_over_best_fixed"] >= 0.9 * floor, (floor, case["best_fixed"], case["auto_plans"])


def test_a_regime_s_name_says_its_prompt_length_its_requests_and_where_its_cache_lives():
    assert scenario("cpu-onchip-4k") == Scenario("cpu-onchip-4k", 4000, 1, offload=False)
    assert scenario("offload-124k") == Scenario("offload-124k", 124000, 1, offload=True)
    assert scenario("batch-8x30k") == Scenario("batch-8x30k", 30000, 8, offload=False)
    with pytest.raises(argparse.ArgumentTypeError):
        scenario("onchip")


# Inside the engine


def test_graph_captures_are_not_counted_in_the_costs_the_planner_weighs(monkeypatch):
    """A step shape's first use captures a CUDA graph (and compiles: seconds on a GPU): warm-up, not a level's cost.
    Here every first use of a (cache, step size) takes a second and reports it as a capture, as Graphs does: no cost
    the planner weighs holds one (a tiny model's steps take milliseconds, even on a loaded machine)."""
    engine, prompt = tiny_engine()
    engine.graphs = Graphs()
    step, seen = Transformer.step, set()

    def capturing_step(model, ids, cache, *args, **kwargs):
        if (id(cache), len(ids)) not in seen:
            seen.add((id(cache), len(ids)))
            time.sleep(1.0)
            engine.graphs.capture_s += 1.0
        return step(model, ids, cache, *args, **kwargs)

    monkeypatch.setattr(Transformer, "step", capturing_step)
    base = dict(greedy=True, max_new_tokens=24, budget=8, chunk_size=4, sink_tokens=4, window_tokens=12)
    with torch.no_grad():
        for method in ("ar", "auto"):
            list(engine.generate_ids(prompt, GenerationConfig(method=method, **base)))
    measured = engine.costs.figures()
    assert len(seen) > 4 and measured and max(measured) < 500.0, measured


class Autoregressive(Auto):
    """Method auto decoding autoregressively throughout (what it does on a CPU at 8K)."""

    def _choose(self) -> Hierarchy:
        self.reason, self.current = "stays autoregressive", AUTOREGRESSIVE
        return AUTOREGRESSIVE


def test_auto_learns_prompt_lookup_s_figures_from_rounds_it_did_not_draft(monkeypatch):
    """Prompt lookup is asked in passing what it would have drafted, its proposals checked against the tokens level 3
    emits: a run that never drafted with it ends with its acceptance and cost, the same as replaying the answer
    through a fresh lookup as levels 1 → 3 at γ SHADOW_GAMMA would have (a proposal spans rounds: here, one-token
    autoregressive rounds)."""
    engine, prompt = tiny_engine()
    monkeypatch.setattr(core.engine, "Auto", Autoregressive)
    cfg = GenerationConfig(method="auto", drafter="auto", greedy=True, max_new_tokens=40, budget=8, chunk_size=4,
                           sink_tokens=4, window_tokens=12).validate()
    with torch.no_grad():
        events = list(engine.generate_ids(prompt, cfg))
    ids = events[-1].token_ids
    assert {e.plan for e in events if isinstance(e, PlanChosen)} == {"autoregressive"}
    replay, checks, tokens, matched = NgramDrafter(cfg.ngram_max, prompt), [], None, 0
    for i, token in enumerate(ids):
        if tokens is None:
            tokens, matched = replay.propose(prompt + ids[:i], SHADOW_GAMMA, len(prompt) + i).tokens, 0
        if matched < len(tokens) and tokens[matched] == token:
            matched += 1
        else:
            checks.append((len(tokens), matched))
            tokens = None
    assert any(0 < m < n for n, m in checks) and any(m == n > 1 for n, m in checks)  # later tokens count too
    ngram = engine.costs.estimates(Regime.of(False, len(prompt), True), cfg.budget, ["model", "ngram"]).level1["ngram"]
    default = Drafting()
    assert ngram.ms is not None and ngram.a13 is not None
    assert ngram.offered.rate == pytest.approx((default.offered.accepted + sum(n for n, _ in checks))
                                               / (default.offered.verified + SHADOW_GAMMA * len(checks)))
    verified = sum(m + (m < n) for n, m in checks)
    assert ngram.a13.rate == pytest.approx((default.a1.accepted + sum(m for _, m in checks))
                                           / (default.a1.verified + verified))


class Cycling(Auto):
    """Every round a different hierarchy, and another drafter where the run holds several, whatever was measured:
    switching is exact or nothing is. The turn is counted across runs: a run of two tokens may last one round."""

    turn = 0

    def _choose(self) -> Hierarchy:
        d = (list(self.drafters) or [""])[self.turn % max(len(self.drafters), 1)]
        plans = [AUTOREGRESSIVE, Hierarchy(d, False, 0, 3), Hierarchy("", True, 0, 2), Hierarchy(d, True, 2, 3),
                 Hierarchy(d, False, 0, 1)]
        self.reason, self.current = "cycling", plans[self.turn % len(plans)]
        Cycling.turn += 1
        return self.current


def test_auto_never_runs_level_2_when_the_budget_covers_the_prompt():
    """Level 2 would read the whole prompt, as level 3 does: no plan uses it, and greedy output stays AR's."""
    engine, prompt = tiny_engine()
    base = dict(greedy=True, max_new_tokens=24, budget=64, chunk_size=4, sink_tokens=4, window_tokens=12)
    with torch.no_grad():
        ar = list(engine.generate_ids(prompt, GenerationConfig(method="ar", **base)))[-1]
        auto = list(engine.generate_ids(prompt, GenerationConfig(method="auto", **base)))
    plans = [e for e in auto if isinstance(e, PlanChosen)]
    assert plans and not any(e.level2 for e in plans) and auto[-1].token_ids == ar.token_ids


def test_greedy_auto_equals_autoregressive_with_real_and_cycling_plans(monkeypatch):
    engine, prompt = tiny_engine()
    base = dict(greedy=True, max_new_tokens=40, budget=8, chunk_size=4, sink_tokens=4, window_tokens=12)
    with torch.no_grad():
        ar = next(e for e in engine.generate_ids(prompt, GenerationConfig(method="ar", **base))
                  if isinstance(e, Finished))
        auto = list(engine.generate_ids(prompt, GenerationConfig(method="auto", **base)))
        assert auto[-1].token_ids == ar.token_ids and any(isinstance(e, PlanChosen) for e in auto)
        monkeypatch.setattr(core.engine, "Auto", Cycling)
        for drafter in ("auto", "model", "ngram", "none"):
            events = list(engine.generate_ids(prompt, GenerationConfig(method="auto", drafter=drafter, **base)))
            plans = {e.plan for e in events if isinstance(e, PlanChosen)}
            assert events[-1].token_ids == ar.token_ids and len(plans) >= 3, drafter


def test_switching_hierarchies_every_round_is_lossless(monkeypatch, one_thread):
    engine, prompt = tiny_engine()
    monkeypatch.setattr(core.engine, "Auto", Cycling)
    with torch.no_grad():
        expected = target_pairs(engine, prompt)
        counts, levels = emitted_pairs(engine, prompt, GATED_DRAWS, method="auto", drafter="auto")
    assert 0 < levels["l2_accepted"] < levels["l2_proposed"] and 0 < levels["l1_accepted"] < levels["l1_proposed"]
    p_ok = chi_square_p(counts, expected, GATED_DRAWS)
    assert p_ok > 1e-3, f"switching sampler rejected (p={p_ok:.2e})"
