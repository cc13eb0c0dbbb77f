"""A tracking server that fails during a push exits 75 (a retried push step resumes without duplicates); one
that refuses the request exits 2, as before.

What the MLflow client raises (mlflow/mlflow ``mlflow/utils/rest_utils.py``): a request that cannot connect
or times out becomes an ``MlflowException`` raised while the ``requests`` exception is handled (its context);
a non-200 answer without a JSON body becomes an ``MlflowException`` whose ``error_code`` is the HTTP status
mapped by ``mlflow/exceptions.py`` (503 ``TEMPORARILY_UNAVAILABLE``, 504 ``DEADLINE_EXCEEDED``); a JSON error
body becomes a ``RestException`` with the server's own code (``RESOURCE_DOES_NOT_EXIST``, ...).
"""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from rloo.errors import ServiceUnavailable, UserError
from rloo.push import PushConfig, run_push
from tests.fixtures.servers import free_port
from tests.push.conftest import write_eval


@pytest.fixture(autouse=True)
def _fast_mlflow(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    for name in ("MLFLOW_TRACKING_URI", "KFP_RUN_ID", "KFP_RUN_NAME", "HF_TOKEN"):
        monkeypatch.delenv(name, raising=False)


def _server(status: int, body: bytes, content_type: str) -> Iterator[str]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def _answer(self) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = _answer  # http.server dispatches on these names

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def overloaded() -> Iterator[str]:
    """An MLflow behind a proxy that answers 503 (no JSON body)."""
    yield from _server(503, b"upstream connect error", "text/plain")


@pytest.fixture
def refusing() -> Iterator[str]:
    """An MLflow that answers with its own JSON error: the request is wrong, not the server."""
    body = json.dumps({"error_code": "PERMISSION_DENIED", "message": "no write access"}).encode()
    yield from _server(403, body, "application/json")


def _push(trained: Path, tmp_path: Path, tracking_uri: str) -> None:
    from mlflow.tracking import MlflowClient

    cfg = PushConfig(
        model_path=str(trained),
        eval_results=str(write_eval(tmp_path / "ev.json")),
        output_dir=str(tmp_path / "out"),
        storage_uri=str(tmp_path / "store"),
    )
    # the server went away after the push's own check: the client is handed in, as a test or a caller may
    run_push(cfg, mlflow_client=MlflowClient(tracking_uri=tracking_uri))


def test_a_tracking_server_gone_during_the_push_exits_75(trained_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ServiceUnavailable) as err:
        _push(trained_dir, tmp_path, f"http://127.0.0.1:{free_port()}")
    assert err.value.exit_code == 75 and "failed during the push" in str(err.value)
    assert not (tmp_path / "out" / "push_result.json").exists()


def test_an_overloaded_tracking_server_exits_75(trained_dir: Path, tmp_path: Path, overloaded: str) -> None:
    with pytest.raises(ServiceUnavailable) as err:
        _push(trained_dir, tmp_path, overloaded)
    assert err.value.exit_code == 75


def test_a_refusal_by_the_tracking_server_exits_2(trained_dir: Path, tmp_path: Path, refusing: str) -> None:
    with pytest.raises(UserError) as err:
        _push(trained_dir, tmp_path, refusing)
    assert err.value.exit_code == 2 and "MLflow refused the push" in str(err.value)
    assert "PERMISSION_DENIED" in str(err.value) or "no write access" in str(err.value)
