"""Speculative sampling is exact; logits processing behaves as documented."""

from collections import Counter

import torch

from core.config import GenerationConfig
from core.decode.sampling import distributions, nucleus, row_cumsum, sample, speculative_verify
from tests.stats import chi_square_p

V = 6


def draws(p: torch.Tensor, q: torch.Tensor | None, n: int, residual=None) -> Counter:
    """First emitted token of one-token drafts x ~ q (or a fixed draft 2 when q is None) verified against p."""
    g = torch.Generator().manual_seed(0)
    kwargs = {"residual": residual} if residual else {}
    counts = Counter()
    for _ in range(n):
        x = int(torch.multinomial(q, 1, generator=g)) if q is not None else 2
        accepted, token = speculative_verify([x], q[None] if q is not None else None, p, g, **kwargs)
        counts[x if accepted else token] += 1
    return counts


def test_verify_emits_target_distribution_and_biased_residual_is_caught():
    g = torch.Generator().manual_seed(1)
    p = torch.softmax(torch.randn(2, V, generator=g) * 2, -1)
    q = torch.softmax(torch.randn(V, generator=g) * 2, -1)
    expected = dict(enumerate(p[0].tolist()))
    assert chi_square_p(draws(p, q, 20000), expected, 20000) > 1e-3
    assert chi_square_p(draws(p, None, 20000), expected, 20000) > 1e-3  # deterministic (n-gram) proposals
    assert chi_square_p(draws(p, q, 20000, residual=lambda pi, qi: pi), expected, 20000) < 1e-6


def test_a_last_draft_standing_in_for_the_bonus_token_keeps_p_s_distribution():
    """Given p without a row after the draft, the draft's last token takes the bonus token's place: a draw from q
    that stands, or the residual's draw, is distributed as p (standing unchecked it would follow q)."""
    g = torch.Generator().manual_seed(2)
    p = torch.softmax(torch.randn(1, V, generator=g) * 2, -1)
    q = torch.softmax(torch.randn(V, generator=g) * 2, -1)
    counts = draws(p, q, 20000)
    assert chi_square_p(counts, dict(enumerate(p[0].tolist())), 20000) > 1e-3
    assert chi_square_p(counts, dict(enumerate(q.tolist())), 20000) < 1e-6
    assert speculative_verify([3], q[None], torch.eye(V)[3:4], g) == (0, 3)  # level 3 accepts it: it is the next token


def test_greedy_accepts_only_the_argmax():
    cfg = GenerationConfig(greedy=True)
    logits = torch.tensor([[0.1, 3.0, 0.2], [2.0, 0.0, 0.1], [0.0, 0.0, 5.0]])
    p = distributions(logits, cfg)
    g = torch.Generator().manual_seed(0)
    assert speculative_verify([1, 0], p[:2], p, g) == (2, 2)
    assert speculative_verify([1, 2], None, p, g) == (1, 0)
    assert speculative_verify([0], None, p, g) == (0, 1)


def test_top_p_top_k_and_temperature():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = distributions(logits, GenerationConfig(temperature=1.0, top_p=0.75))[0]
    torch.testing.assert_close(kept, torch.tensor([0.625, 0.375, 0.0, 0.0]))
    kept = distributions(logits, GenerationConfig(temperature=1.0, top_p=0.85))[0]
    assert (kept > 0).tolist() == [True, True, True, False]
    kept = distributions(logits, GenerationConfig(temperature=1.0, top_p=1.0, top_k=1))[0]
    assert kept.tolist() == [1.0, 0.0, 0.0, 0.0]
    cold = distributions(logits, GenerationConfig(temperature=0.5, top_p=1.0))[0]
    assert cold[0] > 0.5 and abs(float(cold.sum()) - 1) < 1e-6


def test_partial_sort_nucleus_equals_full_sort():
    g = torch.Generator().manual_seed(0)
    fallbacks = 0
    for scale in (0.1, 1.0, 3.0, 8.0):  # flat (the first head of 256 holds < top_p) to peaked
        logits = torch.randn(4, 5000, generator=g) * scale
        probs = logits.softmax(-1)
        for top_p in (0.5, 0.9, 0.99):
            fallbacks += bool((probs.topk(256).values.sum(-1) < top_p).any())
            fast, full = nucleus(probs, top_p), nucleus(probs, top_p, heads=())
            assert torch.equal(fast > 0, full > 0)
            torch.testing.assert_close(fast, full)
    assert 0 < fallbacks < 12  # both paths were exercised


def test_the_nucleus_of_each_row_of_a_verification_is_the_one_of_that_row_alone():
    """Several rows are summed in one flattened scan (row_cumsum): each row keeps the tokens it would keep alone."""
    g = torch.Generator().manual_seed(1)
    probs = (torch.randn(7, 3000, generator=g) * 3.0).softmax(-1)
    torch.testing.assert_close(row_cumsum(probs), probs.cumsum(-1), rtol=0.0, atol=1e-6)
    rows = nucleus(probs, 0.9, heads=())
    for i in range(len(probs)):
        alone = nucleus(probs[i:i + 1], 0.9, heads=())[0]
        assert torch.equal(rows[i] > 0, alone > 0)
        torch.testing.assert_close(rows[i], alone)


def test_sample_draws_from_probs_and_never_a_zero():
    probs = torch.tensor([0.5, 0.0, 0.2, 0.0, 0.25, 0.05])
    g = torch.Generator().manual_seed(0)
    draws = 20000
    counts = Counter(sample(probs, g) for _ in range(draws))
    assert counts[1] == counts[3] == 0
    assert chi_square_p(counts, {i: float(p) for i, p in enumerate(probs) if p > 0}, draws) > 1e-3


def test_repetition_matches_transformers_row_by_row():
    """Each row of a verification forward is processed as transformers processes that row's own history (the seq
    plus the draft tokens before it; the answer after the first `start` tokens), and a reduced head gets the columns
    of its token ids."""
    from transformers.generation.logits_process import NoRepeatNGramLogitsProcessor, RepetitionPenaltyLogitsProcessor

    from core.decode.repetition import Repetition

    g = torch.Generator().manual_seed(0)
    vocab, start = 30, 10
    seq = torch.randint(0, vocab, (40,), generator=g).tolist()
    draft = seq[20:23] + [min(set(range(vocab)) - set(seq))]  # a 3-gram of the answer, then a new token
    logits = torch.randn(len(draft) + 1, vocab, generator=g) * 3
    for penalty, ngram in ((1.3, 0), (1.0, 3), (1.7, 2), (1.2, 1)):
        cfg = GenerationConfig(repetition_penalty=penalty, no_repeat_ngram_size=ngram)
        repetition = Repetition(cfg, vocab, torch.device("cpu"), start)
        repetition(logits[:1], seq[:30])  # an earlier call on a shorter seq: the committed part grows
        got = repetition(logits, seq, draft)
        for i in range(len(draft) + 1):
            history = torch.tensor([seq + draft[:i]])
            want = logits[i:i + 1].clone()
            if penalty != 1.0:
                want = RepetitionPenaltyLogitsProcessor(penalty, prompt_ignore_length=start)(history, want)
            if ngram:
                want = NoRepeatNGramLogitsProcessor(ngram)(history[:, start:], want)
            torch.testing.assert_close(got[i:i + 1], want, rtol=0, atol=0)
        assert not torch.equal(got, logits)
        columns = torch.tensor([3, 0, 7, 11])
        torch.testing.assert_close(repetition(logits[:, columns], seq, draft, columns), got[:, columns])
    off = Repetition(GenerationConfig(repetition_penalty=1.0), vocab, torch.device("cpu"), start)
    assert off(logits, seq, draft) is logits
