"""The exit handler with its tracking server out of reach, or named by a URI MLflow cannot use: it says so in
one line and ends within its bounds, instead of MLflow's minutes of retries ending in a traceback. The real
``finish_run`` component, run by its own container command as KFP's launcher runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from components.finish_run.component import finish_run
from rloo.k8s.builders import POD_NAMESPACE_ENV
from tests.fixtures.servers import free_port
from tests.stages.test_finish import _executor_input, _final_status, _pythonpath


def _launch(executor_input: dict, uri: str, timeout: float) -> tuple[subprocess.CompletedProcess[str], float]:
    """The component's compiled command (``sh -ec`` writing the function out, ``python3 -m
    kfp.dsl.executor_main``), ``{{$}}`` replaced as the launcher does; (the process, its seconds)."""
    container = finish_run.component_spec.implementation.container
    args = [json.dumps(executor_input) if a == "{{$}}" else a for a in container.args]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_") and k != POD_NAMESPACE_ENV}
    env |= {
        "MLFLOW_TRACKING_URI": uri,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONPATH": _pythonpath(os.environ),
    }
    started = time.monotonic()
    proc = subprocess.run(
        [*container.command, *args], env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    return proc, time.monotonic() - started


def test_a_tracking_server_out_of_reach_is_one_line_within_bounds(tmp_path: Path) -> None:
    """mlflow/environment_variables.py: MLFLOW_HTTP_REQUEST_MAX_RETRIES defaults to 7 with backoff factor 2
    (and MLFLOW_HTTP_REQUEST_TIMEOUT to 120 s), so the exit handler's first MLflow call retried a refused
    connection for about 4 minutes and ended in a traceback. Now: one reachability check, one warning line,
    the step ends (the run's outcome is KFP's, not the exit handler's)."""
    uri = f"http://127.0.0.1:{free_port()}"
    status = _final_status("FAILED")
    executor_input = _executor_input(tmp_path / "out", status, run_id="kfp-1", exp="e", namespace="")
    proc, seconds = _launch(executor_input, uri, timeout=90)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert seconds < 60, seconds
    warnings = [
        line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("[rloo] warning:")
    ]
    assert warnings == [
        f"[rloo] warning: the pipeline's MLflow run was not closed FAILED (MLflow tracking server {uri} is "
        "unreachable (connection refused): start it or fix MLFLOW_TRACKING_URI, or unset MLFLOW_TRACKING_URI "
        "to record runs in a local sqlite store under the output directory); it stays RUNNING in MLflow until "
        "it is closed there (the run's own outcome is KFP's)"
    ]
    assert "Traceback" not in proc.stderr
    output = json.loads((tmp_path / "out" / "executor_output.json").read_text())
    assert output["parameterValues"]["Output"] == "not closed"


@pytest.mark.parametrize("uri", ["mlflow-server:5000", "bogus://x"])
def test_a_tracking_uri_mlflow_cannot_use_is_one_line(uri: str, tmp_path: Path) -> None:
    """mlflow/tracking/_tracking_service/utils.py picks the store by the URI's scheme and has none for these
    (``mlflow-server`` is read as the scheme of ``mlflow-server:5000``): said in one line, no traceback."""
    status = _final_status("COMPLETE")
    executor_input = _executor_input(tmp_path / "out", status, run_id="kfp-1", exp="e", namespace="")
    proc, _ = _launch(executor_input, uri, timeout=90)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    (warning,) = [line for line in (proc.stdout + proc.stderr).splitlines() if "[rloo] warning:" in line]
    assert warning.startswith(
        f"[rloo] warning: the pipeline's MLflow run was not closed FINISHED (MLFLOW_TRACKING_URI={uri} has "
    ), warning
