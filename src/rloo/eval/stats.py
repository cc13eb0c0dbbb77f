"""Pure statistics of pairwise judging: both-order scores, bootstrap intervals, paired differences.

Verdicts are told from the model's side: ``"model"`` (the model's output was preferred), ``"reference"``,
or ``None`` (no usable answer: unparseable, failed, or not asked because the budget ran out).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

MODEL = "model"
REFERENCE = "reference"


def pair_score(verdict_ab: str | None, verdict_ba: str | None) -> float | None:
    """MT-Bench style two-order score: 1 both orders prefer the model, 0 both prefer the reference, 0.5 when
    they disagree (position bias decided it, a tie). ``None`` when either order has no usable verdict: such a
    pair is counted as invalid, never as a loss."""
    for v in (verdict_ab, verdict_ba):
        if v not in (MODEL, REFERENCE, None):
            raise ValueError(f"verdict must be {MODEL!r}, {REFERENCE!r} or None (got {v!r})")
    if verdict_ab is None or verdict_ba is None:
        return None
    if verdict_ab == verdict_ba:
        return 1.0 if verdict_ab == MODEL else 0.0
    return 0.5


@dataclass(frozen=True)
class Interval:
    estimate: float | None
    low: float | None
    high: float | None
    n: int

    def as_dict(self) -> dict[str, float | int | None]:
        return {"estimate": self.estimate, "low": self.low, "high": self.high, "n": self.n}


def bootstrap_ci(
    values: Sequence[float], *, samples: int = 10000, seed: int = 0, confidence: float = 0.95
) -> Interval:
    """Mean of ``values`` with a percentile-bootstrap interval (resampling the values with replacement)."""
    x = np.asarray(values, dtype=np.float64)
    if x.size == 0:
        return Interval(None, None, None, 0)
    rng = np.random.default_rng(seed)
    means = np.empty(samples)
    # chunked so 10k resamples of 10k examples do not allocate 800 MB at once
    chunk = max(1, 2_000_000 // x.size)
    for start in range(0, samples, chunk):
        stop = min(samples, start + chunk)
        idx = rng.integers(0, x.size, size=(stop - start, x.size))
        means[start:stop] = x[idx].mean(axis=1)
    alpha = (1 - confidence) / 2
    low, high = np.quantile(means, [alpha, 1 - alpha])
    return Interval(float(x.mean()), float(low), float(high), int(x.size))


def paired_difference(
    a: Sequence[float | None], b: Sequence[float | None], *, samples: int = 10000, seed: int = 0
) -> Interval:
    """Mean of ``a[i] - b[i]`` over examples where both scores exist, with a bootstrap interval over
    examples: pairing removes the between-prompt variance that two independent intervals would keep."""
    if len(a) != len(b):
        raise ValueError(f"paired scores must have equal lengths ({len(a)} != {len(b)})")
    diffs = [x - y for x, y in zip(a, b, strict=True) if x is not None and y is not None]
    return bootstrap_ci(diffs, samples=samples, seed=seed)


def summarize_scores(
    verdicts: Sequence[tuple[str | None, str | None]], *, samples: int = 10000, seed: int = 0
) -> dict[str, object]:
    """Win rate with interval, tie / invalid counts and the order-agreement rate of one model's pairs."""
    scores = [pair_score(ab, ba) for ab, ba in verdicts]
    valid = [s for s in scores if s is not None]
    ci = bootstrap_ci(valid, samples=samples, seed=seed)
    ties = sum(1 for s in valid if s == 0.5)
    return {
        "win_rate": ci.estimate,
        "win_rate_ci_low": ci.low,
        "win_rate_ci_high": ci.high,
        "num_pairs": len(scores),
        "num_valid": len(valid),
        "num_wins": sum(1 for s in valid if s == 1.0),
        "num_losses": sum(1 for s in valid if s == 0.0),
        "num_ties": ties,
        "num_invalid": len(scores) - len(valid),
        # fraction of fully judged pairs whose two orders agree: low agreement = a position-biased judge
        "order_agreement": (len(valid) - ties) / len(valid) if valid else None,
    }
