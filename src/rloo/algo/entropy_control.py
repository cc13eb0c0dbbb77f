"""Adaptive entropy control (Skywork-OR1; TRL's ``use_adaptive_entropy``): the entropy bonus's coefficient
follows the policy's entropy toward a target, in plain scalars, one step per optimizer step."""

from __future__ import annotations

import math

__all__ = ["applied_entropy_coef", "next_entropy_coef"]


def next_entropy_coef(
    coef: float, entropy: float, *, target: float, delta: float, coef_min: float, coef_max: float
) -> float:
    """The coefficient after an optimizer step whose tokens had mean entropy ``entropy``: ``coef + delta``
    when the entropy is at or below ``target`` (it is collapsing: push harder), ``coef - delta`` above it,
    kept within ``[coef_min, coef_max]``.

    A NaN entropy (a step with no token to measure) leaves the coefficient as it is.
    """
    if not (0 <= coef_min <= coef_max and delta >= 0):
        raise ValueError(
            f"need 0 <= coef_min <= coef_max and delta >= 0 (got {coef_min}, {coef_max}, {delta})"
        )
    if math.isnan(entropy):
        return coef
    moved = coef + delta if entropy <= target else coef - delta
    return min(max(moved, coef_min), coef_max)


def applied_entropy_coef(coef: float, last_entropy: float, target: float) -> float:
    """The coefficient the next step's loss uses: ``coef`` while the last measured entropy is at or below
    ``target``, else 0, so the bonus only acts against a collapse (TRL's gating). Before the first
    measurement (``last_entropy`` inf) it is 0."""
    return coef if last_entropy <= target else 0.0
