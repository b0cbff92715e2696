"""Turning the Settings widgets' raw values into a validated GenerationConfig."""

from __future__ import annotations

from core import GenerationConfig, TriForceError

DRAFTERS = ("auto", "model", "ngram", "none")
RESELECT_POLICIES = ("once", "every verification", "every N rounds")
OVERFLOW_POLICIES = ("truncate", "refuse")


def _int(name: str, value: float | int | str | None) -> int:
    """An integer setting; blanks and fractions raise TriForceError."""
    if value is None or value == "":
        raise TriForceError(f"{name} is empty; enter a whole number.")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise TriForceError(f"{name} must be a whole number, got {value!r}.") from None
    if not number.is_integer():
        raise TriForceError(f"{name} must be a whole number, got {value}.")
    return int(number)


def _float(name: str, value: float | int | str | None) -> float:
    """A real-valued setting; blanks raise TriForceError."""
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise TriForceError(f"{name} must be a number, got {value!r}.") from None


def build_config(method: str, max_new_tokens: float, budget: float, chunk_size: float, gamma1: float, gamma2: float,
                 drafter: str, reselect: str, reselect_every: float, temperature: float, top_p: float, seed: float,
                 greedy: bool, overflow: str, draft_confidence: float = 0.0,
                 lookup_min: float = GenerationConfig.lookup_min, draft_fusion: bool = True) -> GenerationConfig:
    """A validated GenerationConfig from widget values; anything invalid raises TriForceError with the fix."""
    if drafter not in DRAFTERS:
        raise TriForceError(f"drafter must be one of {', '.join(DRAFTERS)}, got {drafter!r}.")
    if reselect not in RESELECT_POLICIES:
        raise TriForceError(f"re-selection must be one of {', '.join(RESELECT_POLICIES)}, got {reselect!r}.")
    policy: str | int = {"once": "once", "every verification": "every_verify"}.get(reselect) or \
        _int("re-select every N rounds", reselect_every)
    config = GenerationConfig(
        method=method, max_new_tokens=_int("max new tokens", max_new_tokens), budget=_int("budget", budget),
        chunk_size=_int("chunk size", chunk_size), gamma1=_int("γ1", gamma1), gamma2=_int("γ2", gamma2),
        drafter=drafter, reselect=policy,
        temperature=_float("temperature", temperature), top_p=_float("top-p", top_p), seed=_int("seed", seed),
        greedy=bool(greedy), overflow=overflow,
        draft_confidence=_float("draft confidence gate", draft_confidence),
        lookup_min=_int("copy after a match of", lookup_min), draft_fusion=bool(draft_fusion))
    return config.validate()
