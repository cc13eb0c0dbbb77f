"""Confidence intervals of win rates and paired differences (pure; placeholder until merged with eval)."""

from __future__ import annotations

import math
from collections.abc import Sequence

Z95 = 1.959963984540054


def wilson(mean: float, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of a proportion ``mean`` observed over ``n`` trials."""
    if n == 0:
        return 0.0, 1.0
    denom = 1 + z * z / n
    centre = (mean + z * z / (2 * n)) / denom
    half = z * math.sqrt(mean * (1 - mean) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def paired_difference_interval(diffs: Sequence[float]) -> tuple[float, float, float]:
    """Mean of per-example differences in [-1, 1] with a 95% interval that does not collapse at the edges:
    Wilson's on the differences mapped to [0, 1]."""
    n = len(diffs)
    est = sum(diffs) / n
    lo, hi = wilson((est + 1) / 2, n)
    return est, min(est, 2 * lo - 1), max(est, 2 * hi - 1)
