"""The demo commands write where they were told and nowhere else: ``rloo demo --output_dir X`` keeps its models
and dataset under X (not in a sibling ``X-assets``), and a local pipeline run refused at validation leaves
nothing it built in its work directory."""

from __future__ import annotations

from pathlib import Path

import pytest

from rloo.cli import main


@pytest.mark.slow
def test_rloo_demo_writes_nothing_beside_its_output_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    parent = tmp_path / "runs"
    parent.mkdir()
    (parent / "earlier-run").mkdir()
    monkeypatch.chdir(parent)  # nothing in the working directory either
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    out = parent / "demo"
    assert main(["demo", "--output_dir", str(out), "--updates", "1"]) == 0, capsys.readouterr().err
    assert sorted(p.name for p in parent.iterdir()) == ["demo", "earlier-run"]
    assert (out / "config.json").is_file()  # the trained model
    assert (out / "assets" / "models" / "policy" / "config.json").is_file()  # what it started from
    summary = " ".join(capsys.readouterr().err.split())
    assert f"model + tokenizer: {out.resolve()}" in summary
    assert "(first update) ->" in summary and "(last update)" in summary  # one update: no "first 3"


def _refused(work: Path, capsys: pytest.CaptureFixture[str]) -> str:
    assert main(["pipeline", "run", "--local", "--workdir", str(work), "--param", "learning_rate=-1"]) == 2
    return capsys.readouterr().err


def test_local_run_refused_at_validation_leaves_no_assets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The embedded defaults (tiny models, toy datasets) are built before the parameters are checked; a run
    refused there removes them again: a new work directory is gone, an existing one is as it was."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    new = tmp_path / "new"
    assert "learning_rate must be" in _refused(new, capsys)
    assert not new.exists()

    existing = tmp_path / "existing"
    (existing / "notes").mkdir(parents=True)
    (existing / "notes" / "keep.txt").write_text("mine")
    assert "learning_rate must be" in _refused(existing, capsys)
    assert [p.name for p in existing.iterdir()] == ["notes"]
    assert (existing / "notes" / "keep.txt").read_text() == "mine"


def test_assets_of_an_earlier_run_stay_when_a_later_one_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Only what the refused run built goes: the assets a finished run left (and a rerun reuses) stay."""
    from rloo.demo.pipeline import ASSETS_DIR, embedded_params

    work = tmp_path / "work"
    params = embedded_params(work)
    policy = Path(params["model"])
    mtime = policy.joinpath("config.json").stat().st_mtime_ns
    assert _refused(work, capsys)
    assert [p.name for p in work.iterdir()] == [ASSETS_DIR]
    assert policy.joinpath("config.json").stat().st_mtime_ns == mtime
