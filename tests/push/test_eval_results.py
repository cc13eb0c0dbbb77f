"""eval_results.json, one typed value both sides use: the evaluation writes :class:`EvalResults`' JSON form
and the push gate reads it back into the same value.

The file is JSON that every parser reads (RFC 8259 has no NaN or Infinity; CPython's Lib/json/encoder.py
writes them unless ``allow_nan=False``), which the KFP and MLflow UIs show too."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rloo.algo.eval_results import EvalResults, EvalResultsError
from rloo.algo.intervals import Interval
from rloo.errors import UserError
from rloo.push.gate import CANDIDATE, CHAMPION, decide, load_eval_results


def _results(**change: object) -> EvalResults:
    fields: dict[str, object] = dict(
        trained=Interval(0.61, 0.55, 0.67),
        baseline=Interval(0.5, 0.44, 0.56),
        paired_difference=Interval(0.11, 0.04, 0.18, 200),
        judge_model="judge-model-x",
        judge_base_url="http://judge.local/v1",
        judge_template_sha256="t1",
        judge_extra={"requests": 800, "retries": 2, "statuses": {"200": 800}},
        num_examples=200,
        invalid=3,
        ties=12,
        # the same example twice (a dataset may repeat one): the file keeps both
        per_example=(("ex0", 1.0), ("ex1", None), ("ex0", 1.0), ("ex2", 0.5)),
        extra={"engine": "hf", "models": {"trained": {"path": "s3://b/run/model"}}, "settings": {"seed": 1}},
    )
    return EvalResults(**{**fields, **change})  # type: ignore[arg-type]


def test_the_json_form_reads_back_as_the_same_value(tmp_path: Path) -> None:
    results = _results()
    path = tmp_path / "eval_results.json"
    path.write_text(results.to_json())
    assert EvalResults.from_json(path.read_text()) == results
    assert load_eval_results(path) == results  # the push gate's reading
    data = json.loads(path.read_text())
    assert data["trained"] == {"win_rate": 0.61, "ci95": [0.55, 0.67]}
    assert data["paired_difference"] == {
        "estimate": 0.11,
        "low": 0.04,
        "high": 0.18,
        "n": 200,
        "ci95": [0.04, 0.18],
    }
    assert data["judge"] == {
        "model": "judge-model-x",
        "base_url": "http://judge.local/v1",
        "template_sha256": "t1",
        "requests": 800,
        "retries": 2,
        "statuses": {"200": 800},
    }
    assert data["per_example"] == {"keys": ["ex0", "ex1", "ex0", "ex2"], "trained": [1.0, None, 1.0, 0.5]}
    assert data["engine"] == "hf" and data["settings"] == {"seed": 1}
    assert path.read_text().endswith("}\n") and list(data) == sorted(data)


def test_the_gate_decides_on_what_it_read(tmp_path: Path) -> None:
    path = tmp_path / "eval_results.json"
    path.write_text(_results().to_json())
    assert decide(load_eval_results(path), margin=0.0).decision == CHAMPION
    path.write_text(_results(paired_difference=Interval(0.02, -0.01, 0.05, 200)).to_json())
    assert decide(load_eval_results(path), margin=0.0).decision == CANDIDATE


def test_an_evaluation_without_a_baseline_is_refused_by_the_gate(tmp_path: Path) -> None:
    """``rloo eval`` without --baseline_model writes no baseline and a null difference; the gate refuses such
    a file in one line (exit 2) naming the missing key."""
    results = _results(baseline=None, paired_difference=None)
    data = results.to_dict()
    assert "baseline" not in data and data["paired_difference"] is None
    path = tmp_path / "eval_results.json"
    path.write_text(results.to_json())
    with pytest.raises(
        UserError, match=r"missing required key 'baseline' \(see the eval_results.json contract\)\.$"
    ):
        load_eval_results(path)


def test_no_usable_pair_writes_an_empty_difference() -> None:
    data = _results(paired_difference=None).to_dict()
    assert data["paired_difference"] == {
        "estimate": None,
        "low": None,
        "high": None,
        "n": 0,
        "ci95": [None, None],
    }
    with pytest.raises(EvalResultsError, match=r"'paired_difference.estimate' must be a finite number"):
        EvalResults.from_dict(data)


def test_a_non_finite_number_is_never_written() -> None:
    with pytest.raises(ValueError, match="Out of range float values are not JSON compliant"):
        _results(trained=Interval(float("nan"), 0.5, 0.6)).to_json()
