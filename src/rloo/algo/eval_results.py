"""``eval_results.json``, the contract between the evaluation (which writes it) and the push gate (which reads
it): one typed :class:`EvalResults` and its JSON form, stdlib only (the push step's image has no torch)::

    {
      "trained":  {"win_rate": 0.61, "ci95": [0.55, 0.67]},   # trained model vs the reference completions
      "baseline": {"win_rate": 0.50, "ci95": [0.44, 0.56]},   # SFT model, same prompts, same judge
      "paired_difference": {"estimate": 0.11, "ci95": [0.04, 0.18]},   # trained minus SFT, paired per prompt
      "judge": {"model": "gpt-4o-mini", "base_url": "https://..."},
      "num_examples": 200, "invalid": 3, "ties": 12,
      "per_example": {"keys": ["3f2a...", ...], "trained": [1.0, 0.5, null, ...]}   # optional, see below
    }

Required: every key above but ``per_example``. Extra keys are kept in ``extra`` (the judge's own in
``judge_extra``) and ignored by the gate. Numbers must be finite, win rates and interval bounds in [0, 1] (the
difference in [-1, 1]) and ``low <= estimate <= high``, with ``ci95`` = [low, high]. Each is read into an
:class:`~rloo.algo.intervals.Interval`, the evaluation's own type. The evaluation writes the paired
difference's ``low``, ``high`` and ``n`` too.

``per_example`` holds the trained model's score on each example (1 win, 0.5 tie, 0 loss against the
reference, null when the judge gave no usable verdict), keyed by a digest of the example's prompt and
reference, and ``judge.template_sha256`` the judge prompt's digest: with them the gate compares a challenger
with the champion example by example.

A file that breaks the contract raises :class:`EvalResultsError`, whose one-line message names the first bad
key (the push gate reports it as a user error).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from .intervals import Interval

# the top-level keys the contract reads; any other is kept in EvalResults.extra
CONTRACT_KEYS = frozenset(
    {"trained", "baseline", "paired_difference", "judge", "num_examples", "invalid", "ties", "per_example"}
)


class EvalResultsError(ValueError):
    """An ``eval_results.json`` that breaks the contract; the message names the file and the first bad key."""


@dataclass(frozen=True)
class EvalResults:
    """One evaluation's results. ``baseline`` None: evaluated without an SFT model, which the gate refuses
    (its file has no ``baseline``); ``paired_difference`` None with a baseline: no example had a usable
    verdict for both models."""

    trained: Interval
    baseline: Interval | None
    paired_difference: Interval | None
    judge_model: str
    judge_base_url: str
    num_examples: int
    invalid: int
    ties: int
    extra: dict[str, Any] = field(default_factory=dict)  # the other top-level keys, as they are
    judge_template_sha256: str | None = None
    # (example key, the trained model's score or None: no usable verdict), in the file's order; None: not recorded
    per_example: tuple[tuple[str, float | None], ...] | None = None
    judge_extra: dict[str, Any] = field(default_factory=dict)  # the judge's other keys (its request counts)

    @property
    def example_scores(self) -> dict[str, float | None] | None:
        """Example key -> the trained model's score (None when not recorded)."""
        return None if self.per_example is None else dict(self.per_example)

    def to_dict(self) -> dict[str, Any]:
        judge = {"model": self.judge_model, "base_url": self.judge_base_url}
        if self.judge_template_sha256 is not None:
            judge["template_sha256"] = self.judge_template_sha256
        out: dict[str, Any] = {
            **self.extra,
            "num_examples": self.num_examples,
            "invalid": self.invalid,
            "ties": self.ties,
            "judge": {**judge, **self.judge_extra},
            "trained": _rate(self.trained),
            # no baseline, no difference; a baseline without usable pairs, a difference of nothing
            "paired_difference": None if self.baseline is None else _difference(self.paired_difference),
        }
        if self.baseline is not None:
            out["baseline"] = _rate(self.baseline)
        if self.per_example is not None:
            out["per_example"] = {
                "keys": [k for k, _ in self.per_example],
                "trained": [v for _, v in self.per_example],
            }
        return out

    def to_json(self) -> str:
        """The file's text: JSON every parser reads (no NaN or Infinity, which are not JSON), keys sorted."""
        return json.dumps(self.to_dict(), allow_nan=False, indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_dict(cls, data: Any, source: str = "eval_results.json") -> EvalResults:
        """A decoded file, checked against the contract (:class:`EvalResultsError` naming the first bad key)."""
        if not isinstance(data, dict):
            raise EvalResultsError(f"{source}: expected a JSON object at the top level.")
        judge_model = _get(data, "judge.model", source)
        judge_url = _get(data, "judge.base_url", source)
        if not isinstance(judge_model, str) or not judge_model:
            raise EvalResultsError(f"{source}: 'judge.model' must be a non-empty string.")
        template = data["judge"].get("template_sha256")
        judge_extra = {
            k: v for k, v in data["judge"].items() if k not in ("model", "base_url", "template_sha256")
        }
        return cls(
            trained=_interval(data, "trained", "win_rate", source, 0.0),
            baseline=_interval(data, "baseline", "win_rate", source, 0.0),
            paired_difference=_interval(data, "paired_difference", "estimate", source, -1.0),
            judge_model=judge_model,
            judge_base_url=str(judge_url or ""),
            num_examples=_count(data, "num_examples", source),
            invalid=_count(data, "invalid", source),
            ties=_count(data, "ties", source),
            extra={k: v for k, v in data.items() if k not in CONTRACT_KEYS},
            judge_template_sha256=template if isinstance(template, str) and template else None,
            per_example=_per_example(data.get("per_example"), source),
            judge_extra=judge_extra,
        )

    @classmethod
    def from_json(cls, text: str, source: str = "eval_results.json") -> EvalResults:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise EvalResultsError(
                f"{source}: not valid JSON ({e.__class__.__name__}); fix or regenerate it."
            ) from None
        return cls.from_dict(data, source)


def _rate(d: Interval) -> dict[str, Any]:
    return {"win_rate": d.estimate, "ci95": [d.low, d.high]}


def _difference(d: Interval | None) -> dict[str, Any]:
    """A paired difference as the evaluation writes it: ``estimate``, ``low``, ``high``, ``n`` and the pair
    ``ci95`` the gate reads; every value None and n = 0 without one."""
    record: dict[str, Any] = (
        {"estimate": None, "low": None, "high": None, "n": 0} if d is None else d.as_dict()
    )
    return {**record, "ci95": [record["low"], record["high"]]}


def _get(data: dict[str, Any], path: str, source: str) -> Any:
    node: Any = data
    parts = path.split(".")
    for i, part in enumerate(parts):
        if not isinstance(node, dict) or part not in node:
            # name the outermost missing key: 'paired_difference', not 'paired_difference.estimate'
            missing = ".".join(parts[: i + 1])
            raise EvalResultsError(
                f"{source}: missing required key {missing!r} (see the eval_results.json contract)."
            )
        node = node[part]
    return node


def _number(value: Any, path: str, source: str, lo: float, hi: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise EvalResultsError(f"{source}: {path!r} must be a finite number (got {value!r}).")
    if not lo <= value <= hi:
        raise EvalResultsError(f"{source}: {path!r} must be in [{lo:g}, {hi:g}] (got {value!r}).")
    return float(value)


def _interval(data: dict[str, Any], key: str, est_key: str, source: str, lo: float) -> Interval:
    """The mapping ``data[key]`` (``{est_key: estimate, "ci95": [low, high]}``) as an Interval; its count is
    the record's ``n`` where the evaluation wrote one, else unknown (None): the contract does not require it."""
    est = _number(_get(data, f"{key}.{est_key}", source), f"{key}.{est_key}", source, lo, 1.0)
    ci = _get(data, f"{key}.ci95", source)
    if not isinstance(ci, (list, tuple)) or len(ci) != 2:
        raise EvalResultsError(f"{source}: '{key}.ci95' must be a pair [low, high] (got {ci!r}).")
    low = _number(ci[0], f"{key}.ci95[0]", source, lo, 1.0)
    high = _number(ci[1], f"{key}.ci95[1]", source, lo, 1.0)
    # A tiny tolerance: an interval and its point estimate may be computed separately (rounding).
    if not low - 1e-9 <= est <= high + 1e-9:
        raise EvalResultsError(f"{source}: '{key}' has estimate {est} outside its ci95 [{low}, {high}].")
    n = data[key].get("n")
    return Interval(est, low, high, n if isinstance(n, int) and not isinstance(n, bool) else None)


def _count(data: dict[str, Any], key: str, source: str) -> int:
    v = _get(data, key, source)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise EvalResultsError(f"{source}: {key!r} must be a non-negative integer (got {v!r}).")
    return v


def _per_example(value: Any, source: str) -> tuple[tuple[str, float | None], ...] | None:
    if value is None:
        return None
    keys = value.get("keys") if isinstance(value, dict) else None
    scores = value.get("trained") if isinstance(value, dict) else None
    if not isinstance(keys, list) or not isinstance(scores, list) or len(keys) != len(scores):
        raise EvalResultsError(
            f"{source}: 'per_example' must hold two lists of equal length, 'keys' and 'trained'."
        )
    out = []
    for i, (k, v) in enumerate(zip(keys, scores, strict=True)):
        if not isinstance(k, str):
            raise EvalResultsError(f"{source}: 'per_example.keys[{i}]' must be a string (got {k!r}).")
        out.append((k, None if v is None else _number(v, f"per_example.trained[{i}]", source, 0.0, 1.0)))
    return tuple(out)
