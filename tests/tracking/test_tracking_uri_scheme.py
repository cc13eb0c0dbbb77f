"""A tracking URI MLflow has no store for is refused in one line before anything loads, by every entry point
that reads MLFLOW_TRACKING_URI first: the ``rloo`` command (train, eval, push), ``rloo eval``'s library entry
(the pipeline's evaluate step) and the validate step.

MLflow picks the tracking store by the URI's scheme (mlflow/tracking/_tracking_service/utils.py,
``_get_tracking_scheme_with_resolved_uri`` over :func:`mlflow.utils.uri.get_uri_scheme`, which is
``urllib.parse.urlparse(uri).scheme``): ``mlflow-server:5000`` has the scheme ``mlflow-server``, for which its
registry has no store, and every call fails; the sinks only logged that and the run exited 0 untracked."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rloo.errors import UserError
from rloo.tracking.uri import check_tracking_uri

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("uri", "said"),
    [
        ("mlflow-server:5000", "has no scheme (MLflow reads 'mlflow-server' as one"),
        ("localhost:5000/", "has no scheme (MLflow reads 'localhost' as one"),
        ("bogus://x", "has a scheme MLflow has no tracking store for ('bogus')"),
        ("mlflow.example.com", "has no scheme (MLflow would take it for a directory"),
    ],
)
def test_uris_mlflow_has_no_store_for_are_refused(uri: str, said: str) -> None:
    with pytest.raises(UserError) as info:
        check_tracking_uri(uri)
    assert info.value.exit_code == 2 and str(info.value).startswith(f"MLFLOW_TRACKING_URI={uri} {said}")


@pytest.mark.parametrize(
    "uri",
    [
        "http://mlflow:5000",
        "https://mlflow.example/prefix",
        "sqlite:////tmp/mlflow.db",
        "postgresql+psycopg2://mlflow@db/mlflow",
        "mysql://db/mlflow",
        "file:///tmp/mlruns",
        "/tmp/mlruns",
        "./mlruns",
        "databricks",
        "",
    ],
)
def test_uris_mlflow_opens_pass(uri: str) -> None:
    """The schemes mlflow/tracking/_tracking_service/utils.py registers (_register_tracking_stores: '' and
    file, databricks, http(s), the DATABASE_ENGINES of mlflow/store/db/db_types.py with a driver after '+')."""
    from mlflow.tracking._tracking_service.utils import _get_tracking_scheme

    check_tracking_uri(uri)
    if uri:  # MLflow itself has a store for each
        assert _get_tracking_scheme(uri) != "None"


@pytest.mark.parametrize(
    "argv",
    [
        ["train", "--output_dir", "never-created", "--model_name_or_path", "x", "--dataset_name", "y"],
        ["eval", "--model_name_or_path", "m", "--dataset_name", "d", "--judge_base_url", "http://j/v1",
         "--judge_model", "j", "--output_dir", "never-created"],
        ["push", "--model_path", "m", "--output_dir", "never-created"],
    ],
    ids=lambda a: a[0],
)  # fmt: skip
def test_commands_refuse_it_before_anything_loads(argv: list[str], tmp_path: Path) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)]),
        "MLFLOW_TRACKING_URI": "mlflow-server:5000",
    }
    proc = subprocess.run(
        [sys.executable, "-m", "rloo.cli", *argv], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"rloo {argv[0]}: error: MLFLOW_TRACKING_URI=mlflow-server:5000 has no scheme"), (
        line
    )
    assert "http://mlflow-server:5000" in line
    assert not (tmp_path / "never-created").exists()


def test_the_evaluate_step_and_the_validate_step_refuse_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pipeline's evaluate step calls run_eval without the CLI; the validate step reads the pod's
    environment (the mlflow_secret's MLFLOW_TRACKING_URI) before any other check."""
    from rloo.eval.config import EvalConfig
    from rloo.eval.runner import run_eval
    from rloo.stages.validate import run
    from tests.stages.test_validate import good

    monkeypatch.setenv("MLFLOW_TRACKING_URI", "bogus://x")
    cfg = EvalConfig(
        model_name_or_path="m", dataset_name=str(tmp_path / "no-such-dataset"), judge_base_url="http://j/v1",
        judge_model="j", output_dir=str(tmp_path / "o"),
    )  # fmt: skip
    with pytest.raises(UserError, match=r"^MLFLOW_TRACKING_URI=bogus://x has a scheme MLflow has no"):
        run_eval(cfg)
    assert not (tmp_path / "o").exists()
    with pytest.raises(UserError, match=r"^MLFLOW_TRACKING_URI=mlflow-server:5000 has no scheme"):
        run(good(), env={"MLFLOW_TRACKING_URI": "mlflow-server:5000"})
