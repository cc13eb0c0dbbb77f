"""Network faults and a dying server between the client and SeaweedFS: transfers complete correctly or fail
with a clear error, and readers never see anything corrupt or half-written."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from boto3.s3.transfer import TransferConfig

from rloo.storage import (
    IncompleteArtifactError,
    StorageError,
    download_dir,
    is_complete,
    list_complete_prefixes,
    read_manifest,
    upload_dir,
)
from tests.fixtures.faultproxy import FaultProxy
from tests.fixtures.servers import S3Server
from tests.storage.helpers import SMALL_PARTS, MiB, make_tree, same_tree, tight_client


@pytest.fixture
def proxy(s3_env: S3Server) -> Iterator[FaultProxy]:
    p = FaultProxy(s3_env.ports["s3"])
    yield p
    p.close()


def _one_line_naming(err: BaseException, endpoint: str) -> str:
    msg = str(err)
    assert "\n" not in msg and endpoint in msg, msg
    return msg


def test_upload_survives_dropped_connections(proxy: FaultProxy, tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src")
    proxy.set_fault("drop", after=1 * MiB, direction="up", times=2)  # two part uploads reset mid-body
    uri = "s3://rloo-test/faults/drop-up"
    upload_dir(src, uri, client=tight_client(proxy.url, attempts=4), transfer_config=SMALL_PARTS)
    assert proxy.fired == 2
    download_dir(uri, tmp_path / "dl")  # straight to the server: what readers get is exactly the source
    assert same_tree(src, tmp_path / "dl")


def test_download_survives_dropped_and_stalled_connections(proxy: FaultProxy, tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src")
    uri = "s3://rloo-test/faults/drop-down"
    upload_dir(src, uri)
    client = tight_client(proxy.url, attempts=4, read_timeout=2.0)
    proxy.set_fault("drop", after=1 * MiB, direction="down", times=2)
    download_dir(uri, tmp_path / "a", client=client, transfer_config=SMALL_PARTS)
    assert proxy.fired == 2 and same_tree(src, tmp_path / "a")
    proxy.set_fault("stall", after=1 * MiB, direction="down", times=1)  # the body stops; read timeout, retry
    download_dir(uri, tmp_path / "b", client=client, transfer_config=SMALL_PARTS)
    assert proxy.fired == 3 and same_tree(src, tmp_path / "b")


def test_upload_survives_a_stalled_connection(proxy: FaultProxy, tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src")
    proxy.set_fault("stall", after=2 * MiB, direction="up", times=1)
    uri = "s3://rloo-test/faults/stall-up"
    upload_dir(src, uri, client=tight_client(proxy.url, read_timeout=2.0), transfer_config=SMALL_PARTS)
    assert proxy.fired == 1
    download_dir(uri, tmp_path / "dl")
    assert same_tree(src, tmp_path / "dl")


def test_spent_retry_budget_fails_clearly_and_publishes_nothing(proxy: FaultProxy, tmp_path: Path) -> None:
    v1, v2 = make_tree(tmp_path / "v1", seed=b"1"), make_tree(tmp_path / "v2", seed=b"2")
    uri = "s3://rloo-test/faults/budget"
    upload_dir(v1, uri)
    proxy.set_fault("drop", after=256 * 1024, direction="up")  # every large request dies, forever
    with pytest.raises(StorageError, match="after 2 attempts") as e:
        upload_dir(v2, uri, client=tight_client(proxy.url, attempts=2), transfer_config=SMALL_PARTS)
    _one_line_naming(e.value, proxy.url)
    # v1 was invalidated before v2's files went up, and v2 was never sealed: no mix of the two is readable
    assert not is_complete(uri)
    with pytest.raises(IncompleteArtifactError):
        download_dir(uri, tmp_path / "dl")
    proxy.set_fault("drop", after=256 * 1024, direction="down")
    upload_dir(v2, uri)
    once = TransferConfig(multipart_threshold=5 * MiB, multipart_chunksize=5 * MiB, num_download_attempts=1)
    with pytest.raises(StorageError, match="after 2 attempts"):
        download_dir(uri, tmp_path / "dl", client=tight_client(proxy.url, attempts=2), transfer_config=once)
    assert not (tmp_path / "dl").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["v1", "v2"]  # no partial download left behind


# The server itself dies -----------------------------------------------------------------------------------
@pytest.fixture
def own_server(tmp_path: Path, s3_env: S3Server, monkeypatch: pytest.MonkeyPatch) -> Iterator[S3Server]:
    """A SeaweedFS of this test's own, to kill and restart (same ports, same data directory)."""
    server = S3Server(tmp_path / "own-weed")
    server.start()
    for k, v in server.env().items():
        monkeypatch.setenv(k, v)
    yield server
    server.kill()  # its data is thrown away with tmp_path: no need for a graceful stop


def test_server_killed_mid_upload_then_restarted(own_server: S3Server, tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src")
    proxy = FaultProxy(own_server.ports["s3"])
    try:
        proxy.set_fault("trigger", after=3 * MiB, direction="up", times=1, on_trigger=own_server.kill)
        uri = "s3://rloo-test/killed/checkpoint-1"
        with pytest.raises(StorageError, match="after 2 attempts") as e:
            upload_dir(src, uri, client=tight_client(proxy.url, attempts=2), transfer_config=SMALL_PARTS)
        _one_line_naming(e.value, proxy.url)
        assert proxy.fired == 1
    finally:
        proxy.close()
    own_server.start()
    with pytest.raises(IncompleteArtifactError, match="not a complete upload"):
        read_manifest(uri)
    assert list_complete_prefixes("s3://rloo-test/killed") == []
    upload_dir(src, uri, transfer_config=SMALL_PARTS)  # the same upload again, now complete
    download_dir(uri, tmp_path / "dl")
    assert same_tree(src, tmp_path / "dl")


def test_server_restarted_during_upload_is_retried_or_left_invisible(
    own_server: S3Server, tmp_path: Path
) -> None:
    src = make_tree(tmp_path / "src")
    proxy = FaultProxy(own_server.ports["s3"])
    restarted = threading.Event()

    def kill_and_restart() -> None:
        own_server.kill()
        threading.Thread(target=lambda: (own_server.start(), restarted.set()), daemon=True).start()

    uri = "s3://rloo-test/restarted/model"
    try:
        proxy.set_fault("trigger", after=3 * MiB, direction="up", times=1, on_trigger=kill_and_restart)
        try:
            # botocore's standard retries (exponential backoff) span the restart
            upload_dir(src, uri, client=tight_client(proxy.url, attempts=10), transfer_config=SMALL_PARTS)
            uploaded = True
        except StorageError:
            uploaded = False  # acknowledged data lost by the kill is caught by the post-upload check
        assert proxy.fired == 1
    finally:
        proxy.close()
    restarted.wait(120)
    if uploaded:
        download_dir(uri, tmp_path / "dl")
        assert same_tree(src, tmp_path / "dl")
    else:
        assert not is_complete(uri)
