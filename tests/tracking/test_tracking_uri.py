"""``user:password@`` in MLFLOW_TRACKING_URI is refused by every command before anything reads it: MLflow's
own "View run ... at <uri>" line would print the password into every log."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rloo.errors import UserError
from rloo.tracking.server import check_tracking_server, refuse_credentials_in_uri, resolve_tracking_uri

PASSWORD = "hunter2-very-secret"
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "argv",
    [
        ["train", "--output_dir", "never-created", "--model_name_or_path", "x", "--dataset_name", "y"],
        ["eval", "--help"],
        ["push", "--model_path", "m", "--output_dir", "never-created"],
        ["pipeline", "compile"],
        ["demo"],
    ],
    ids=lambda a: a[0],
)
def test_every_command_refuses_credentials_in_the_tracking_uri(argv: list[str], tmp_path: Path) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)]),
        "MLFLOW_TRACKING_URI": f"http://alice:{PASSWORD}@127.0.0.1:1",
    }
    env.pop("MLFLOW_TRACKING_PASSWORD", None)
    proc = subprocess.run(
        [sys.executable, "-m", "rloo.cli", *argv], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "MLFLOW_TRACKING_USERNAME" in lines[0] and "MLFLOW_TRACKING_PASSWORD" in lines[0]
    assert "127.0.0.1:1" in lines[0]
    assert PASSWORD not in proc.stderr + proc.stdout
    assert not (tmp_path / "never-created").exists()


@pytest.mark.parametrize(
    "uri", [f"http://alice:{PASSWORD}@mlflow:5000", f"https://{PASSWORD}@mlflow", "http://alice@mlflow:5000"]
)
def test_library_entry_points_refuse_userinfo(uri: str) -> None:
    # the pipeline's components call these directly, without the CLI
    for call in (refuse_credentials_in_uri, check_tracking_server, resolve_tracking_uri):
        with pytest.raises(UserError, match="MLFLOW_TRACKING_USERNAME") as info:
            call(uri)
        assert PASSWORD not in str(info.value)


@pytest.mark.parametrize(
    "uri", ["http://mlflow:5000", "https://mlflow.example/path", "sqlite:////tmp/m.db", ""]
)
def test_uris_without_credentials_pass(uri: str) -> None:
    refuse_credentials_in_uri(uri)
