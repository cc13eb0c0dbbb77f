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


@pytest.mark.slow
def test_the_summary_says_how_to_train_the_same_run_yourself(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The demo's models and data, and the `rloo train` command that reruns it with flags of one's own: the
    printed command works as printed (another output directory, one more flag)."""
    import shlex

    from rloo.cli import main as rloo

    monkeypatch.setenv("RLOO_REPORT_TO", "none")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    out = tmp_path / "demo"
    assert main(["--output_dir", str(out), "--updates", "1"]) in (0, None)
    err = capsys.readouterr().err
    assert f"its models, data:  {out.resolve() / 'assets'}" in err
    (line,) = [x for x in err.splitlines() if "train it yourself:" in x]
    command = shlex.split(line.split("train it yourself:")[1].replace("[more flags]", ""))
    assert command[:2] == ["rloo", "train"]
    mine = tmp_path / "mine"
    argv = [a.replace("OTHER_DIR", str(mine)) for a in command[1:]]
    assert rloo([*argv, "--async_generation"]) in (0, None)
    rows = [json.loads(x) for x in (mine / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 1 and "async/staleness" in rows[0]
