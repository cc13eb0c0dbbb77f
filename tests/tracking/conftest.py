"""A stage's tracking environment for the tracking tests: the shared MLflow server of tests/conftest.py."""

from __future__ import annotations

import pytest

from tests.fixtures.servers import MlflowServer


@pytest.fixture
def tracking_env(mlflow_server: MlflowServer, monkeypatch: pytest.MonkeyPatch) -> MlflowServer:
    """A stage's environment: the tracking server, no KFP run, a private experiment per test."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server.uri)
    for name in ("KFP_RUN_ID", "KFP_RUN_NAME", "RLOO_REPORT_TO", "MLFLOW_EXPERIMENT_NAME"):
        monkeypatch.delenv(name, raising=False)
    return mlflow_server
