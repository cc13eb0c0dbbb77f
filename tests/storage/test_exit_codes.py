"""One exit code per kind of failure, wherever it happens: a store, the Hub or a tracking server that cannot be
reached exits 75 (a retried step may heal it), a mistake in the request exits 2 (no retry heals it).

botocore's ``standard`` retry mode (boto/botocore ``botocore/retries/standard.py``) counts a failed
connection (``EndpointConnectionError``, ``ConnectTimeoutError``) among the transient errors it retries: when
its attempts run out the failure is still transient, and a later attempt of the same step may succeed. So the
exit code must survive every caller that adds context (which flag, which step) to the message.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from rloo.errors import ServiceUnavailable, UserError
from tests.fixtures.servers import free_port


def _unreachable_s3(monkeypatch: pytest.MonkeyPatch) -> str:
    """An S3 endpoint where nothing listens (a closed port), with credentials that are well formed."""
    endpoint = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("S3_ENDPOINT_URL", endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "rloo-test-key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "rloo-test-secret")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    return endpoint


def test_an_unreachable_store_is_a_service_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    """The store out of reach is the same class as the Hub or a tracking server out of reach: a caller that
    catches ``ServiceUnavailable`` (the transient failures) catches all three."""
    from rloo.storage.prefix import list_objects

    _unreachable_s3(monkeypatch)
    with pytest.raises(ServiceUnavailable) as err:
        list_objects("s3://rloo-test/datasets/x")
    assert err.value.exit_code == 75 and "cannot connect" in str(err.value)


def test_push_of_an_s3_model_on_an_unreachable_store_exits_75(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``rloo push --model_path s3://...`` reads the upload's manifest first; a store out of reach there is no
    bad model path: it exits 75, as the same failure does on ``--output_dir`` or ``--dataset_name``."""
    from rloo.cli.push_cmd import main

    for name in ("MLFLOW_TRACKING_URI", "KFP_RUN_ID", "HF_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    endpoint = _unreachable_s3(monkeypatch)
    rc = main(["--model_path", "s3://rloo-test/runs/r1/model", "--output_dir", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert rc == 75, err
    assert len(err.splitlines()) == 1 and err.startswith(
        "rloo push: error: --model_path s3://rloo-test/runs/r1/model"
    )
    assert "cannot connect" in err and endpoint in err


def test_context_added_to_a_transient_failure_keeps_its_exit_code() -> None:
    """What every wrapper of an error uses: the message changes, the exit code does not."""
    from rloo.errors import reworded
    from rloo.storage.errors import StorageUnavailable, prefixed

    unavailable = StorageUnavailable("listing s3://b/x failed: cannot connect")
    for wrapped in (reworded(unavailable, "--flag s3://b/x: ..."), prefixed(unavailable, "--flag s3://b/x")):
        assert isinstance(wrapped, ServiceUnavailable) and wrapped.exit_code == 75
    mistake = UserError("bucket 'b' does not exist")
    assert reworded(mistake, "output_uri: ...").exit_code == 2
