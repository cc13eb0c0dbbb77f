"""A push with no destination decides, and says that it published nothing.

Promotion is something done *to a copy*: MLflow's registry moves the ``champion`` alias onto a registered
version (mlflow/mlflow ``mlflow/tracking/client.py``, ``MlflowClient.set_registered_model_alias``), and
``production_uri`` receives the champion's files. With no ``--storage_uri``, ``--production_uri``,
``--hub_repo_id`` or tracking server there is no copy, so nothing is promoted, whatever the gate decided.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from rloo.cli.push_cmd import main
from tests.push.conftest import write_eval


@pytest.fixture(autouse=True)
def _no_servers(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("MLFLOW_TRACKING_URI", "KFP_RUN_ID", "KFP_RUN_NAME", "HF_TOKEN"):
        monkeypatch.delenv(name, raising=False)


def _push(trained: Path, tmp_path: Path, *extra: str) -> tuple[int, dict]:
    ev = write_eval(tmp_path / "ev.json", lo=0.04)  # passes the gate: the verdict is champion
    out = tmp_path / "out"
    rc = main(["--model_path", str(trained), "--eval_results", str(ev), "--output_dir", str(out), *extra])
    return rc, json.loads((out / "push_result.json").read_text())


def test_a_push_with_no_destination_says_nothing_was_published(
    trained_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="rloo.push"):
        rc, result = _push(trained_dir, tmp_path)
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0
    assert result["decision"] == "champion"  # the gate's verdict is still reported
    assert result["promoted"] is False and result["published"] is False
    assert all(result[t] is None for t in ("storage", "production", "mlflow", "hub"))
    for reason in (result["reason"], printed["reason"]):
        assert "nothing was published" in reason and "--storage_uri" in reason
    warned = [r for r in caplog.records if r.levelno == logging.WARNING and "push decision" in r.getMessage()]
    assert warned and "nothing was published" in warned[0].getMessage()


def test_a_push_to_a_destination_is_published_and_promoted(trained_dir: Path, tmp_path: Path) -> None:
    rc, result = _push(trained_dir, tmp_path, "--storage_uri", str(tmp_path / "store"))
    assert rc == 0 and result["promoted"] is True and result["published"] is True
    assert "nothing was published" not in result["reason"]
