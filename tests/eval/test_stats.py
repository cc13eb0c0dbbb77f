from __future__ import annotations

import math

import numpy as np
import pytest

from rloo.eval.stats import (
    MODEL,
    REFERENCE,
    Interval,
    difference_interval,
    interval_record,
    pair_score,
    paired_difference,
    rate_interval,
    summarize_scores,
)


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
    s = summarize_scores(verdicts)
    assert (s["num_wins"], s["num_losses"], s["num_ties"], s["num_invalid"]) == (2, 1, 1, 2)
    assert s["num_valid"] == 4
    assert s["win_rate"] == pytest.approx((1 + 1 + 0 + 0.5) / 4)
    assert s["order_agreement"] == pytest.approx(3 / 4)


def test_summarize_with_no_valid_pair() -> None:
    s = summarize_scores([(None, MODEL)])
    assert s["win_rate"] is None and s["order_agreement"] is None and s["num_invalid"] == 1
    assert s["win_rate_ci_low"] is None and s["win_rate_ci_high"] is None


def test_win_rate_interval_is_wilsons_and_does_not_collapse_at_the_edges() -> None:
    # Wilson at 95% (z = 1.959964), by hand: 32/32 -> centre (1 + z^2/64) / (1 + z^2/32) = 0.946410, half-width
    # z * sqrt(z^2 / (4 * 32^2)) / (1 + z^2/32) = 0.053589: [0.892821, 1]; 0/10 -> [0, 2 * 0.138767]
    all_wins = rate_interval([1.0] * 32)
    assert all_wins is not None
    assert (all_wins.estimate, all_wins.high, all_wins.n) == (1.0, 1.0, 32)
    assert all_wins.low == pytest.approx(0.892821, abs=1e-6)
    ci = rate_interval([0.0] * 10)
    assert ci is not None and (ci.estimate, ci.low) == (0.0, 0.0)
    assert ci.high == pytest.approx(0.277533, abs=1e-6)


def test_summarized_win_rate_interval_at_32_of_32() -> None:
    s = summarize_scores([(MODEL, MODEL)] * 32)
    assert s["win_rate"] == 1.0 and s["win_rate_ci_high"] == 1.0
    assert s["win_rate_ci_low"] == pytest.approx(0.892821, abs=1e-6)
    s = summarize_scores([(REFERENCE, REFERENCE)] * 10)
    assert (s["win_rate"], s["win_rate_ci_low"]) == (0.0, 0.0)
    assert s["win_rate_ci_high"] == pytest.approx(0.277533, abs=1e-6)


def test_ties_count_as_half_a_win() -> None:
    # 8 wins, 8 ties, 16 losses: p = (8 + 4) / 32 = 0.375 over n = 32 valid pairs
    ci = rate_interval([1.0] * 8 + [0.5] * 8 + [0.0] * 16)
    z2 = 1.959963984540054**2
    centre = (0.375 + z2 / 64) / (1 + z2 / 32)
    half = math.sqrt(z2) * math.sqrt(0.375 * 0.625 / 32 + z2 / (4 * 32 * 32)) / (1 + z2 / 32)
    assert ci is not None and (ci.estimate, ci.n) == (0.375, 32)
    assert (ci.low, ci.high) == pytest.approx((centre - half, centre + half))


def test_wilson_matches_the_normal_approximation_for_many_pairs() -> None:
    # 400 wins out of 1000: the 95% interval is about 0.4 +- 1.96 * sqrt(0.24 / 1000) = +-0.0304
    ci = rate_interval([1.0] * 400 + [0.0] * 600)
    half = 1.96 * math.sqrt(0.4 * 0.6 / 1000)
    assert ci is not None and ci.estimate == pytest.approx(0.4)
    assert ci.low == pytest.approx(0.4 - half, abs=0.002)
    assert ci.high == pytest.approx(0.4 + half, abs=0.002)


def test_empty_input_has_no_interval_and_out_of_range_values_are_refused() -> None:
    assert (
        rate_interval([]) is None
        and difference_interval([]) is None
        and paired_difference([None], [1.0]) is None
    )
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        rate_interval([0.5, 1.5])
    with pytest.raises(ValueError, match=r"\[-1, 1\]"):
        difference_interval([0.0, float("nan")])


def test_paired_difference_does_not_collapse_when_all_differences_are_equal() -> None:
    # Agresti-Min: two pseudo-pairs (+1 and -1 at weight 1/2, 0 at weight 1). 32 differences of +1:
    # mean 32/34, second moment 33/34, half-width z * sqrt((33/34 - (32/34)^2) / 34) = 0.097869
    d = paired_difference([1.0] * 32, [0.0] * 32)
    assert d is not None
    assert (d.estimate, d.high, d.n) == (1.0, 1.0, 32)
    assert d.low == pytest.approx(32 / 34 - 0.097869, abs=1e-6)
    # the same scores twice: a difference of exactly 0, with an interval of nonzero width around it
    same = [1.0, 0.0, 0.5, 1.0] * 8
    d = paired_difference(same, same)
    assert d is not None and d.estimate == 0.0
    assert d.high == pytest.approx(1.959964 * math.sqrt(1 / 34 / 34), abs=1e-6) and d.low == -d.high
    d = paired_difference([0.0] * 32, [1.0] * 32)
    assert (
        d is not None
        and (d.estimate, d.low) == (-1.0, -1.0)
        and d.high == pytest.approx(-32 / 34 + 0.097869, abs=1e-6)
    )


@pytest.mark.parametrize("n", [1, 2, 3, 5, 32, 200])
def test_intervals_stay_in_range_and_hold_their_estimate(n: int) -> None:
    """What the push gate checks of eval_results.json: bounds inside [0, 1] / [-1, 1], low <= estimate <= high,
    for every n, edges included."""
    rng = np.random.default_rng(n)
    cases = [rng.choice([0.0, 0.5, 1.0], size=n, p=p) for p in ([1, 0, 0], [0, 0, 1], [0.2, 0.3, 0.5])]
    cases += [rng.choice([0.0, 0.5, 1.0], size=n) for _ in range(50)]
    for a in cases:
        for b in cases[:6]:
            for ci, lo in ((rate_interval(a), 0.0), (paired_difference(list(a), list(b)), -1.0)):
                assert ci is not None and ci.n == n
                assert lo <= ci.low <= ci.estimate <= ci.high <= 1.0, (a, b, ci)
                assert ci.high - ci.low > 0.01  # never collapsed to a point


def test_paired_difference_skips_incomplete_pairs() -> None:
    trained = [1.0, 1.0, 0.5, None, 0.0, 1.0]
    sft = [0.0, 1.0, 0.0, 1.0, None, 0.5]
    d = paired_difference(trained, sft)
    assert d is not None and d.n == 4
    assert d.estimate == pytest.approx((1 + 0 + 0.5 + 0.5) / 4)
    assert d.low <= d.estimate <= d.high
    with pytest.raises(ValueError, match="equal lengths"):
        paired_difference([1.0], [1.0, 0.0])


def test_interval_record_is_what_eval_results_json_holds() -> None:
    """The paired difference's record: the interval's fields and the ``ci95`` pair the push gate reads; the
    same keys, all None and n = 0, when no example has both scores."""
    d = Interval(0.25, 0.1, 0.4, 8)
    assert interval_record(d) == {"estimate": 0.25, "low": 0.1, "high": 0.4, "n": 8, "ci95": [0.1, 0.4]}
    none = {"estimate": None, "low": None, "high": None, "n": 0, "ci95": [None, None]}
    assert interval_record(paired_difference([None], [1.0])) == none
