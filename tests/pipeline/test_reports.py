"""The KFP UI summaries: headline numbers computed by hand, Markdown that survives hostile text."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rloo.pipeline import reports as R


def _history() -> list[dict[str, float]]:
    # scores 0.1, 0.2, 0.3, 0.4, 0.5 over 5 updates of 4 episodes, 0.5 s each
    return [
        {
            "update": i,
            "episode": 4 * i,
            "objective/scores": i / 10,
            "objective/kl": 0.01 * i,
            "time/update_s": 0.5,
        }
        for i in range(1, 6)
    ]


def test_train_headline_by_hand() -> None:
    h = R.train_headline(_history())
    assert h["final_score"] == pytest.approx((0.3 + 0.4 + 0.5) / 3)  # mean of the last 3 = 0.4
    assert h["initial_score"] == pytest.approx((0.1 + 0.2 + 0.3) / 3)  # mean of the first 3 = 0.2
    assert h["final_kl"] == pytest.approx((0.03 + 0.04 + 0.05) / 3)
    assert (h["updates"], h["episodes"], h["train_seconds"]) == (5.0, 20.0, 2.5)
    assert "final_entropy" not in h  # never logged, never invented
    assert R.train_headline([]) == {}


def test_history_and_samples_from_an_output_dir(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _history()))
    (tmp_path / "samples").mkdir()
    for step in (1, 11):
        rows = [{"query": "q|1", "response": "<b>x</b>\nnew line", "score": 0.5}]
        (tmp_path / "samples" / f"update_{step:06d}.json").write_text(
            json.dumps({"update": step, "rows": rows})
        )
    assert len(R.read_history(tmp_path)) == 5
    update, rows = R.latest_samples(tmp_path) or (0, [])
    assert update == 11
    md = R.train_markdown(
        R.train_headline(R.read_history(tmp_path)), "s3://b/m", "MLflow run: x", (update, rows)
    )
    # a '|' in text would split a table cell; HTML would render; a newline would end the row
    assert "| q\\|1 | &lt;b>x&lt;/b> new line | 0.5 |" in md
    assert "### Sample generations (update 11)" in md and "| final_score | 0.4 |" in md
    assert R.latest_samples(tmp_path / "nothing") is None and R.read_history(tmp_path / "nothing") == []


def test_eval_and_push_markdown() -> None:
    values = {
        "trained_win_rate": 0.75,
        "trained_win_rate_ci_low": 0.6,
        "trained_win_rate_ci_high": 0.9,
        "trained_num_valid": 32.0,
        "baseline_win_rate": 0.5,
        "diff_trained_minus_baseline_estimate": 0.25,
        "diff_trained_minus_baseline_low": 0.1,
        "diff_trained_minus_baseline_high": 0.4,
    }
    md = R.eval_markdown(values, "s3://b/eval", "link")
    assert "| trained | 0.75 | [0.600, 0.900] | 32 |" in md
    assert "| SFT | 0.5 | [nan, nan] |" in md  # a missing interval shows as such, not as a number
    assert "Trained minus SFT: +0.250 (95% CI [+0.100, +0.400])" in md
    mlflow = {"run_id": "r" * 32, "model_name": "rloo", "version": "3", "model_uri": "models:/" + "m" * 200}
    push = R.push_markdown(
        {
            "decision": "champion",
            "reason": "lower bound above margin",
            "storage": {"uri": "u"},
            "mlflow": mlflow,
        },
        "l",
    )
    assert "Decision: **champion**" in push and "- **storage**: uri: u" in push
    assert "version: 3" in push and "m" * 200 in push  # the record in full, not cut mid-way
    vs = {"champion": "version 2 (run r)", "estimate": 0.125, "ci95": [0.0625, 0.25]}
    challenger = R.push_markdown({"decision": "champion", "against_champion": vs}, "l")
    assert "Against the champion, version 2 (run r): +0.125 (95% CI [+0.062, +0.250])" in challenger


def test_stage_run_link(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mlflow.tracking import MlflowClient

    from rloo.tracking.lifecycle import start_stage_run

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert "not configured" in R.stage_run_link("train", "run-1")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    stage = start_stage_run("train", tracking_uri=uri, client=client, pipeline_run_id="run-1", experiment="e")
    link = R.stage_run_link("train", "run-1", uri, experiment="e")
    assert f"MLflow run `{stage.run_id}`" in link and f"mlflow ui --backend-store-uri {uri}" in link
    assert "no run of stage `eval`" in R.stage_run_link("eval", "run-1", uri, experiment="e")
    assert "no run of stage `train`" in R.stage_run_link("train", "run-2", uri, experiment="e")
