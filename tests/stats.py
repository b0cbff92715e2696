"""Goodness of fit for the lossless tests (chi-square, Wilson-Hilferty p-value: no SciPy needed)."""

from __future__ import annotations

import math
from collections import Counter


def chi_square_p(observed: Counter, expected: dict, n: int, min_expected: float = 5.0) -> float:
    """p-value that `observed` (counts of n draws) follows `expected` (probabilities); sparse cells pooled."""
    stat, df, pooled_o, pooled_e = 0.0, -1, 0.0, 0.0
    for key, prob in expected.items():
        e, o = prob * n, observed.get(key, 0)
        if e < min_expected:
            pooled_o, pooled_e = pooled_o + o, pooled_e + e
            continue
        stat, df = stat + (o - e) ** 2 / e, df + 1
    stray = sum(c for k, c in observed.items() if k not in expected)
    pooled_o += stray
    if pooled_e > 0 or stray:
        stat += (pooled_o - pooled_e) ** 2 / max(pooled_e, 1e-9)
        df += 1
    z = ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))
