from __future__ import annotations

import math

import numpy as np
import pytest

from rloo.eval.stats import MODEL, REFERENCE, bootstrap_ci, pair_score, paired_difference, summarize_scores


@pytest.mark.parametrize(
    ("ab", "ba", "score"),
    [
        (MODEL, MODEL, 1.0),
        (REFERENCE, REFERENCE, 0.0),
        (MODEL, REFERENCE, 0.5),
        (REFERENCE, MODEL, 0.5),
        (None, MODEL, None),
        (REFERENCE, None, None),
        (None, None, None),
    ],
)
def test_pair_score_both_orders(ab: str | None, ba: str | None, score: float | None) -> None:
    assert pair_score(ab, ba) == score


def test_pair_score_rejects_unknown_verdict() -> None:
    with pytest.raises(ValueError, match="verdict"):
        pair_score("A", MODEL)


def test_summarize_counts_invalid_apart_from_losses() -> None:
    verdicts = [
        (MODEL, MODEL),  # win
        (MODEL, MODEL),  # win
        (REFERENCE, REFERENCE),  # loss
        (MODEL, REFERENCE),  # orders disagree: tie
        (None, REFERENCE),  # invalid, not a loss
        (None, None),  # invalid
    ]
    s = summarize_scores(verdicts, samples=500, seed=0)
    assert (s["num_wins"], s["num_losses"], s["num_ties"], s["num_invalid"]) == (2, 1, 1, 2)
    assert s["num_valid"] == 4
    assert s["win_rate"] == pytest.approx((1 + 1 + 0 + 0.5) / 4)
    assert s["order_agreement"] == pytest.approx(3 / 4)


def test_summarize_with_no_valid_pair() -> None:
    s = summarize_scores([(None, MODEL)], samples=10)
    assert s["win_rate"] is None and s["order_agreement"] is None and s["num_invalid"] == 1


def test_bootstrap_constant_data_has_zero_width() -> None:
    ci = bootstrap_ci([0.5] * 40, samples=200, seed=1)
    assert (ci.estimate, ci.low, ci.high, ci.n) == (0.5, 0.5, 0.5, 40)


def test_bootstrap_matches_normal_approximation() -> None:
    # 400 wins out of 1000: the 95% interval is about 0.4 +- 1.96 * sqrt(0.24 / 1000) = +-0.0304
    values = [1.0] * 400 + [0.0] * 600
    ci = bootstrap_ci(values, samples=4000, seed=0)
    half = 1.96 * math.sqrt(0.4 * 0.6 / 1000)
    assert ci.estimate == pytest.approx(0.4)
    assert ci.low == pytest.approx(0.4 - half, abs=0.006)
    assert ci.high == pytest.approx(0.4 + half, abs=0.006)


def test_bootstrap_is_seeded_and_empty_is_none() -> None:
    x = np.random.default_rng(3).random(50)
    assert bootstrap_ci(x, samples=300, seed=7) == bootstrap_ci(x, samples=300, seed=7)
    assert bootstrap_ci(x, samples=300, seed=7) != bootstrap_ci(x, samples=300, seed=8)
    assert bootstrap_ci([], samples=10).estimate is None


def test_paired_difference_skips_incomplete_pairs() -> None:
    trained = [1.0, 1.0, 0.5, None, 0.0, 1.0]
    sft = [0.0, 1.0, 0.0, 1.0, None, 0.5]
    d = paired_difference(trained, sft, samples=500, seed=0)
    assert d.n == 4
    assert d.estimate == pytest.approx((1 + 0 + 0.5 + 0.5) / 4)
    assert d.low is not None and d.high is not None and d.low <= d.estimate <= d.high
    with pytest.raises(ValueError, match="equal lengths"):
        paired_difference([1.0], [1.0, 0.0])
