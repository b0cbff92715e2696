"""What comparing a greedy TriForce answer with the greedy autoregressive one says: identical, or where they first
differ and whether the autoregressive run's top two logits nearly tied there (rounding can then decide either way)."""

from __future__ import annotations

from core.decode.autoregressive import NEAR_TIE


def first_difference(reference: list[int], other: list[int]) -> int | None:
    """Index of the first token where the two answers differ (one ending earlier counts), None when identical."""
    if reference == other:
        return None
    return next((i for i, (a, b) in enumerate(zip(reference, other)) if a != b), min(len(reference), len(other)))


def difference_note(reference: list[int], other: list[int], near_ties: list[tuple[int, float]]) -> str | None:
    """One line on where the answers first differ (None when token-identical), with the reference run's top-two
    logit margin there when it was a near-tie."""
    at = first_difference(reference, other)
    if at is None:
        return None
    margin = dict(near_ties).get(at)
    where = f"the outputs differ from token {at + 1}"
    if margin is not None:
        return (f"{where}, where the top two logits of the autoregressive run were {margin:.3g} apart: a rounding "
                "near-tie, decided differently by the two runs' arithmetic")
    return (f"{where}, where the autoregressive run's top two logits were over {NEAR_TIE:g} apart: not a rounding "
            "near-tie (please report it)")
