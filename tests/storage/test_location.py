"""URI parsing, endpoint resolution and redaction (no server needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rloo.errors import UserError
from rloo.storage import Location, StorageError, redact, resolve_endpoint
from rloo.storage.manifest import Manifest
from rloo.storage.progress import PROGRESS_MIN_BYTES, Progress
from rloo.storage.redact import MASK
from rloo.tracking.params import flatten_params


def test_parse_s3_file_and_plain_paths(tmp_path: Path) -> None:
    loc = Location.parse("s3://my-bucket/models//run-1/")
    assert (loc.scheme, loc.bucket, loc.key) == ("s3", "my-bucket", "models/run-1")
    assert loc.uri == "s3://my-bucket/models/run-1"
    assert loc.child("checkpoint-10").uri == "s3://my-bucket/models/run-1/checkpoint-10"
    assert loc.object_key("a/b.txt") == "models/run-1/a/b.txt"
    assert Location.parse("s3://my-bucket").object_key("x") == "x"
    assert Location.parse(f"file://{tmp_path}/x").path == tmp_path / "x"
    assert Location.parse(tmp_path / "y").path == tmp_path / "y"
    assert Location.parse("relative/dir").path == Path("relative/dir").resolve()


@pytest.mark.parametrize(
    ("uri", "needle"),
    [
        ("gs://bucket/x", "unsupported storage URI"),
        ("s3://Bad_Bucket/x", "invalid S3 bucket name"),
        ("s3://ab/x", "invalid S3 bucket name"),
        ("s3://bucket/a/../b", "'..'"),
        ("file://relative/x", "must be absolute"),
        ("", "empty storage URI"),
    ],
)
def test_bad_uris_are_one_line_user_errors(uri: str, needle: str) -> None:
    with pytest.raises(UserError, match=needle) as e:
        Location.parse(uri)
    assert "\n" not in str(e.value)


def test_credentials_in_an_s3_uri_are_refused_and_not_echoed() -> None:
    with pytest.raises(UserError) as e:
        Location.parse("s3://AKIAEXAMPLE:topsecretvalue@bucket/x")
    assert "topsecretvalue" not in str(e.value)
    assert "AWS_SECRET_ACCESS_KEY" in str(e.value)


def test_endpoint_resolution_order(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("S3_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(name, raising=False)
    assert resolve_endpoint() is None
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://generic:1")
    assert resolve_endpoint() == "http://generic:1"
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://s3-specific:2")
    assert resolve_endpoint() == "http://s3-specific:2"
    monkeypatch.setenv("S3_ENDPOINT_URL", "http://ours:3")
    assert resolve_endpoint() == "http://ours:3"
    assert resolve_endpoint("http://explicit:4") == "http://explicit:4"


def test_redaction_of_env_secrets_urls_and_signed_queries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wJalrXUtnFEMI-example-secret")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "hunter2hunter2")
    text = (
        "key wJalrXUtnFEMI-example-secret at http://admin:hunter2hunter2@mlflow:5000/x "
        "url https://b.s3/k?X-Amz-Credential=AKIA/x&X-Amz-Signature=abcdef0123&other=1"
    )
    out = redact(text)
    assert (
        "wJalrXUtnFEMI" not in out
        and "hunter2" not in out
        and "abcdef0123" not in out
        and "AKIA/x" not in out
    )
    assert "http://***@mlflow:5000/x" in out and "other=1" in out
    # an error built from such text is redacted too
    assert "wJalrXUtnFEMI" not in str(StorageError(text))


def test_params_are_flattened_truncated_and_redacted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf_abcdefghijklmnop")
    flat = flatten_params(
        {
            "learning_rate": 3e-6,
            "hub_token": "hf_abcdefghijklmnop",
            "reward_funcs": ["a:b", "c:d"],
            "nested": {"db": {"password": "pw-123456", "host": "h"}},
            "endpoint": "http://user:pw-123456@host:1",
            "note": "uses hf_abcdefghijklmnop inside",
            "long": "x" * 7000,
            "weird key!": 1,
            "none": None,
        }
    )
    assert flat["learning_rate"] == "3e-06"
    assert flat["hub_token"] == MASK and flat["nested.db.password"] == MASK and flat["nested.db.host"] == "h"
    assert flat["reward_funcs"] == '["a:b","c:d"]'
    assert "pw-123456" not in flat["endpoint"] and "hf_abc" not in flat["note"]
    assert len(flat["long"]) == 6000 and flat["long"].endswith("[truncated]")
    assert flat["weird key_"] == "1" and flat["none"] == "None"


def test_settings_that_mention_tokens_are_not_masked() -> None:
    from rloo.storage.redact import is_secret_name

    for secret in ("HF_TOKEN", "hub_token", "AWS_SESSION_TOKEN", "MLFLOW_TRACKING_TOKEN", "token", "api_key"):
        assert is_secret_name(secret), secret
    # settings recorded as MLflow params: they were shown as *** in the UI
    for setting in (
        "max_new_tokens",
        "judge_max_tokens",
        "token_level_kl",
        "stop_token",
        "judge_api_key_env",
    ):
        assert not is_secret_name(setting), setting
    flat = flatten_params({"max_new_tokens": 16, "stop_token": "eos", "judge_api_key_env": "OPENAI_API_KEY"})
    assert flat == {"max_new_tokens": "16", "stop_token": "eos", "judge_api_key_env": "OPENAI_API_KEY"}


def test_manifest_rejects_unsafe_paths() -> None:
    bad = '{"format": "rloo-manifest/1", "files": [{"path": "../etc/passwd", "size": 1, "sha256": "%s"}]}' % (
        "0" * 64
    )
    with pytest.raises(StorageError, match="not a valid rloo manifest"):
        Manifest.from_json(bad, "s3://bucket/x")


def test_progress_bar_only_for_large_transfers() -> None:
    with (
        Progress(PROGRESS_MIN_BYTES, "big", True) as big,
        Progress(PROGRESS_MIN_BYTES - 1, "small", True) as small,
    ):
        assert big._bar is not None and small._bar is None
        big.update(10)
        big.update(-5)  # s3transfer rewinds a retried chunk
        assert big._bar.n == 5
    with Progress(PROGRESS_MIN_BYTES, "off", False) as off:
        assert off._bar is None
