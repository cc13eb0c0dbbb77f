"""A real MLflow tracking server (artifacts proxied to SeaweedFS) for the tracking tests, started once."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.fixtures.servers import MlflowServer, release, shared_mlflow


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    server = shared_mlflow(tmp_path_factory.mktemp("servers"))
    yield server
    release("mlflow")


@pytest.fixture
def tracking_env(mlflow_server: MlflowServer, monkeypatch: pytest.MonkeyPatch) -> MlflowServer:
    """A stage's environment: the tracking server, no KFP run, a private experiment per test."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server.uri)
    for name in ("KFP_RUN_ID", "KFP_RUN_NAME", "RLOO_REPORT_TO", "MLFLOW_EXPERIMENT_NAME"):
        monkeypatch.delenv(name, raising=False)
    return mlflow_server
