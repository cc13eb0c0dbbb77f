"""``rloo demo`` run again into the same directory: the demo rebuilds its models and data each time, so a
rerun (the same settings, or another --updates / --seed) trains again over the previous demo and prints its
summary, instead of being refused as a changed run or finding "nothing to do" with no updates to summarise
(transformers ``src/transformers/training_args.py``: ``overwrite_output_dir``, the classic trainer's way to
train again over an output directory)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rloo.demo.cli import main


@pytest.mark.slow
def test_a_rerun_trains_again_and_summarises(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("RLOO_REPORT_TO", "none")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    out = tmp_path / "demo"
    for argv in (["--updates", "1"], ["--updates", "1"], ["--updates", "2", "--seed", "1"]):
        assert main(["--output_dir", str(out), *argv]) in (0, None)
        assert "demo done" in capsys.readouterr().err
    config = json.loads((out / "rloo_config.json").read_text())
    assert (config["max_steps"], config["seed"]) == (2, 1)  # the last command's run, not the first's
    updates = [json.loads(line)["update"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert updates == [1, 2]
