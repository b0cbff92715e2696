"""The whole hierarchy (level-1 model draft, level-2 retrieval, level-3 full) emits exactly the target's
distribution; the same test fails when level 2 resamples from its own p instead of the residual (the reference
code's bias)."""

import time

import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

import core.plan.policy
import core.decode.request
import core.decode.triforce
from core.config import GenerationConfig
from core.events import Verdict
from core.decode.repetition import Repetition
from tests.lossless import BIASED_DRAWS, CFG, DRAWS, GATED_DRAWS, emitted_pairs, target_pairs, tiny_engine
from tests.stats import chi_square_p


def test_hierarchy_is_lossless_and_detects_level2_bias(monkeypatch, one_thread):
    engine, prompt = tiny_engine()
    with torch.no_grad():
        expected = target_pairs(engine, prompt)
        t0 = time.perf_counter()
        counts, levels = emitted_pairs(engine, prompt, DRAWS)
        elapsed = time.perf_counter() - t0
    # both levels must really be at work: level 1 proposes and is sometimes rejected, level 2 likewise
    assert 0 < levels["l1_accepted"] < levels["l1_proposed"]
    assert 0 < levels["l2_accepted"] < levels["l2_proposed"]
    p_ok = chi_square_p(counts, expected, DRAWS)
    assert p_ok > 1e-3, f"exact sampler rejected (p={p_ok:.2e}, {elapsed:.0f}s)"

    monkeypatch.setattr(core.decode.request, "residual_distribution", lambda p, q: p)
    with torch.no_grad():
        biased, _ = emitted_pairs(engine, prompt, BIASED_DRAWS)
    p_biased = chi_square_p(biased, expected, BIASED_DRAWS)
    assert p_biased < 1e-6, f"level-2 bias not detected (p={p_biased:.2e})"


def test_repetition_penalty_is_lossless_and_row_histories_matter(monkeypatch, one_thread):
    """With a repetition penalty every level verifies against the penalised target: the hierarchy emits the target's
    distribution as transformers' processor penalises it (the answer's tokens); the same test fails when each row of
    a verification is penalised with the first row's history (not seeing the draft tokens before it)."""
    engine, prompt = tiny_engine(target_seed=33)  # a target that repeats its first token half the time
    penalty = 1.5
    processor = RepetitionPenaltyLogitsProcessor(penalty, prompt_ignore_length=len(prompt))
    with torch.no_grad():
        plain = target_pairs(engine, prompt)
        expected = target_pairs(engine, prompt, [processor])
        assert sum(abs(expected[k] - plain[k]) for k in plain) / 2 > 0.2  # the penalty really changes the target
        counts, levels = emitted_pairs(engine, prompt, GATED_DRAWS, repetition_penalty=penalty)
    assert 0 < levels["l1_accepted"] < levels["l1_proposed"]
    assert 0 < levels["l2_accepted"] < levels["l2_proposed"]
    p_ok = chi_square_p(counts, expected, GATED_DRAWS)
    assert p_ok > 1e-3, f"penalised sampler rejected (p={p_ok:.2e})"

    original = Repetition.__call__

    def first_row_history(self, logits, seq, extra=(), columns=None):
        common = list(extra)[:len(extra) - logits.shape[0] + 1]
        return torch.cat([original(self, row[None], seq, common, columns) for row in logits])

    monkeypatch.setattr(Repetition, "__call__", first_row_history)
    with torch.no_grad():
        biased, _ = emitted_pairs(engine, prompt, BIASED_DRAWS, repetition_penalty=penalty)
    p_biased = chi_square_p(biased, expected, BIASED_DRAWS)
    assert p_biased < 1e-6, f"row-history bias not detected (p={p_biased:.2e})"


def test_drafting_ahead_is_lossless_and_an_off_by_one_q_or_an_unchecked_guess_is_detected(monkeypatch, one_thread):
    """Level 2 drafts the next round while level 3 verifies (draft_ahead on; without a GPU the two run in turn): the
    first three tokens keep the target's distribution, with the second round's draft made ahead in many runs; the
    same test fails when the draft made ahead is verified against the q of the position before each token (the
    guess's distribution first), and when level 2's guess stands whenever level 3 accepts the draft before it."""
    engine, prompt = tiny_engine()
    ahead = dict(max_new_tokens=3, gamma2=1, reselect="once", draft_ahead="on")
    with torch.no_grad():
        expected = target_pairs(engine, prompt, length=3)
        counts, levels = emitted_pairs(engine, prompt, DRAWS, **ahead)
    assert 0 < levels["ahead_kept"] < levels["ahead_made"] <= DRAWS
    assert levels["ahead_kept"] > DRAWS / 10
    p_ok = chi_square_p(counts, expected, DRAWS)
    assert p_ok > 1e-3, f"drafting ahead rejected (p={p_ok:.2e})"

    draft_ahead = core.decode.triforce.TriForce.draft_ahead

    def shifted(made):
        made.draft.q = [made.q, *made.draft.q[:-1]]

    def unchecked(made):
        made.q = torch.zeros_like(made.q)  # q(guess) = 0 <= p(guess): level 3 accepts every guess

    for bias, what in ((shifted, "an off-by-one q of drafts made ahead"), (unchecked, "a guess standing unchecked")):
        def biased_ahead(self, h, seq, draft, round_, want, bias=bias):
            made = draft_ahead(self, h, seq, draft, round_, want)
            bias(made)
            return made

        monkeypatch.setattr(core.decode.triforce.TriForce, "draft_ahead", biased_ahead)
        with torch.no_grad():
            biased, _ = emitted_pairs(engine, prompt, BIASED_DRAWS, **ahead)
        p_biased = chi_square_p(biased, expected, BIASED_DRAWS)
        assert p_biased < 1e-6, f"{what} not detected (p={p_biased:.2e})"


def test_level_2_s_guess_stands_about_as_often_as_level_3_accepts_a_draft(monkeypatch, one_thread):
    """Level 2's guess at the token level 3 emits after a whole draft, which the next round's draft made ahead
    follows, is checked like one more draft: at temperature 2 it stands about as often as level 3 accepts a drafted
    token, where the likeliest token, kept only when level 3 draws it, would stand far less often."""
    engine, prompt = tiny_engine()
    hits = []
    observe = core.plan.policy.Fixed.observe

    def recording(self, record):
        if record.guess is not None:
            hits.append(record.guess)
        observe(self, record)

    monkeypatch.setattr(core.plan.policy.Fixed, "observe", recording)
    with torch.no_grad():
        _, levels = emitted_pairs(engine, prompt, 40, max_new_tokens=16, gamma2=1, temperature=2.0, drafter="none",
                                  reselect="once", draft_ahead="on")
    a2 = levels["l2_accepted"] / levels["l2_proposed"]
    assert len(hits) >= 200
    assert abs(sum(hits) / len(hits) - a2) < 0.1, (sum(hits) / len(hits), a2)


def test_level_2_drafting_alone_chained_on_the_device_drafts_what_its_loop_drafts(one_thread):
    """Level 2 drafting alone feeds each token it draws straight into its next forward, waiting once a draft; with
    repetition control on (it must see each id on the host) it drafts one forward at a time. Both verify the same
    tokens with the same q, so every verdict of a sampled run matches, drafting ahead or not (the guess then leads
    the chain); a chain that drew its tokens off the loop's random stream, or paired them with the wrong q, would
    part from it within a few rounds."""
    engine, prompt = tiny_engine()
    made = kept = rejected = 0
    with torch.no_grad():
        for seed in range(12):
            for ahead in ("on", "off"):
                runs = []
                for control in ({}, {"no_repeat_ngram_size": 64}):  # 64: no n-gram of a 16-token answer is banned
                    cfg = GenerationConfig(**{**CFG, "drafter": "none", "max_new_tokens": 16, "gamma2": 4,
                                              "draft_ahead": ahead, "reselect": "once", **control}, seed=seed)
                    events = list(engine.generate_ids(prompt, cfg.validate()))
                    runs.append([(e.level, e.proposed, e.accepted, e.token) for e in events if isinstance(e, Verdict)])
                    made, kept = made + events[-1].stats.ahead_made, kept + events[-1].stats.ahead_kept
                assert runs[0] == runs[1], (seed, ahead)
                assert any(level == 2 for level, *_ in runs[0])
                rejected += any(a < len(p) for _, p, a, _ in runs[0])
    assert 0 < kept < made
    assert rejected >= 12  # most runs met a rejection, where a chain and the loop part if they drew differently
