"""Configuration mistakes against a real S3 server: one line each, naming the endpoint and the fix, and never
echoing a credential."""

from __future__ import annotations

from pathlib import Path

import pytest

from rloo.errors import UserError
from rloo.storage import CheckpointMirror, StorageError, download_dir, is_complete, read_manifest, upload_dir
from tests.fixtures.servers import SECRET_KEY, S3Server, free_port
from tests.storage.helpers import make_tree, tight_client

WRONG_SECRET = "not-the-right-secret-8d1e"


def _check(err: BaseException, *needles: str) -> str:
    msg = str(err)
    assert "\n" not in msg, msg
    for n in needles:
        assert n in msg, (n, msg)
    assert SECRET_KEY not in msg and WRONG_SECRET not in msg
    return msg


def test_wrong_secret_key(s3_env: S3Server, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", WRONG_SECRET)
    with pytest.raises(StorageError) as e:
        upload_dir(make_tree(tmp_path / "src", big=10), "s3://rloo-test/creds/x")
    _check(e.value, s3_env.endpoint, "rejected the credentials", "AWS_SECRET_ACCESS_KEY")


def test_unknown_access_key(s3_env: S3Server, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "NOSUCHKEY")
    with pytest.raises(StorageError) as e:
        download_dir("s3://rloo-test/creds/x", tmp_path / "dl")
    _check(e.value, s3_env.endpoint, "InvalidAccessKeyId", "AWS_ACCESS_KEY_ID")
    assert not (tmp_path / "dl").exists()


def test_no_credentials_at_all(s3_env: S3Server, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance-metadata lookups from a test
    with pytest.raises(StorageError) as e:
        read_manifest("s3://rloo-test/anything")
    _check(e.value, s3_env.endpoint, "no S3 credentials", "AWS_ACCESS_KEY_ID")


def test_missing_bucket(s3_env: S3Server, tmp_path: Path) -> None:
    for action in (
        lambda: upload_dir(make_tree(tmp_path / "src", big=10), "s3://no-such-bucket/x"),
        lambda: is_complete("s3://no-such-bucket/x"),
        lambda: download_dir("s3://no-such-bucket/x", tmp_path / "dl"),
    ):
        with pytest.raises(StorageError) as e:
            action()
        _check(e.value, s3_env.endpoint, "bucket 'no-such-bucket' does not exist", "create it")


def test_unreachable_endpoint(s3_env: S3Server, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("S3_ENDPOINT_URL", dead)
    with pytest.raises(StorageError) as e:
        upload_dir(make_tree(tmp_path / "src", big=10), "s3://rloo-test/x", client=tight_client(attempts=2))
    _check(e.value, dead, "cannot connect", "after 2 attempts", "S3_ENDPOINT_URL")


def test_endpoint_from_aws_endpoint_url(
    s3_env: S3Server, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("S3_ENDPOINT_URL")
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_env.endpoint)
    src = make_tree(tmp_path / "src", big=10)
    upload_dir(src, "s3://rloo-test/aws-endpoint/x")
    assert is_complete("s3://rloo-test/aws-endpoint/x")


def test_not_a_url_endpoint(s3_env: S3Server, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("S3_ENDPOINT_URL", "127.0.0.1:9000")
    with pytest.raises(UserError, match="is not a URL"):
        read_manifest("s3://rloo-test/x")


def test_checkpoint_mirror_reports_a_failed_upload_on_wait(s3_env: S3Server, tmp_path: Path) -> None:
    mirror = CheckpointMirror("s3://no-such-bucket/ckpts")
    mirror.submit(make_tree(tmp_path / "out" / "checkpoint-1", big=10))  # training is not interrupted
    with pytest.raises(StorageError, match="does not exist"):
        mirror.wait()
    mirror.close()
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["checkpoint-1"]  # snapshot cleaned up
