"""The evaluation contract (``eval_results.json``) and the promotion gate, both pure.

Contract (written by the evaluation stage, read here)::

    {
      "trained":  {"win_rate": 0.61, "ci95": [0.55, 0.67]},   # trained model vs the reference completions
      "baseline": {"win_rate": 0.50, "ci95": [0.44, 0.56]},   # SFT model, same prompts, same judge
      "paired_difference": {"estimate": 0.11, "ci95": [0.04, 0.18]},   # trained minus SFT, paired per prompt
      "judge": {"model": "gpt-4o-mini", "base_url": "https://..."},
      "num_examples": 200, "invalid": 3, "ties": 12,
      "per_example": {"keys": ["3f2a...", ...], "trained": [1.0, 0.5, null, ...]}   # optional, see below
    }

Required: every key above but ``per_example``. Extra keys are kept in ``extra`` and ignored by the gate. Numbers must be finite,
win rates and interval bounds in [0, 1] (the difference in [-1, 1]) and ``low <= estimate <= high``, with
``ci95`` = [low, high]. Each is read into :class:`rloo.algo.intervals.Interval`, the evaluation's own type.

``per_example`` holds the trained model's score on each example (1 win, 0.5 tie, 0 loss against the
reference, null when the judge gave no usable verdict), keyed by a digest of the example's prompt and
reference, and ``judge.template_sha256`` the judge prompt's digest. With them a challenger is compared with
the current champion example by example (:func:`compare_to_champion`): both were judged against the same
references, so the paired difference of their scores is a fair comparison when the examples and the judge
(model and prompt) are the same.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rloo.algo.intervals import Interval, difference_interval
from rloo.errors import UserError

CHAMPION = "champion"
CANDIDATE = "candidate"


@dataclass(frozen=True)
class EvalResults:
    trained: Interval
    baseline: Interval
    paired_difference: Interval
    judge_model: str
    judge_base_url: str
    num_examples: int
    invalid: int
    ties: int
    extra: dict[str, Any] = field(default_factory=dict)
    judge_template_sha256: str | None = None
    # example key -> the trained model's score (None: no usable verdict); None when not recorded
    per_example: dict[str, float | None] | None = None


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


def _get(data: dict[str, Any], path: str, source: str) -> Any:
    node: Any = data
    parts = path.split(".")
    for i, part in enumerate(parts):
        if not isinstance(node, dict) or part not in node:
            # name the outermost missing key: 'paired_difference', not 'paired_difference.estimate'
            missing = ".".join(parts[: i + 1])
            raise UserError(
                f"{source}: missing required key {missing!r} (see the eval_results.json contract)."
            )
        node = node[part]
    return node


def _number(value: Any, path: str, source: str, lo: float, hi: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise UserError(f"{source}: {path!r} must be a finite number (got {value!r}).")
    if not lo <= value <= hi:
        raise UserError(f"{source}: {path!r} must be in [{lo:g}, {hi:g}] (got {value!r}).")
    return float(value)


def _interval(data: dict[str, Any], key: str, est_key: str, source: str, lo: float) -> Interval:
    """The mapping ``data[key]`` (``{est_key: estimate, "ci95": [low, high]}``) as an Interval; its count
    stays unknown (None): the contract does not require one."""
    est = _number(_get(data, f"{key}.{est_key}", source), f"{key}.{est_key}", source, lo, 1.0)
    ci = _get(data, f"{key}.ci95", source)
    if not isinstance(ci, (list, tuple)) or len(ci) != 2:
        raise UserError(f"{source}: '{key}.ci95' must be a pair [low, high] (got {ci!r}).")
    low = _number(ci[0], f"{key}.ci95[0]", source, lo, 1.0)
    high = _number(ci[1], f"{key}.ci95[1]", source, lo, 1.0)
    # A tiny tolerance: an interval and its point estimate may be computed separately (rounding).
    if not low - 1e-9 <= est <= high + 1e-9:
        raise UserError(f"{source}: '{key}' has estimate {est} outside its ci95 [{low}, {high}].")
    return Interval(est, low, high)


def _count(data: dict[str, Any], key: str, source: str) -> int:
    v = _get(data, key, source)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise UserError(f"{source}: {key!r} must be a non-negative integer (got {v!r}).")
    return v


def parse_eval_results(data: Any, source: str = "eval_results.json") -> EvalResults:
    """Validate a decoded eval_results.json; one-line UserError naming the first bad key."""
    if not isinstance(data, dict):
        raise UserError(f"{source}: expected a JSON object at the top level.")
    judge_model = _get(data, "judge.model", source)
    judge_url = _get(data, "judge.base_url", source)
    if not isinstance(judge_model, str) or not judge_model:
        raise UserError(f"{source}: 'judge.model' must be a non-empty string.")
    known = {
        "trained",
        "baseline",
        "paired_difference",
        "judge",
        "num_examples",
        "invalid",
        "ties",
        "per_example",
    }
    template = data["judge"].get("template_sha256")
    return EvalResults(
        trained=_interval(data, "trained", "win_rate", source, 0.0),
        baseline=_interval(data, "baseline", "win_rate", source, 0.0),
        paired_difference=_interval(data, "paired_difference", "estimate", source, -1.0),
        judge_model=judge_model,
        judge_base_url=str(judge_url or ""),
        num_examples=_count(data, "num_examples", source),
        invalid=_count(data, "invalid", source),
        ties=_count(data, "ties", source),
        extra={k: v for k, v in data.items() if k not in known},
        judge_template_sha256=template if isinstance(template, str) and template else None,
        per_example=_per_example(data.get("per_example"), source),
    )


def _per_example(value: Any, source: str) -> dict[str, float | None] | None:
    if value is None:
        return None
    keys = value.get("keys") if isinstance(value, dict) else None
    scores = value.get("trained") if isinstance(value, dict) else None
    if not isinstance(keys, list) or not isinstance(scores, list) or len(keys) != len(scores):
        raise UserError(f"{source}: 'per_example' must hold two lists of equal length, 'keys' and 'trained'.")
    out: dict[str, float | None] = {}
    for i, (k, v) in enumerate(zip(keys, scores, strict=True)):
        if not isinstance(k, str):
            raise UserError(f"{source}: 'per_example.keys[{i}]' must be a string (got {k!r}).")
        out[k] = None if v is None else _number(v, f"per_example.trained[{i}]", source, 0.0, 1.0)
    return out


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
    if candidate.per_example is None or theirs.per_example is None:
        which = "this model's" if candidate.per_example is None else "the champion's"
        return f"{which} eval_results.json has no per-example scores (evaluated before rloo recorded them)"
    if candidate.judge_model != theirs.judge_model:
        return f"it was judged by {theirs.judge_model!r}, this model by {candidate.judge_model!r}"
    if candidate.judge_template_sha256 != theirs.judge_template_sha256:
        return "it was judged with another judge prompt (--judge_template)"
    if set(candidate.per_example) != set(theirs.per_example):
        return "it was evaluated on other examples (dataset, split or num_examples differ)"
    keys = sorted(candidate.per_example)
    mine = [candidate.per_example[k] for k in keys]
    other = [theirs.per_example[k] for k in keys]
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
