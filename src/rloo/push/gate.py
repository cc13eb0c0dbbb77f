"""The promotion gate, pure: a model's evaluation (:class:`rloo.algo.eval_results.EvalResults`, the
``eval_results.json`` the evaluation stage writes, read here) decides champion or candidate, against the SFT
model and, when there is one, against the current champion (:func:`decide`).

A challenger is compared with the champion example by example (:func:`compare_to_champion`): both were judged
against the same references, so the paired difference of their scores is a fair comparison when the examples
and the judge (model and prompt) are the same.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rloo.algo.eval_results import EvalResults, EvalResultsError
from rloo.algo.intervals import Interval, difference_interval
from rloo.errors import UserError

CHAMPION = "champion"
CANDIDATE = "candidate"


@dataclass(frozen=True)
class Champion:
    """The model that holds ``champion`` now, as a challenger is compared with it."""

    label: str  # e.g. "version 3 of run abc": how reasons name it
    results: EvalResults | None  # its evaluation; None when none could be read
    missing_why: str = ""  # why ``results`` is None
    damaged: bool = False  # its files do not match what was published (not an evaluation to redo)


@dataclass(frozen=True)
class Decision:
    decision: str  # CHAMPION or CANDIDATE
    reason: str
    # the paired difference with the champion it was compared with (None: not compared)
    against_champion: Interval | None = None
    champion: str | None = None  # how that champion is named (Champion.label)

    def against_champion_dict(self) -> dict[str, Any] | None:
        d = self.against_champion
        if d is None:
            return None
        return {"champion": self.champion, "estimate": d.estimate, "ci95": [d.low, d.high]}

    @property
    def promoted(self) -> bool:
        return self.decision == CHAMPION


def parse_eval_results(data: Any, source: str = "eval_results.json") -> EvalResults:
    """Validate a decoded eval_results.json; one-line UserError naming the first bad key."""
    try:
        return EvalResults.from_dict(data, source)
    except EvalResultsError as e:
        raise UserError(str(e)) from None


def load_eval_results(path: str | Path) -> EvalResults:
    p = Path(path)
    if not p.is_file():
        raise UserError(
            f"--eval_results {p}: no such file; pass the eval_results.json of the evaluation stage."
        )
    try:
        data = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(
            f"--eval_results {p}: not valid JSON ({e.__class__.__name__}); fix or regenerate it."
        ) from None
    return parse_eval_results(data, str(p))


def _shown(d: Interval, against: str) -> str:
    return f"paired win-rate difference against {against} {d.estimate:+.3f}, 95% CI [{d.low:+.3f}, {d.high:+.3f}]"


def compare_to_champion(candidate: EvalResults, champion: Champion) -> Interval | str:
    """The paired difference (candidate minus champion) of the two models' scores against the references,
    over the examples both were judged on; or why the two evaluations cannot be compared."""
    theirs = champion.results
    if theirs is None:
        return champion.missing_why or "its evaluation results could not be read"
    ours, their_scores = candidate.example_scores, theirs.example_scores
    if ours is None or their_scores is None:
        which = "this model's" if ours is None else "the champion's"
        return f"{which} eval_results.json has no per-example scores (evaluated before rloo recorded them)"
    if candidate.judge_model != theirs.judge_model:
        return f"it was judged by {theirs.judge_model!r}, this model by {candidate.judge_model!r}"
    if candidate.judge_template_sha256 != theirs.judge_template_sha256:
        return "it was judged with another judge prompt (--judge_template)"
    if set(ours) != set(their_scores):
        return "it was evaluated on other examples (dataset, split or num_examples differ)"
    keys = sorted(ours)
    mine = [ours[k] for k in keys]
    other = [their_scores[k] for k in keys]
    diffs = [a - b for a, b in zip(mine, other, strict=True) if a is not None and b is not None]
    d = difference_interval(diffs)
    return "no example has a usable verdict for both models" if d is None else d


def decide(results: EvalResults | None, margin: float, champion: Champion | None = None) -> Decision:
    """Champion iff the 95% lower bound of the paired win-rate difference is strictly above ``margin``,
    against the SFT model and, when a champion exists (of another run), against the champion as well.

    The first champion comes from the SFT comparison alone. A challenger is compared with the champion on
    the same examples (:func:`compare_to_champion`); when the two evaluations cannot be compared it stays a
    candidate, and the reason says why and what to do."""
    if results is None:
        return Decision(CANDIDATE, "no evaluation results were given, so the model cannot be promoted")
    if results.num_examples == 0:
        return Decision(CANDIDATE, "the evaluation has 0 examples, so there is no evidence to promote on")
    d = results.paired_difference
    if results.baseline is None or d is None:  # a file the contract reads always has both
        return Decision(
            CANDIDATE, "the evaluation has no SFT baseline, so there is no evidence to promote on"
        )
    shown = _shown(d, "SFT")
    if d.low <= margin:
        return Decision(CANDIDATE, f"{shown}: lower bound not above the margin {margin:+.3f}")
    if champion is None:
        return Decision(CHAMPION, f"{shown}: lower bound above the margin {margin:+.3f}")
    vs = compare_to_champion(results, champion)
    if isinstance(vs, str):
        vs = vs.rstrip(". ")
        if champion.damaged or champion.results is None:
            fix = "publish the champion's copy again, or push with --compare_to_champion false"
        else:
            fix = (
                "evaluate it with the champion's dataset and judge, or push with --compare_to_champion false"
            )
        return Decision(
            CANDIDATE, f"{shown}, but it cannot be compared with the champion, {champion.label}: {vs}; {fix}"
        )
    against = _shown(vs, f"the champion ({champion.label})")
    if vs.low > margin:
        reason = f"{shown}; {against}: both lower bounds above the margin {margin:+.3f}"
        return Decision(CHAMPION, reason, vs, champion.label)
    reason = f"{shown}; {against}: lower bound not above the margin {margin:+.3f}, the champion stays"
    return Decision(CANDIDATE, reason, vs, champion.label)
