"""Prompt lookup: the longest recent match of the text's last tokens, its continuation, and the same answer whether
the newest tokens come inside the sequence or beside it; the drafters and policies the settings offer, and the
drafters a run holds."""

import torch

from core.config import DRAFTER_CHOICES, LEVEL2_CACHE_CHOICES, POLICY_CHOICES, GenerationConfig
from core.decode.drafters import DRAFTERS, NgramDrafter
from core.cache.retrieval import LEVEL2_CACHES, SELECTION_POLICIES
from tests.lossless import CFG, tiny_engine


def test_longest_match_and_its_continuation():
    seq = [1, 2, 3, 9, 2, 3, 7, 5, 1, 2, 3]
    lookup = NgramDrafter(max_n=4)
    m, end = lookup.match(seq, len(seq))
    assert (m, end) == (3, 3) and seq[end] == 9  # "1 2 3" ended at 3 before; the later "2 3" (end 6) is shorter
    assert lookup.propose(seq, 2, len(seq)) == ([9, 2], None, [True, True])
    assert NgramDrafter(max_n=4).match([4, 5, 6], 3) == (0, -1)


def test_extra_tokens_match_as_if_appended():
    seq, extra = [5, 6, 7, 8, 1, 5, 6], [7]
    for trusted in (3, 5, 7):
        apart, joined = NgramDrafter(4), NgramDrafter(4)
        assert apart.match(seq, trusted, extra) == joined.match(seq + extra, trusted)
    m, end = NgramDrafter(4).match(seq, 7, extra)
    assert (m, end) == (3, 3) and seq[end] == 8  # "5 6 7" continues with 8
    assert NgramDrafter(4).match([1, 2], 2, [1, 2]) == (2, 2)  # continues with extra[0]: past the end of seq


def test_proposals_are_the_same_with_the_newest_tokens_apart():
    seq = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 1, 4]
    for split in range(6, len(seq) + 1):
        apart = NgramDrafter(4).propose(seq[:split], 3, 6, seq[split:])
        assert apart == NgramDrafter(4).propose(seq, 3, 6), split
    assert NgramDrafter(4).propose(seq, 3, 6).tokens == [1, 5, 9]  # "3 1 4" recurs: continue with "1 5 9"


def test_the_settings_offer_exactly_the_registered_drafters_and_policies():
    """core.config spells the registries' names (it must import nothing above it): the two lists must agree."""
    assert DRAFTER_CHOICES == ("auto", *DRAFTERS, "none")
    assert POLICY_CHOICES == tuple(SELECTION_POLICIES)
    assert LEVEL2_CACHE_CHOICES == tuple(LEVEL2_CACHES)


def test_method_auto_holds_prompt_lookup_beside_the_draft_model_and_shares_its_n_gram_index():
    """Auto weighs both drafters; the model's own lookup (lookup_min) indexes the same n-grams, so prompt lookup
    reuses that index (a 30K-token prompt takes ~0.2 s to index) unless it matches other lengths. A fixed method
    holds only the drafter its settings name."""
    engine, prompt = tiny_engine()

    def drafters(**settings) -> dict:
        cfg = GenerationConfig(**{**CFG, **settings}).validate()
        return engine.drafters(engine.plan(len(prompt), cfg), prompt, torch.Generator().manual_seed(0))

    both = drafters(method="auto", drafter="auto")
    assert list(both) == ["model", "ngram"] and both["ngram"] is both["model"].lookup
    apart = drafters(method="auto", drafter="auto", ngram_max=2)
    assert list(apart) == ["model", "ngram"] and apart["ngram"].max_n == 2
    assert list(drafters(method="triforce", drafter="auto")) == ["model"]
    assert list(drafters(method="auto", drafter="ngram")) == ["ngram"] and not drafters(drafter="none")
