"""The planner of method auto: its cost model (pure functions of measured step costs and acceptance), its choices
(autoregressive where speculation cannot pay, TriForce where the full step dominates, a switch only for a clear
gain), and exactness while it switches hierarchies round by round (greedy token-identical to autoregressive, the
sampled distribution the target's)."""

import time
from dataclasses import replace

import pytest
import torch

import core.plan.planner
import core.decode.triforce
from core.config import GenerationConfig
from core.decode.graphs import Graphs
from core.decode.drafters import NgramDrafter
from core.events import Finished, PlanChosen
from core.model.transformer import Transformer
from core.plan.planner import (AUTOREGRESSIVE, CARRIED_WEIGHT, CAUTION, CHAIN_GAMMA, MAX_SWITCHES, MIN_ROUNDS,
                          PRIOR_WEIGHT, SETTLE_MS, WEIGH_EVERY_MS, WEIGH_MOST_MS, CostBook, Costs, Drafting, Estimate,
                          Estimates, Hierarchy, Planner, best, candidates, expected_tokens, prior, rate)
from core.decode.triforce import SHADOW_GAMMA
from tests.lossless import CFG, GATED_DRAWS, emitted_pairs, target_pairs, tiny_engine
from tests.stats import chi_square_p


def estimates(level1: float, level2: float, level3: dict[int, float], a1: float, a2: float) -> Estimates:
    """Costs in ms and acceptances, level 1 being the draft model."""
    return Estimates(Costs(level2, level3), prior(a2), {"model": Drafting(level1, prior(a1))})


def learnt(costs: Costs, drafter: str = "", asked: int = 0, ms: float = 0.0) -> Estimates:
    """A run's estimates: `costs`, and `drafter`'s time for `asked` tokens."""
    e = Estimates(costs)
    if drafter:
        e.level1[drafter] = Drafting()
        e.level1[drafter].timed(asked, ms)
    return e


DRAFT = ["model"]


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
    part of the last draft or emitted another token than level 2 guessed (1 - a2^12 * guess of rounds), and for
    whichever of the verification and the next round's drafting (with the guess's forward) is longer."""
    h = Hierarchy("", True, 0, 12)
    for a2, guess in ((1.0, 1.0), (0.9, 0.9), (0.9, 0.5)):
        e = Estimates(Costs(2.0, {13: 17.0}), prior(a2), guess=prior(guess))
        tokens = expected_tokens(a2, 12)
        assert rate(h, e) == pytest.approx(tokens / 41.0)
        assert rate(replace(h, ahead=True), e) == pytest.approx(tokens / ((1 - a2 ** 12 * guess) * 24.0 + 26.0))
    # with a short draft the verification is the longer: rounds whose draft was made ahead cost one pass alone
    assert rate(Hierarchy("", True, 0, 4, ahead=True), Estimates(Costs(2.0, {5: 17.0}), prior(1.0),
                                                                 guess=prior(1.0))) == pytest.approx(5 / 17.0)
    # drafting ahead, the best plan expects more and drafts less a round: a draft made ahead stands only when level 3
    # accepted all of the one before, less likely the longer it is
    e = Estimates(Costs(2.0, {1: 16.0, 32: 18.0}), prior(0.95))
    (ahead, r_ahead), (plain, r_plain) = best(candidates([], 2, 31, ahead=True), e), best(candidates([], 2, 31), e)
    assert ahead.ahead and r_ahead > r_plain and ahead.gamma2 < plain.gamma2


def test_drafting_ahead_is_weighed_with_what_level_2_costs_beside_level_3s_pass():
    """Level 3's pass streams a 7B-shape cache for 1.27 s whatever it verifies; a level-2 forward alone costs 5 ms.
    Beside the pass at that speed, long drafts made ahead hide behind it; if the pass slows level 2 twenty-fold (it
    shares the device), drafting ahead 31 tokens would outlast the pass, and the planner drafts
    after the pass instead, still at γ2 31: the pass, not the drafting, is what a round costs."""
    def costs(beside: float | None) -> Estimates:
        c = Costs(5.0, {13: 1270.0, 32: 1280.0})
        c.level2_ahead = beside
        return Estimates(c, Estimate(100.0, 98.0))

    options = candidates([], 2, 31, ahead=True)
    for beside in (None, 5.0):  # unmeasured, drafting ahead is expected at level 2's own speed
        h, _ = best(options, costs(beside))
        assert h.ahead and h.gamma2 == 31
    h, r = best(options, costs(100.0))
    assert not h.ahead and h.gamma2 == 31
    # always drafting ahead, the best it could do is short drafts that the pass still hides: γ2 12, half the rate
    only_ahead, r_ahead = best([h for h in options if h.ahead], costs(100.0))
    assert only_ahead.gamma2 == 12 and r > 1.8 * r_ahead
    c = Costs(5.0, {13: 1270.0})
    c.observe(0, 0.0, 13, 1270.0, 0.5, ahead_forwards=4, ahead_ms=400.0)  # a round whose draft was made ahead
    c.observe(12, 60.0, 13, 1270.0, 0.5)  # a round that drafted alone
    assert (c.level2, c.level2_ahead) == (5.0, 100.0)


def test_level_2_drafting_alone_is_priced_by_its_own_chained_forwards_measured_in_a_round_of_their_own():
    """On a GPU level 2 drafting alone chains its forwards on the device, cheaper than forwards that wait for a check
    of level 1 (the real Qwen pair offloaded: 2.7 ms each in that loop, 2.0 of them device work). Priced alike,
    prompt lookup's few extra tokens a forward win; priced by what each kind costs, drafting alone does. Where
    forwards chain and a level-2 step costs under half a full one, the planner measures them in a round drafting
    alone (a one-token measuring round chains nothing);
    until then they borrow the other kind's figures, beside level 3's pass slowed as that kind was; a next run of
    the kind starts from them."""
    c = Costs(2.7, {9: 18.0, 13: 18.3})
    c.level2_ahead = 3.2
    e = Estimates(c, prior(0.95), {"ngram": Drafting(0.01, prior(0.2))}, guess=prior(0.8))
    options = candidates(["ngram"], 2, 31, ahead=True)
    (borrowed, r_borrowed) = best(options, e)
    assert borrowed.level1 == "ngram"
    c.alone = 2.0
    assert c.level2_step(alone=True) == pytest.approx((2.0, 2.0 * 3.2 / 2.7))
    (alone, r_alone) = best(options, e)
    assert not alone.level1 and alone.level2 and r_alone > r_borrowed

    for chained, full in ((False, 18.0), (True, 5.0), (True, 18.0)):  # a level-2 step 2.7 ms
        p = Planner(Estimates(), ["ngram"], gamma1_max=2, gamma2_max=31, streamed=True, ahead=True, chained=chained)
        first = p.choose()
        assert first.level1 == "ngram" and p.reason.startswith("measuring")
        p.observe("ngram", 2, 0.02, 2, 5.4, first.gamma2 + 1, full, 0.5)
        h = p.choose()
        measures = chained and full == 18.0  # not where level 2 costs over half a full step: it could not pay
        assert (h == Hierarchy("", True, 0, CHAIN_GAMMA, True)) == measures
        assert p.reason.startswith("measuring") == measures
    p.observe("", 0, 0.0, CHAIN_GAMMA, 4 * 2.0, CHAIN_GAMMA + 1, 18.2, 0.5, ahead_forwards=CHAIN_GAMMA + 1,
              ahead_ms=(CHAIN_GAMMA + 1) * 2.4)
    costs = p.estimates.costs
    assert (costs.level2, costs.alone, costs.alone_ahead) == (2.7, 2.0, 2.4)
    p.choose()
    assert not p.reason.startswith("measuring")
    book = CostBook()
    book.learn(True, 30000, False, 8192, p.estimates)
    assert book.estimates(True, 30000, False, 8192, ["ngram"]).costs.level2_step(alone=True) == (2.0, 2.4)


def test_drafting_ahead_pays_what_follows_level_3s_pass_after_the_longer_of_pass_and_drafting():
    """Level 3's head, distributions and verification (2 ms of its 19 ms step) wait for the pass and for the drafting
    made beside it: a round whose drafting ahead (26 ms) outlasts the pass costs 26 + 2 ms, not 26."""
    e = Estimates(Costs(2.0, {13: 19.0}), prior(1.0), guess=prior(1.0))
    h = Hierarchy("", True, 0, 12, ahead=True)
    assert rate(h, e) == pytest.approx(13 / 26.0)
    e.costs.post = 2.0
    assert rate(h, e) == pytest.approx(13 / 28.0)
    c = Costs(2.0, {13: 19.0})
    c.observe(0, 0.0, 13, 19.0, 0.5, ahead_forwards=12, ahead_ms=24.0, post_ms=2.0)
    c.observe(12, 24.0, 13, 19.0, 0.5)  # a round drafting after the pass measures no post
    assert c.post == 2.0


def test_where_level_3_seldom_emits_level_2s_guess_the_planner_drafts_longer_rounds_than_where_it_mostly_does():
    """Sampled, level 3 emits level 2's likeliest token less often than it accepts a draft: drafts made ahead then
    stand less often, and short drafts, which only pay where they stand, lose to longer ones; a run's guesses are
    counted only after a whole draft was accepted, and the next run of its kind starts from them."""
    def plan(guess: float) -> Hierarchy:  # the real pair offloaded at 30K's figures, prompt lookup at level 1
        c = Costs(2.67, {1: 17.5, 7: 17.75, 13: 18.4, 32: 19.0}, overhead=0.5, post=1.5, level2_ahead=3.16)
        lookup = Drafting(0.0128, Estimate(100.0, 23.7), offered=Estimate(100.0, 88.0))
        e = Estimates(c, Estimate(100.0, 95.3), {"ngram": lookup}, guess=Estimate(100.0, 100.0 * guess))
        return best(candidates(["ngram"], 2, 31, ahead=True), e)[0]

    sure, unsure = plan(0.95), plan(0.5)
    assert sure.ahead and unsure.gamma2 > sure.gamma2
    planner = Planner(Estimates(), [], 0, 12, streamed=True, ahead=True)
    for hit in (True, False, False, False):
        planner.guessed(hit)
    assert planner.estimates.guess.rate < Estimates().guess.rate
    book = CostBook()
    book.learn(True, 30000, False, 4096, replace(planner.estimates, a2=Estimate(100.0, 95.0)))
    assert book.estimates(True, 30000, False, 4096).guess.rate == pytest.approx(planner.estimates.guess.rate)


def test_a_level_3_cost_between_measured_sizes_is_interpolated():
    c = Costs(level3={1: 10.0, 7: 16.0})
    assert c.verify(4) == pytest.approx(13.0) and c.verify(1) == 10.0 and c.verify(13) == pytest.approx(22.0)
    assert Costs(level3={7: 16.0}).verify(1) == 16.0 and Costs().verify(1) is None


def test_a_level_3_cost_outside_the_measured_sizes_never_falls_below_the_nearest_one():
    """Below the smallest measured size (a streamed run never measures one token), the smallest's cost; above the
    largest, on along the line through the smallest and the largest, never lower (a noisy larger size must not make
    more tokens cheaper)."""
    c = Costs(level3={7: 40.0, 13: 90.0, 16: 100.0})
    assert c.verify(1) == 40.0 and c.verify(10) == pytest.approx(65.0) and c.verify(19) == pytest.approx(120.0)
    assert Costs(level3={7: 40.0, 13: 30.0}).verify(16) == 40.0


def test_a_wobble_between_two_close_large_sizes_does_not_price_long_drafts_out():
    """A streamed pass costs ~30 ms whatever it verifies; one 13-row pass that took 2 ms more than an 11-row one must
    not make 32 rows cost two passes: beyond the largest size the slope is the widest span's, and a plan drafting
    31 tokens after the pass still beats drafting 12."""
    c = Costs(1.0, {1: 28.0, 4: 28.4, 5: 28.5, 11: 29.0, 13: 31.0})
    assert c.verify(32) == pytest.approx(31.0 + 19 * 3.0 / 12)
    e = Estimates(c, prior(0.98))
    h, _ = best(candidates([], 2, 31), e)
    assert h.gamma2 == 31
    assert rate(AUTOREGRESSIVE, Estimates(Costs(level3={7: 40.0, 13: 90.0}))) == pytest.approx(1 / 40.0)


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


def test_one_stalled_round_does_not_steer_a_cost_but_a_lasting_change_does():
    """A round held up once (a GC pause, another thread holding the GIL) leaves the cost where it was; a cost that
    really changed is taken up within a few rounds."""
    c = Costs()
    c.observe(1, 10.0, 1, 20.0, 0.0)
    c.observe(1, 90.0, 1, 180.0, 0.0)  # the second sample stalled: of two, the lower counts
    assert (c.level2, c.level3[1]) == (10.0, 20.0)
    for _ in range(3):
        c.observe(1, 10.0, 1, 20.0, 0.0)
    c.observe(1, 100.0, 1, 200.0, 0.0)
    assert (c.level2, c.level3[1]) == (10.0, 20.0)
    for _ in range(5):
        c.observe(1, 30.0, 1, 20.0, 0.0)
    assert c.level2 == 30.0


def test_a_new_step_size_s_first_sample_waits_for_a_second_where_the_other_sizes_predict_it():
    """A step size's first use may pay one-time work (0.2 s once on the real pair's 16-row offloaded pass, twelve
    times a pass): where the sizes measured predict it, that sample does not price it alone (taken, it kept the size
    and every larger one out of the plans for good); a second sample does, of the two the lower. Where nothing
    predicts it, a first sample stands."""
    c = Costs(level3={1: 17.5, 13: 18.1})
    c.observe(0, 0.0, 16, 214.0, 0.0)
    assert 16 not in c.level3 and c.verify(16) == pytest.approx(18.1 + 0.05 * 3)  # on through 1 and 13 rows
    c.observe(0, 0.0, 16, 18.3, 0.0)
    assert c.level3[16] == 18.3
    alone = Costs(level3={13: 18.1})
    alone.observe(0, 0.0, 16, 19.0, 0.0)
    assert alone.level3[16] == 19.0


def test_the_cost_book_keeps_greedy_and_sampled_runs_apart_and_merges_level_3_sizes():
    """A sampled row pays for its distribution, a greedy one does not: their costs are kept apart (greedy figures
    stand in for sampled ones only until those are measured). An autoregressive run's one-row steps join the sizes
    an earlier auto run measured."""
    book, auto = CostBook(), learnt(Costs(), "model", 2, 2.0)
    auto.costs.observe(1, 3.0, 7, 9.0, 0.5)
    book.learn(False, 1000, True, 512, auto)
    assert book.estimates(False, 1000, True, 512, DRAFT).costs.level2 == 3.0
    sampled = book.estimates(False, 1000, False, 512, DRAFT).costs
    assert (sampled.level2, sampled.level3) == (3.0, {7: 9.0}) and sampled.borrowed  # stand-ins, until measured
    sampled.observe(0, 0.0, 7, 18.0, 0.0)
    book.learn(False, 1000, False, 512, Estimates(sampled))
    assert book.estimates(False, 1000, True, 512, DRAFT).costs.level3[7] == 9.0  # greedy's own figures stay
    ar = Estimates()
    ar.costs.observe(0, 0.0, 1, 4.0, 0.0)
    book.learn(False, 1000, True, 512, ar)
    e = book.estimates(False, 1000, True, 512, DRAFT)
    known = e.costs
    assert known.level3 == {7: 9.0, 1: 4.0} and (e.level1["model"].ms, known.level2) == (1.0, 3.0)
    known.observe(0, 0.0, 1, 40.0, 0.0)  # a next run's samples join the book's: one stall does not count
    assert known.level3[1] == 4.0 and book.estimates(False, 1000, True, 512, DRAFT).costs.level3[1] == 4.0


def test_a_run_that_made_one_kind_of_level_2_forward_leaves_the_book_s_figures_for_the_other():
    """A fixed plan drafting alone measures only forwards that check nothing; the book keeps what an earlier run
    measured of forwards checking level 1 (and their samples), instead of letting them borrow the cheaper kind."""
    book, checking = CostBook(), Estimates()
    checking.costs.observe(2, 5.0, 7, 20.0, 0.5, ahead_forwards=2, ahead_ms=6.0, post_ms=1.0)
    book.learn(True, 30000, False, 8192, checking)
    alone = Estimates()
    alone.costs.observe(4, 6.0, 5, 19.0, 0.4, ahead_forwards=4, ahead_ms=7.0, post_ms=1.2, alone=True)
    book.learn(True, 30000, False, 8192, alone)
    c = book.estimates(True, 30000, False, 8192).costs
    assert (c.level2, c.level2_ahead, c.alone, c.alone_ahead) == (2.5, 3.0, 1.5, 1.75)
    assert c.level2_step(alone=False) == (2.5, 3.0) and (c.overhead, c.post) == (0.4, 1.2)
    assert {"level2", "alone"} <= set(c.samples)  # a next sample of either joins its own window


def test_a_first_run_at_a_new_prompt_length_starts_from_the_nearest_one_measured():
    """No measuring rounds on a new document's first run: the nearest length's costs stand in, the level-3 sizes
    rescaled by the first full step measured here, the other levels replaced by their first measurement."""
    book, short = CostBook(), learnt(Costs(), "model", 1, 1.0)
    short.costs.observe(1, 2.0, 7, 6.0, 0.0)
    short.costs.observe(0, 0.0, 1, 4.0, 0.0)
    book.learn(False, 1000, True, 512, short)
    e = book.estimates(False, 8000, True, 512, DRAFT)
    far, drafting = e.costs, e.level1["model"]
    assert far.level3 == {7: 6.0, 1: 4.0} and (drafting.ms, far.level2) == (1.0, 2.0)
    p = Planner(e, DRAFT, gamma1_max=2, gamma2_max=15)
    p.choose()
    assert not p.reason.startswith("measuring")
    far.observe(0, 0.0, 1, 8.0, 0.0)  # a full step here costs twice as much: so does a 7-row one
    assert far.level3 == {7: 12.0, 1: 8.0}
    far.observe(1, 5.0, 7, 13.0, 0.0)
    drafting.timed(1, 3.0)
    assert (drafting.ms, far.level2, far.level3[7]) == (3.0, 5.0, 13.0)
    assert not book.estimates(True, 8000, True, 512, DRAFT).costs.level3  # offloaded: nothing on-chip stands in
    ar = Estimates()  # an autoregressive run on the new document (a Compare click runs one first)
    ar.costs.observe(0, 0.0, 1, 12.0, 0.0)
    book.learn(False, 8000, True, 512, ar)
    after_ar = book.estimates(False, 8000, True, 512, DRAFT).costs
    assert after_ar.level3 == {1: 12.0, 7: 18.0} and not after_ar.borrowed  # 7 rows scaled as 1 row is


def test_an_offloaded_curve_borrowed_from_another_length_is_scaled_by_the_one_row_step_measured_here():
    """Offloaded runs never measure a one-row step and a Compare click's autoregressive run measures only that: the
    other length's curve is scaled to the one-row step measured here, not mixed with it unscaled."""
    book, warm = CostBook(), Estimates()
    warm.costs.observe(1, 1.0, 7, 19.0, 0.0)
    warm.costs.observe(1, 1.0, 13, 20.0, 0.0)
    book.learn(True, 2000, True, 512, warm)
    ar = Estimates()
    ar.costs.observe(0, 0.0, 1, 300.0, 0.0)  # the autoregressive run at 120K
    book.learn(True, 120_000, True, 512, ar)
    far = book.estimates(True, 120_000, True, 512, DRAFT).costs
    assert far.level3[1] == 300.0 and far.level3[13] == pytest.approx(300.0 * 20.0 / 19.0) and not far.borrowed


def test_a_run_starts_from_the_acceptance_the_last_run_of_its_kind_saw():
    """Priors for a first run; a later run of the same kind starts from the rates the last one observed (and an
    autoregressive run in between, which observed none, changes nothing)."""
    book, priors, default = CostBook(), Estimates(), Drafting()
    first = book.estimates(False, 1000, False, 512, DRAFT)
    assert (first.level1["model"].a1.rate, first.a2.rate) == (default.a1.rate, priors.a2.rate) < (1, 0.95)
    first.a2.add(proposed=100, accepted=100)
    book.learn(False, 1000, False, 512, first)
    book.learn(False, 1000, False, 512, Estimates())
    second = book.estimates(False, 1000, False, 512, DRAFT)
    assert second.a2.rate == pytest.approx(first.a2.rate) and second.a2.rate > 0.95
    assert second.a2.verified == CARRIED_WEIGHT  # 104 observations behind it, worth no more than CARRIED_WEIGHT
    assert second.level1["model"].a1.rate == default.a1.rate  # a1 unseen
    assert book.estimates(False, 1000, False, 1024, DRAFT).a2.rate == priors.a2.rate  # another budget: its own kind


def test_a_second_run_keeps_the_draft_length_its_prior_chose_through_one_rejection_at_the_first_token():
    """Offloaded at 120K, as the app's second greedy click on a document: the first run saw level 2 accepted 0.93 of
    the time; the second starts at γ2 12 from it (weighed, as every plan, one deviation below that rate), and its
    first round's draft is rejected at the first token. That round is one observation beside the sixteen the first
    run's count is carried as: the plan stays. (Worth PRIOR_WEIGHT observations, the prior would have fallen to 0.74,
    and the draft length with it.) A prior borrowed from another kind of run stays a guess."""
    book, first = CostBook(), Estimates(Costs(6.0, {1: 300.0, 13: 330.0, 32: 380.0}))
    for _ in range(4):
        first.a2.add(proposed=12, accepted=12)
        first.a2.add(proposed=12, accepted=1)
    book.learn(True, 120_000, True, 4096, first)
    p = Planner(book.estimates(True, 120_000, True, 4096, []), [], gamma1_max=2, gamma2_max=31, streamed=True)
    chosen = p.choose()
    assert chosen.level2 and chosen.gamma2 == 12
    p.level2_checked(chosen.gamma2, 0)
    p.observe("", 0, 0.0, chosen.gamma2, 6.0 * chosen.gamma2, chosen.gamma2 + 1, 330.0, 0.5)
    assert p.choose() == chosen and p.estimates.a2.rate > 0.85
    assert book.estimates(True, 120_000, False, 4096, []).a2.verified == PRIOR_WEIGHT  # sampled: borrowed


# The real Qwen2.5-Coder pair's costs with the full cache offloaded at 30K tokens (bench.real on the H200): a level-3
# pass by rows verified, a level-2 forward checking prompt lookup's tokens (2.5 ms) or drafting alone (1.7 ms), each
# beside the pass, and prompt lookup's 4 µs a token.
REAL_PASS = {1: 17.3, 2: 17.7, 4: 18.0, 8: 17.7, 9: 19.9, 11: 18.8, 13: 19.6, 16: 18.7, 21: 18.7, 32: 18.9}


def real_offloaded(a2: float, lookup: float, post: float = 1.0, caution: float = CAUTION) -> Planner:
    """A planner for the real pair offloaded, starting from what an earlier answer saw (sixteen observations each):
    level 2's acceptance `a2`, prompt lookup's `lookup`; level 3 emits level 2's guess after a whole draft 0.8 of the
    time, and `post` ms follow its pass."""
    costs = Costs(2.5, dict(REAL_PASS), 0.3, level2_ahead=2.6, post=post, alone=1.7, alone_ahead=1.9)
    e = Estimates(costs, Estimate(16, 16 * a2), guess=Estimate(16, 16 * 0.8))
    e.level1["ngram"] = Drafting(0.004, Estimate(16, 16 * lookup), offered=Estimate(16, 16 * 0.75))
    return Planner(e, ["ngram"], gamma1_max=2, gamma2_max=31, streamed=True, ahead=True, chained=True,
                   caution=caution)


def test_prompt_lookup_s_acceptance_carried_from_another_answer_waits_for_this_answer_to_show_it():
    """An earlier answer quoted the document (prompt lookup 0.37); at face value the next run would start on prompt
    lookup under level 2, which lost a third of a run's speed on the real pair when the answer quoted nothing (0.09).
    Weighed one deviation below, it starts on level 2 alone, measures prompt lookup in passing, and takes it once
    this answer shows it quoting (0.86), within MIN_ROUNDS rounds."""
    assert real_offloaded(a2=0.98, lookup=0.37, caution=0.0).choose().level1 == "ngram"
    p = real_offloaded(a2=0.98, lookup=0.37)
    h = p.choose()
    assert not h.level1 and h.level2 and h.ahead
    for rounds in range(1, 2 * MIN_ROUNDS):
        g = h.gamma2  # a round whose draft was made ahead, all accepted, the guess right
        p.observe("", 0, 0.0, 0, 0.0, g + 1, 19.0, 0.3, g, 1.9 * g, 1.0)
        p.level2_checked(g, g)
        p.guessed(True)
        p.shadowed("ngram", [(4, 4, 4), (4, 4, 3), (4, 2, 2)], 0.01)  # 9 of 10 proposed tokens would have stood
        if p.choose() != h:
            break
    assert p.current.level1 == "ngram" and rounds == MIN_ROUNDS


def test_a_long_draft_is_not_taken_on_a_level_2_acceptance_carried_from_one_lucky_answer():
    """An earlier answer saw level 2 accepted 0.99 of the time: at face value a 31-token draft (27 tokens a round)
    wins. Sampled answers differ (0.93-0.99 on the real pair), and at 0.95 that draft emits 16 tokens for 31 forwards:
    weighed one deviation below, the run drafts ahead at a length that pays at either."""
    assert real_offloaded(a2=0.99, lookup=0.1, post=2.0, caution=0.0).choose().gamma2 == 31
    h = real_offloaded(a2=0.99, lookup=0.1, post=2.0).choose()
    assert h.ahead and h.gamma2 <= 12


def test_a_sampled_run_that_observed_nothing_leaves_the_next_one_the_acceptance_a_greedy_run_saw():
    """A sampled run that decoded autoregressively (or a fixed run's warm-up) observes no acceptance: the next
    sampled run of that kind still starts from what the greedy runs saw, not from the defaults."""
    book, seen = CostBook(), Drafting()
    for _ in range(20):
        seen.a1.add(proposed=2, accepted=0)
    book.learn(True, 120_000, True, 4096, Estimates(level1={"model": seen}))
    book.learn(True, 120_000, False, 4096, Estimates(level1={"model": Drafting()}))  # sampled, all autoregressive
    book.learn(True, 600, False, 4096, Estimates(level1={"model": Drafting()}))  # a short sampled warm-up run
    assert seen.a1.rate < 0.2
    assert book.estimates(True, 120_000, False, 4096, DRAFT).level1["model"].a1.rate == pytest.approx(seen.a1.rate)


def test_a_first_sampled_run_on_a_document_starts_from_the_acceptance_greedy_runs_saw_on_it():
    """The app's first sampled click on a document after greedy ones: prompt lookup's acceptance on this document
    (greedy runs saw 0.08) stands in, not what the warm-up's short sampled run saw on its own text (0.8). Step costs
    still come from the sampled kind first: a sampled row pays for its distribution."""
    book, here, warm = CostBook(), Estimates(Costs(1.0, {1: 2.0})), Estimates(Costs(3.0, {1: 1.0}))
    here.level1["ngram"], warm.level1["ngram"] = Drafting(), Drafting()
    for _ in range(20):
        here.level1["ngram"].shadowed(asked=6, proposed=6, accepted=0)
        warm.level1["ngram"].shadowed(asked=6, proposed=6, accepted=5)
    book.learn(False, 30_000, True, 4096, here)
    book.learn(False, 600, False, 4096, warm)
    first_sampled = book.estimates(False, 30_000, False, 4096, ["ngram"])
    assert first_sampled.level1["ngram"].a13.rate < 0.3 < 0.7 < warm.level1["ngram"].a13.rate
    assert first_sampled.costs.level2 == 3.0  # the sampled warm-up's level-2 cost, not the greedy one


def test_prompt_lookup_borrows_its_lower_acceptance_of_the_two_nearest_kinds_and_a_draft_model_its_document_s():
    """Random weights decoded greedily repeat themselves, so prompt lookup matched 0.98 of greedy answers on a document
    where sampled ones (the sampled warm-up on its own text) rarely quote it. Measured in passing by every run
    (TriForce.shadow), prompt lookup borrows the lower of the two nearest kinds' figures, and a first sampled run does
    not start by drafting with it; the draft model, measured only by drafting, borrows the document's."""
    book = CostBook()
    for greedy, length, accepted in ((True, 8000, 10), (False, 600, 0)):  # of 10 proposed, 20 times
        e = Estimates(Costs(1.0, {1: 1.0}))
        for name in ("ngram", "model"):
            e.level1[name] = Drafting()
            for _ in range(20):
                e.level1[name].shadowed(asked=10, proposed=10, accepted=accepted)
        book.learn(False, length, greedy, 1024, e)
    first_sampled = book.estimates(False, 8000, False, 1024, ["model", "ngram"], shadowed=["ngram"])
    assert first_sampled.level1["ngram"].a13.rate < 0.3 < 0.8 < first_sampled.level1["model"].a13.rate
    greedy_again = book.estimates(False, 8000, True, 1024, ["model", "ngram"], shadowed=["ngram"])
    assert greedy_again.level1["ngram"].a13.rate > 0.8  # its own kind's figure, not a borrowed one


def test_a_fixed_triforce_run_gives_method_auto_the_acceptances_it_saw():
    """The warm-up's offloaded runs and Compare clicks of method triforce run a fixed hierarchy: what its levels
    accepted becomes the next auto run's prior, so that a first auto request does not start from the defaults."""
    engine, prompt = tiny_engine()
    cfg = GenerationConfig(**{**CFG, "max_new_tokens": 40}, seed=0).validate()
    with torch.no_grad():
        stats = [e for e in engine.generate_ids(prompt, cfg) if isinstance(e, Finished)][0].stats
    prior = engine.costs.estimates(False, len(prompt), False, cfg.budget, DRAFT)
    defaults = Estimates()
    for seen, learnt, default in ((stats.level1_acceptance, prior.level1["model"].a1.rate, Drafting().a1.rate),
                                  (stats.level2_acceptance, prior.a2.rate, defaults.a2.rate)):
        assert abs(seen - default) > 0.1 and abs(learnt - seen) < abs(default - seen) / 2, (seen, learnt, default)


def test_a_run_whose_budget_covered_the_prompt_leaves_no_level_2_acceptance_for_a_longer_one():
    """Level 2 holding the whole prompt drafts as level 3 would decide: its acceptance there (near 1) is no prior
    for a document retrieval must cut, which then starts from the default; a run that cut it does leave its own."""
    engine, prompt = tiny_engine()
    for budget, leaves in ((64, False), (CFG["budget"], True)):  # the 48-token prompt in budget, then cut to 8
        cfg = GenerationConfig(**{**CFG, "max_new_tokens": 24, "budget": budget}, seed=0).validate()
        with torch.no_grad():
            stats = [e for e in engine.generate_ids(prompt, cfg) if isinstance(e, Finished)][0].stats
        assert stats.level2_verified > 0
        prior_a2 = engine.costs.estimates(False, 4 * len(prompt), False, budget, DRAFT).a2
        assert (prior_a2.rate != Estimates().a2.rate) == leaves, (budget, stats.level2_acceptance, prior_a2)


def test_prompt_lookup_drafts_where_it_gives_more_tokens_per_millisecond_than_the_draft_model():
    """The real Qwen pair offloaded at 30K: a pass over the cache 17.5 ms, a level-2 step 2.6 ms, a draft-model token
    1.2 ms accepted at 0.6; prompt lookup costs microseconds a token, proposes for half the tokens asked and is
    accepted at 0.3. Lookup's tokens come nearly free, so they win; where it seldom finds a match, the model does."""
    e = estimates(level1=1.2, level2=2.6, level3={1: 17.5, 16: 18.0}, a1=0.6, a2=0.95)
    e.level1["ngram"] = Drafting(0.003, prior(0.3), offered=prior(0.5))
    both = ["model", "ngram"]
    h, r = best(candidates(both, 2, 15), e)
    assert h.level1 == "ngram" and h.level2 and r > best(candidates(DRAFT, 2, 15), e)[1]
    e.level1["ngram"].offered = prior(0.02)
    assert best(candidates(both, 2, 15), e)[0].level1 == "model"


class Autoregressive(Planner):
    """Method auto decoding autoregressively throughout (what it does on a CPU at 8K)."""

    def choose(self) -> Hierarchy:
        self.reason, self.current = "stays autoregressive", AUTOREGRESSIVE
        return AUTOREGRESSIVE


def test_auto_learns_prompt_lookup_s_figures_from_rounds_it_did_not_draft(monkeypatch):
    """Prompt lookup is asked in passing what it would have drafted, its proposals checked against the tokens level 3
    emits: a run that never drafted with it ends with its acceptance and cost, the same as replaying the answer
    through a fresh lookup as levels 1 → 3 at γ SHADOW_GAMMA would have (a proposal spans rounds: here, one-token
    autoregressive rounds)."""
    engine, prompt = tiny_engine()
    monkeypatch.setattr(core.decode.triforce, "Planner", Autoregressive)
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
    ngram = engine.costs.estimates(False, len(prompt), True, cfg.budget, ["model", "ngram"]).level1["ngram"]
    default = Drafting()
    assert ngram.ms is not None and ngram.a13 is not None
    assert ngram.offered.rate == pytest.approx((default.offered.accepted + sum(n for n, _ in checks))
                                               / (default.offered.verified + SHADOW_GAMMA * len(checks)))
    verified = sum(m + (m < n) for n, m in checks)
    assert ngram.a13.rate == pytest.approx((default.a1.accepted + sum(m for _, m in checks))
                                           / (default.a1.verified + verified))


def test_without_a_drafter_and_with_the_whole_prompt_in_budget_nothing_is_measured_and_no_level_drafts():
    p = Planner(Estimates(), [], gamma1_max=2, gamma2_max=15, level2=False)
    assert p.choose() == AUTOREGRESSIVE and "covers the whole prompt" in p.reason
    p = Planner(Estimates(), DRAFT, gamma1_max=2, gamma2_max=15, level2=False)
    first = p.choose()
    assert first == Hierarchy("model", False, 0, 1) and p.reason.startswith("measuring")
    assert not any(h.level2 for h in p.options)


def test_autoregressive_wins_where_no_speculative_candidate_gains_its_cost():
    """A small model on a CPU: a retrieval step costs 95 % of a full one, the draft 40 %, acceptance modest."""
    e = estimates(level1=4.0, level2=9.5, level3={1: 10.0, 7: 18.0}, a1=0.4, a2=0.7)
    h, r = best(candidates(DRAFT, 2, 15), e)
    assert h == AUTOREGRESSIVE and r == pytest.approx(1 / 10.0)


def test_triforce_wins_where_the_full_step_dominates():
    """A long cache offloaded: the full step 300 ms, the retrieval one 8 ms, the draft 1 ms."""
    e = estimates(level1=1.0, level2=8.0, level3={1: 300.0, 13: 305.0}, a1=0.6, a2=0.9)
    h, r = best(candidates(DRAFT, 2, 15), e)
    assert h.level1 and h.level2 and h.gamma2 >= 10 and r > 5 * rate(AUTOREGRESSIVE, e)


def test_two_model_speculation_wins_where_the_retrieval_level_saves_nothing():
    e = estimates(level1=1.0, level2=9.8, level3={1: 10.0, 7: 10.5}, a1=0.8, a2=0.95)
    h, _ = best(candidates(DRAFT, 2, 15), e)
    assert h.level1 and not h.level2


def test_the_planner_measures_first_then_switches_only_for_a_clear_gain():
    """(Acceptances at face value, caution 0: the priors alone then make a drafting plan worth taking.)"""
    p = Planner(Estimates(), DRAFT, gamma1_max=2, gamma2_max=15, caution=0.0)
    first = p.choose()
    assert first.level1 and first.level2 and p.reason.startswith("measuring")
    p.observe("model", 2, 2.0, 2, 19.0, first.gamma2 + 1, 12.0, 0.5)  # a level-1 token 1 ms, a level-2 step 9.5 ms
    assert p.choose() == AUTOREGRESSIVE  # the one-row step is measured next
    p.observe("", 0, 0.0, 0, 0.0, 1, 10.0, 0.0)
    chosen = p.choose()
    assert chosen != first and "autoregressive" in p.reason
    for _ in range(MIN_ROUNDS - 1):  # not settled yet: kept, whatever the estimates say
        p.observe("", 0, 0.0, 0, 0.0, 1, 10.0, 0.0)
        p.estimates.costs.level3[1] = 1000.0
        assert p.choose() == chosen


def test_a_fast_model_s_plan_is_weighed_again_only_after_enough_decoding_time():
    """Weighing every candidate costs a fraction of a millisecond of Python: with 1 ms rounds the planner waits for
    WEIGH_EVERY_MS of them, not MIN_ROUNDS, before it looks again."""
    p = Planner(estimates(level1=0.9, level2=0.95, level3={1: 1.0, 7: 1.2}, a1=0.3, a2=0.5), DRAFT,
                gamma1_max=2, gamma2_max=31)
    assert p.choose() == AUTOREGRESSIVE
    p.estimates.costs.level2, p.estimates.a2 = 0.1, Estimate(100.0, 99.0)  # now level 2 → 3 would be far faster
    rounds = 0
    while p.choose() == AUTOREGRESSIVE:
        p.observe("", 0, 0.0, 0, 0.0, 1, 1.0, 0.0)
        rounds += 1
    assert rounds == WEIGH_EVERY_MS > MIN_ROUNDS and p.current.level2 and p.current.gamma2 > 15


def test_a_plan_that_keeps_winning_is_weighed_at_doubling_intervals_and_a_switch_starts_them_again(monkeypatch):
    """Each weighing that keeps the plan doubles the decoding time before the next, up to WEIGH_MOST_MS (weighing
    costs ~0.35 ms of Python: every 20 ms it took ~2 % of a small model's decoding); a switch starts again at
    WEIGH_EVERY_MS."""
    elapsed, weighed, weigh = 0.0, [], core.plan.planner.best

    def counted(options, e, caution):
        weighed.append(elapsed)
        return weigh(options, e, caution)

    monkeypatch.setattr(core.plan.planner, "best", counted)
    p = Planner(estimates(level1=0.9, level2=0.95, level3={1: 1.0, 7: 1.2}, a1=0.3, a2=0.5), DRAFT,
                gamma1_max=2, gamma2_max=31)
    while elapsed < 700:
        assert p.choose() == AUTOREGRESSIVE
        p.observe("", 0, 0.0, 0, 0.0, 1, 1.0, 0.0)
        elapsed += 1.0
    gaps = [b - a for a, b in zip(weighed, weighed[1:])]
    assert gaps[:5] == [WEIGH_EVERY_MS, 2 * WEIGH_EVERY_MS, 4 * WEIGH_EVERY_MS, 8 * WEIGH_EVERY_MS, WEIGH_MOST_MS]
    assert set(gaps[4:]) == {WEIGH_MOST_MS}
    p.estimates.costs.level2, p.estimates.a2 = 0.1, Estimate(100.0, 99.0)  # level 2 → 3 now far faster
    while p.choose() == AUTOREGRESSIVE:
        p.observe("", 0, 0.0, 0, 0.0, 1, 1.0, 0.0)
        elapsed += 1.0
    switched = weighed[-1]
    assert switched - weighed[-2] == WEIGH_MOST_MS
    while len(weighed) < len(gaps) + 3:
        p.observe("", 0, 0.0, 1, 0.1, 32, 1.5, 0.0)
        elapsed += 1.6
        p.choose()
    assert weighed[-1] - switched == pytest.approx(WEIGH_EVERY_MS, abs=1.6)


def lookup_planner() -> Planner:
    """A planner with prompt lookup as level 1 (nearly free), no level 2, a 7-row step 10 % dearer than a one-row
    one."""
    return Planner(estimates(level1=0.01, level2=None, level3={1: 1.0, 7: 1.1}, a1=0.5, a2=0.9), DRAFT,
                   gamma1_max=2, gamma2_max=6, level2=False)


def rejected_round(p: Planner, h: Hierarchy) -> Hierarchy:
    """One round of `h` at its expected costs with every draft rejected; the next round's plan."""
    if h.gamma2:
        p.level1_checked(h.level1, 3, h.gamma2, h.gamma2, 0)
    p.observe(h.level1, h.gamma2, 0.01 * h.gamma2, 0, 0.0, h.gamma2 + 1, p.estimates.costs.verify(h.gamma2 + 1), 0.0)
    return p.choose()


def test_a_plan_expected_slower_than_autoregressive_is_left_within_min_rounds_however_fast_its_rounds():
    """Prompt lookup chosen on a prior (level 1 nearly free, a 7-row step 10 % dearer than a one-row one), then every
    draft rejected: once the plan is expected slower than autoregressive decoding, the planner leaves it within
    MIN_ROUNDS rounds (no hysteresis holds it, and no WEIGH_EVERY_MS of 1 ms rounds is waited for)."""
    p = lookup_planner()
    h = first = p.choose()
    assert h.level1 and h.gamma2 > 1
    below = longest = 0  # consecutive rounds of a plan expected slower than autoregressive
    for _ in range(60):
        h = rejected_round(p, h)
        below = below + 1 if rate(h, p.estimates) < rate(AUTOREGRESSIVE, p.estimates) else 0
        longest = max(longest, below)
    assert h != first and longest <= MIN_ROUNDS


def test_a_drafting_plan_must_be_expected_clearly_faster_than_autoregressive_to_be_taken_and_is_then_kept():
    """Measured costs are noisy (a shared CPU: up to 15 % between two runs of one plan), so a plan expected 2 %
    faster than AR is not taken; one expected 16 % faster is, and it stays while it remains faster than AR.
    (Acceptances at face value, caution 0: the margin is what this is about.)"""
    costs = dict(level1=0.45, level2=None, level3={1: 1.0, 7: 1.1})  # 1 → 3 at γ 1: 1 + α tokens per 1.467 ms
    marginal = Planner(estimates(**costs, a1=0.5, a2=0.9), DRAFT, gamma1_max=2, gamma2_max=15, level2=False,
                       caution=0.0)
    assert marginal.choose() == AUTOREGRESSIVE  # 1.5 tokens: 1.02× AR
    p = Planner(estimates(**costs, a1=0.7, a2=0.9), DRAFT, gamma1_max=2, gamma2_max=15, level2=False, caution=0.0)
    chosen = p.choose()
    assert chosen == Hierarchy("model", False, 0, 1)  # 1.7 tokens: 1.16× AR
    for accepted in (1, 0) * 8:  # its acceptance falls to 0.54: 1.05× AR, within the margin of noise
        p.level1_checked("model", 3, 1, 1, accepted)
    assert 1.0 < rate(chosen, p.estimates) / rate(AUTOREGRESSIVE, p.estimates) < 1.1
    for _ in range(20):  # enough rounds and decoding time to be weighed again
        p.observe("model", 1, 0.45, 0, 0.0, 2, p.estimates.costs.verify(2), 0.0)
        assert p.choose() == chosen


def test_out_of_switches_the_planner_still_returns_to_autoregressive_decoding_and_nowhere_else():
    """MAX_SWITCHES bounds flapping between plans, not the way back to AR: a plan that has used them all and then
    sees its drafts rejected is left for autoregressive decoding, which it then keeps."""
    p = lookup_planner()
    h = p.choose()
    p.switches = MAX_SWITCHES
    for _ in range(60):
        h = rejected_round(p, h)
    assert h == AUTOREGRESSIVE and p.switches == MAX_SWITCHES + 1


def test_a_plan_of_slow_rounds_is_weighed_again_after_one_round_and_a_fast_one_after_min_rounds():
    """Offloaded at 120K a round takes ~0.3 s: a plan its first round showed wrong is not kept for MIN_ROUNDS more
    (SETTLE_MS of decoding is evidence enough); rounds of 10 ms wait for MIN_ROUNDS."""
    for round_ms, expected in ((300.0, 1), (10.0, MIN_ROUNDS)):
        p = Planner(estimates(level1=0.9 * round_ms, level2=0.95 * round_ms, level3={1: round_ms, 7: 1.2 * round_ms},
                              a1=0.3, a2=0.5), DRAFT, gamma1_max=2, gamma2_max=31)
        assert p.choose() == AUTOREGRESSIVE
        p.estimates.costs.level2, p.estimates.a2 = 0.1 * round_ms, Estimate(100.0, 99.0)  # now level 2 pays
        rounds = 0
        while p.choose() == AUTOREGRESSIVE:
            p.observe("", 0, 0.0, 0, 0.0, 1, round_ms, 0.0)
            rounds += 1
        assert rounds == expected and p.current.level2, (round_ms, rounds)
    assert SETTLE_MS <= 300.0 and 10.0 * MIN_ROUNDS < SETTLE_MS


def test_with_the_full_cache_streamed_the_planner_takes_the_verification_for_an_autoregressive_step():
    """Offloaded, an AR step would cost a whole pass over the cache for one token: it is not measured."""
    p = Planner(Estimates(), DRAFT, gamma1_max=2, gamma2_max=15, streamed=True)
    first = p.choose()
    p.observe("model", 2, 2.0, 2, 200.0, first.gamma2 + 1, 1000.0, 0.5)  # a pass over the cache: 1 s, any size
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
    measured = engine.costs.figures()
    assert len(seen) > 4 and measured and max(measured) < 50.0, measured


class Cycling(Planner):
    """Every round a different hierarchy, and another drafter where the run holds several, whatever was measured:
    switching is exact or nothing is. The turn is counted across runs: a run of two tokens may last one round."""

    turn = 0

    def choose(self) -> Hierarchy:
        if self.fixed is not None:
            return self.fixed
        d = (self.drafters or [""])[self.turn % max(len(self.drafters), 1)]
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
        monkeypatch.setattr(core.decode.triforce, "Planner", Cycling)
        for drafter in ("auto", "model", "ngram", "none"):
            events = list(engine.generate_ids(prompt, GenerationConfig(method="auto", drafter=drafter, **base)))
            plans = {e.plan for e in events if isinstance(e, PlanChosen)}
            assert events[-1].token_ids == ar.token_ids and len(plans) >= 3, drafter


def test_switching_hierarchies_every_round_is_lossless(monkeypatch, one_thread):
    engine, prompt = tiny_engine()
    monkeypatch.setattr(core.decode.triforce, "Planner", Cycling)
    with torch.no_grad():
        expected = target_pairs(engine, prompt)
        counts, levels = emitted_pairs(engine, prompt, GATED_DRAWS, method="auto", drafter="auto")
    assert 0 < levels["l2_accepted"] < levels["l2_proposed"] and 0 < levels["l1_accepted"] < levels["l1_proposed"]
    p_ok = chi_square_p(counts, expected, GATED_DRAWS)
    assert p_ok > 1e-3, f"switching sampler rejected (p={p_ok:.2e})"
