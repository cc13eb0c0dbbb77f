"""The trainer's metrics logger: buffering until open, metrics.jsonl, resume trimming, samples, plots, and
fan-out to sinks that may fail (no server needed)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from rloo.tracking import plot_training_curves, sinks_from_env
from rloo.tracking.samples import samples_html, samples_json
from rloo.training.metrics import MetricsLogger

ROWS = [
    {"query": "<b>hi</b> & bye", "response": "ok", "score": 0.5},
    {"query": "q2", "response": "r2", "score": None},
]


class RecordingSink:
    """A sink that remembers every call (the real sinks are tested against real servers)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def open(self, output_dir: Path) -> None:
        self.calls.append(("open", output_dir))

    def log_params(self, params: dict) -> None:
        self.calls.append(("params", params))

    def log_metrics(self, metrics: dict, step: int, *, timestamp: float | None = None) -> None:
        self.calls.append(("metrics", (step, metrics)))

    def log_artifact(self, local_path: Any, artifact_path: str | None = None) -> None:
        self.calls.append(("artifact", (Path(local_path).name, artifact_path)))

    def log_text(self, text: str, artifact_file: str) -> None:
        self.calls.append(("text", artifact_file))

    def finish(self, status: str = "FINISHED") -> None:
        self.calls.append(("finish", status))

    def kinds(self) -> list[str]:
        return [c[0] for c in self.calls]


class BrokenSink(RecordingSink):
    def log_metrics(self, metrics: dict, step: int, *, timestamp: float | None = None) -> None:
        raise ConnectionError("sink down")


def _logger(*sinks: Any) -> MetricsLogger:
    return MetricsLogger(total_updates=5, show_progress=False, sinks=list(sinks))


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_nothing_is_written_or_sent_before_open(tmp_path: Path) -> None:
    sink = RecordingSink()
    logger = _logger(sink)
    logger.log_params({"lr": 1e-3})
    logger.log({"update": 1, "objective/kl": 0.1})
    logger.samples(1, ROWS)
    out = tmp_path / "out"
    assert not out.exists() and sink.calls == []
    logger.open(out)
    assert sink.kinds() == ["open", "params", "metrics", "artifact", "artifact"]
    assert sink.calls[2] == ("metrics", (1, {"objective/kl": 0.1}))
    assert [r["update"] for r in _lines(out / "metrics.jsonl")] == [1]
    logger.log({"update": 2, "objective/kl": float("nan"), "objective/scores": 1.0})
    logger.close("FINISHED")
    assert _lines(out / "metrics.jsonl")[1]["objective/kl"] is None  # NaN is "not measured"
    assert sink.calls[-2:] == [("artifact", ("training_curves.png", "plots")), ("finish", "FINISHED")]
    assert (out / "plots" / "training_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_run_that_never_opened_leaves_nothing(tmp_path: Path) -> None:
    sink = RecordingSink()
    logger = _logger(sink)
    logger.log({"update": 1, "x": 1.0})
    logger.close("FAILED")
    assert sink.calls == [("finish", "FAILED")]  # a sink with no items ends nothing (see MlflowSink)
    assert list(tmp_path.iterdir()) == []


def test_samples_are_kept_as_text_html_and_json(tmp_path: Path) -> None:
    logger = _logger()
    logger.open(tmp_path)
    logger.samples(3, ROWS)
    d = tmp_path / "samples"
    assert sorted(p.name for p in d.iterdir()) == [
        "update_000003.html",
        "update_000003.json",
        "update_000003.txt",
    ]
    html = (d / "update_000003.html").read_text()
    assert "&lt;b&gt;hi&lt;/b&gt; &amp; bye" in html and "<b>hi" not in html and "None" in html
    table = json.loads((d / "update_000003.json").read_text())
    assert table["update"] == 3 and table["rows"][0] == {
        "query": "<b>hi</b> & bye",
        "response": "ok",
        "score": 0.5,
    }
    assert [r["update"] for r in _lines(tmp_path / "samples.jsonl")] == [3, 3]
    assert json.loads(samples_json(1, ROWS))["columns"] == ["query", "response", "score"]
    assert samples_html(1, []).count("<tr>") == 1


def test_resume_keeps_history_up_to_the_checkpoint_and_replays_it(tmp_path: Path) -> None:
    first = _logger()
    first.open(tmp_path)
    for u in (1, 2, 3, 4):
        first.log({"update": u, "objective/scores": float(u)})
        if u in (1, 3):
            first.samples(u, ROWS)
    # the crash cut the last line short
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"update": 5, "objective/sc')
    sink = RecordingSink()
    resumed = _logger(sink)
    resumed.open(tmp_path, keep_until_update=2)
    assert [r["update"] for r in _lines(tmp_path / "metrics.jsonl")] == [1, 2]
    assert [r["update"] for r in resumed.history] == [1, 2]
    assert [r["update"] for r in _lines(tmp_path / "samples.jsonl")] == [1, 1]
    assert sorted(p.name for p in (tmp_path / "samples").iterdir()) == [
        "update_000001.html",
        "update_000001.json",
        "update_000001.txt",
    ]
    replayed = [c[1][0] for c in sink.calls if c[0] == "metrics"]
    assert replayed == [1, 2]  # a fresh MLflow run gets the whole curve
    assert ("artifact", ("update_000001.html", "samples")) in sink.calls
    resumed.log({"update": 3, "objective/scores": 30.0})
    resumed.close()
    assert [r["objective/scores"] for r in _lines(tmp_path / "metrics.jsonl")] == [1.0, 2.0, 30.0]


def test_resume_without_a_metrics_file_starts_empty(tmp_path: Path) -> None:
    logger = _logger()
    logger.open(tmp_path / "new", keep_until_update=7)
    assert (tmp_path / "new" / "metrics.jsonl").read_text() == "" and logger.history == []


def test_a_failing_sink_is_dropped_and_training_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    good, bad = RecordingSink(), BrokenSink()
    logger = _logger(bad, good)
    logger.open(tmp_path)
    logger.log({"update": 1, "x": 1.0})
    logger.log({"update": 2, "x": 2.0})
    logger.close("FINISHED")
    assert [c[1][0] for c in good.calls if c[0] == "metrics"] == [1, 2]
    assert "finish" not in bad.kinds()
    assert "BrokenSink.log_metrics failed" in caplog.text
    assert len(_lines(tmp_path / "metrics.jsonl")) == 2


def test_default_sinks_follow_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("RLOO_REPORT_TO", raising=False)
    assert sinks_from_env() == []
    assert MetricsLogger(total_updates=1, show_progress=False).sinks == []
    monkeypatch.setenv("RLOO_REPORT_TO", "mlflow")  # no URI: the embedded store, nothing to check up front
    (sink,) = sinks_from_env()
    assert type(sink).__name__ == "MlflowSink" and sink.run_id is None
    with pytest.raises(Exception, match="must be 'mlflow' or 'none'"):
        sinks_from_env("wandb")


def test_training_curves_plot_only_what_is_there(tmp_path: Path) -> None:
    history = [
        {"update": u, "objective/kl": 0.1 * u, "eps": None, "val/ratio": float("nan")} for u in (1, 2, 3)
    ]
    png = plot_training_curves(history, tmp_path / "c.png")
    assert png is not None and png.stat().st_size > 1000
    assert plot_training_curves([{"update": 1, "other": 1.0}], tmp_path / "none.png") is None
    assert not (tmp_path / "none.png").exists()
