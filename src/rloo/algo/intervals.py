"""Confidence intervals of judged win rates and paired differences: pure, closed-form, stdlib only.

Used by the evaluation stage (win rates, trained minus SFT) and by the push gate (a challenger minus the
champion, example by example). Closed-form, not bootstrapped: a percentile bootstrap of 32 wins out of 32
resamples nothing but wins and reports "100%-100%", an interval of zero width exactly where the evidence is
thinnest. The win rate gets Wilson's score interval (:func:`rate_interval`), the paired difference the
Agresti-Min adjusted interval for matched pairs (:func:`difference_interval`); both keep a sensible width at
the edges, stay inside the range of their values and always hold their estimate.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist


@dataclass(frozen=True)
class Interval:
    """A point estimate and its confidence interval, ``low <= estimate <= high``: the evaluation's win rates
    and paired differences, and the push gate's reading of them (``rloo.push.gate``).

    ``n`` is how many values it summarises; None where the source did not record it (eval_results.json gives
    a win rate and its ``ci95``, no count). No values make no interval: the functions below return None."""

    estimate: float
    low: float
    high: float
    n: int | None = None

    def as_dict(self) -> dict[str, float | int | None]:
        return {"estimate": self.estimate, "low": self.low, "high": self.high, "n": self.n}


def _z(confidence: float) -> float:
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1) (got {confidence!r})")
    return NormalDist().inv_cdf((1 + confidence) / 2)


def _checked(values: Sequence[float], lo: float, hi: float) -> list[float]:
    x = [float(v) for v in values]
    bad = next((v for v in x if not lo <= v <= hi), None)  # NaN fails both comparisons
    if bad is not None:
        raise ValueError(f"values must be in [{lo:g}, {hi:g}] (got {bad!r})")
    return x


def _bounded(estimate: float, low: float, high: float, lo: float, hi: float, n: int) -> Interval:
    """The interval cut to the values' range and widened, if rounding left it so, to hold its estimate: the
    push gate refuses an estimate outside its interval."""
    return Interval(estimate, max(lo, min(low, estimate)), min(hi, max(high, estimate)), n)


def rate_interval(values: Sequence[float], *, confidence: float = 0.95) -> Interval | None:
    """Mean of scores in [0, 1] (a win rate: 1 a win, 0 a loss, 0.5 a tie counted as half a win) with the
    Wilson score interval over ``n = len(values)`` pairs.

    Wilson's interval inverts the score test of a proportion, so it has close to nominal coverage at every
    rate, 0 and 1 included: 32 wins out of 32 give [0.893, 1] at 95%, 0 out of 10 give [0, 0.278], where the
    Wald and percentile-bootstrap intervals collapse to a point. With ties the scores are not 0/1, but a
    variable in [0, 1] with mean p has variance at most p(1 - p), the binomial variance Wilson assumes, so
    the interval is then a little conservative, never too narrow. Empty input: None (no rate to bound).
    """
    x = _checked(values, 0.0, 1.0)
    n = len(x)
    if n == 0:
        return None
    z2 = _z(confidence) ** 2
    p = sum(x) / n
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = math.sqrt(z2) * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return _bounded(p, centre - half, centre + half, 0.0, 1.0, n)


def difference_interval(diffs: Sequence[float], *, confidence: float = 0.95) -> Interval | None:
    """Mean of paired differences in [-1, 1] (one model's score minus the other's on the same example) with
    the Agresti-Min adjusted interval for matched pairs.

    Agresti and Min (2005, "Simple improved confidence intervals for comparing matched proportions") add one
    half to each cell of the paired 2x2 table, i.e. two pseudo-pairs: half a +1, half a -1 and one 0. The
    Wald interval of the adjusted mean then uses the observed spread of the differences (what pairing buys:
    the between-example variance cancels) yet never collapses: 32 differences of +1 give [0.843, 1] at 95%,
    32 of 0 give [-0.058, 0.058]. Differences of graded scores (0.5 for a tie) enter with their values, as
    the table's cells would with fractional counts. The estimate is the plain mean, inside the interval.
    Empty input: None (no difference to bound).
    """
    x = _checked(diffs, -1.0, 1.0)
    n = len(x)
    if n == 0:
        return None
    m = n + 2  # the pseudo-pairs: +1 and -1 with weight 1/2 each, 0 with weight 1
    mean = sum(x) / m
    second = (sum(v * v for v in x) + 1.0) / m
    half = _z(confidence) * math.sqrt(max(second - mean * mean, 0.0) / m)
    return _bounded(sum(x) / n, mean - half, mean + half, -1.0, 1.0, n)
