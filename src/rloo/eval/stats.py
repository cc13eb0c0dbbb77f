"""Pure statistics of pairwise judging: both-order scores, confidence intervals, paired differences.

Verdicts are told from the model's side: ``"model"`` (the model's output was preferred), ``"reference"``,
or ``None`` (no usable answer: unparseable, failed, or not asked because the budget ran out).

The intervals are :mod:`rloo.algo.intervals`' (Wilson for a win rate, Agresti-Min for a paired difference;
the push gate uses the same ones), re-exported here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rloo.algo.intervals import Interval, difference_interval, rate_interval

__all__ = [
    "Interval",
    "difference_interval",
    "interval_record",
    "pair_score",
    "paired_difference",
    "rate_interval",
    "summarize_scores",
]

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


def paired_difference(a: Sequence[float | None], b: Sequence[float | None]) -> Interval | None:
    """Mean of ``a[i] - b[i]`` over examples where both scores exist, with :func:`difference_interval`:
    pairing removes the between-prompt variance that two independent intervals would keep. None when no
    example has both."""
    if len(a) != len(b):
        raise ValueError(f"paired scores must have equal lengths ({len(a)} != {len(b)})")
    return difference_interval([x - y for x, y in zip(a, b, strict=True) if x is not None and y is not None])


def summarize_scores(verdicts: Sequence[tuple[str | None, str | None]]) -> dict[str, object]:
    """Win rate with its Wilson interval (:func:`rate_interval`), tie / invalid counts and the order-agreement
    rate of one model's pairs."""
    scores = [pair_score(ab, ba) for ab, ba in verdicts]
    valid = [s for s in scores if s is not None]
    ci = rate_interval(valid)
    ties = sum(1 for s in valid if s == 0.5)
    return {
        # no valid pair, no rate: recorded as None (the report shows a dash, flat_metrics leaves it out)
        "win_rate": None if ci is None else ci.estimate,
        "win_rate_ci_low": None if ci is None else ci.low,
        "win_rate_ci_high": None if ci is None else ci.high,
        "num_pairs": len(scores),
        "num_valid": len(valid),
        "num_wins": sum(1 for s in valid if s == 1.0),
        "num_losses": sum(1 for s in valid if s == 0.0),
        "num_ties": ties,
        "num_invalid": len(scores) - len(valid),
        # fraction of fully judged pairs whose two orders agree: low agreement = a position-biased judge
        "order_agreement": (len(valid) - ties) / len(valid) if valid else None,
    }


def interval_record(ci: Interval | None) -> dict[str, Any]:
    """A paired difference as eval_results.json records it: ``estimate``, ``low``, ``high``, ``n`` and the
    pair ``ci95`` that the push gate reads (rloo.push.gate); every value None and n = 0 without one."""
    d = {"estimate": None, "low": None, "high": None, "n": 0} if ci is None else ci.as_dict()
    return {**d, "ci95": [d["low"], d["high"]]}
