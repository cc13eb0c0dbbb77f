"""Pure statistics of pairwise judging: both-order scores, confidence intervals, paired differences, and the
agreement of a reward model with the judge on the same pairs.

Verdicts are told from the model's side: ``"model"`` (the model's output was preferred), ``"reference"``,
or ``None`` (no usable answer: unparseable, failed, or not asked because the budget ran out).

The intervals are :mod:`rloo.algo.intervals`' (Wilson for a win rate, Agresti-Min for a paired difference;
the push gate uses the same ones), and the two-order score is :func:`rloo.judging.pairwise.pair_score` (the
training's pairwise judge reward too), re-exported here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rloo.algo.intervals import Interval, difference_interval, rate_interval
from rloo.judging.pairwise import MODEL, REFERENCE, pair_score

__all__ = [
    "MODEL",
    "REFERENCE",
    "Interval",
    "difference_interval",
    "interval_record",
    "pair_score",
    "paired_difference",
    "rate_interval",
    "rm_agreement",
    "rm_agreement_record",
    "summarize_reward_model",
    "summarize_scores",
]


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


def _rm_preference(model_score: float, reference_score: float) -> float:
    """1 when the reward model scores the model's output above the reference, 0 below, 0.5 equal."""
    return 1.0 if model_score > reference_score else 0.0 if model_score < reference_score else 0.5


def rm_agreement(pair: float | None, model_score: float, reference_score: float) -> float | None:
    """Whether a reward model agrees with the judge on one pair (a model output against its reference).

    ``pair``: the judge's :func:`pair_score`. Only a *decided* pair counts: both orders picked the same side
    (1 or 0); a tie (the orders disagree, 0.5) or an invalid pair (None) gives None, since the judge then
    picked nothing to agree with. Then 1 when the side the reward model scores higher is the judge's pick, 0
    when it is the other side, 0.5 when the two scores are equal (no side is higher: half, as a tie counts
    in a win rate)."""
    if pair not in (0.0, 1.0):
        return None
    rm = _rm_preference(model_score, reference_score)
    return rm if rm == 0.5 else float(rm == pair)


def summarize_reward_model(
    pairs: Sequence[float | None], model_scores: Sequence[float], reference_scores: Sequence[float]
) -> dict[str, Any]:
    """One model's pairs seen by the reward model: the judge/reward-model agreement over its decided pairs
    (:func:`rm_agreement`) with its Wilson interval (:func:`rate_interval`) and count, the reward model's own
    win rate against the references (ties half) and its mean score of the model's outputs. ``pairs``: the
    judge's :func:`pair_score` of each example; the scores: the reward model's, example by example."""
    if not len(pairs) == len(model_scores) == len(reference_scores):
        raise ValueError(
            f"pairs and scores must have equal lengths ({len(pairs)}, {len(model_scores)}, {len(reference_scores)})"
        )
    agree = [rm_agreement(p, m, r) for p, m, r in zip(pairs, model_scores, reference_scores, strict=True)]
    decided = [a for a in agree if a is not None]
    ci = rate_interval(decided)
    wins = rate_interval([_rm_preference(m, r) for m, r in zip(model_scores, reference_scores, strict=True)])
    return {
        "judge_rm_agreement": None if ci is None else ci.estimate,
        "judge_rm_agreement_ci_low": None if ci is None else ci.low,
        "judge_rm_agreement_ci_high": None if ci is None else ci.high,
        "judge_rm_agreement_n": len(decided),
        "rm_win_rate": None if wins is None else wins.estimate,
        "rm_score_mean": sum(model_scores) / len(model_scores) if model_scores else None,
    }


def rm_agreement_record(
    by_label: dict[str, tuple[Sequence[float | None], Sequence[float]]], reference_scores: Sequence[float]
) -> dict[str, Any]:
    """The judge/reward-model agreement over the decided pairs of every model together (``by_label``: each
    model's judge :func:`pair_score` and reward-model scores, example by example, against the same
    references), as :func:`interval_record` writes it, with ``num_skipped`` (the pairs the judge did not
    decide: ties and invalid pairs) and the references' mean score."""
    agree = [
        rm_agreement(p, m, r)
        for pairs, scores in by_label.values()
        for p, m, r in zip(pairs, scores, reference_scores, strict=True)
    ]
    decided = [a for a in agree if a is not None]
    return {
        **interval_record(rate_interval(decided)),
        "num_skipped": len(agree) - len(decided),
        "reference_rm_score_mean": sum(reference_scores) / len(reference_scores)
        if reference_scores
        else None,
    }
