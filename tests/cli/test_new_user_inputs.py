"""An output directory that is an existing file, given to the real ``rloo eval`` and ``rloo push`` commands.

Both create ``--output_dir`` with ``Path.mkdir(parents=True, exist_ok=True)``, and CPython's
``Lib/pathlib.py`` (``Path.mkdir``: ``if not exist_ok or not self.is_dir(): raise``) forgives only an existing
*directory*: on a file it raises ``FileExistsError`` (``NotADirectoryError`` once a file is written below
it). That used to surface as a traceback, after the models had loaded; now it is one line naming the flag,
exit 2, as ``rloo train --output_dir FILE`` already was.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rloo.demo.judge import MODEL, ToyJudge
from rloo.demo.tiny import TinySetup
from rloo.demo.toy import write_toy_eval_dataset
from rloo.errors import UserError
from rloo.storage.s3 import s3_client
from tests.fixtures import recipes, zygote


def _run(*argv: str | Path) -> subprocess.CompletedProcess[str]:
    return zygote.run(["-m", "rloo.cli", *map(str, argv)], env=recipes.subprocess_env(), timeout=300)


def _assert_one_line(proc: subprocess.CompletedProcess[str], flag: str, path: Path) -> None:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert f"{flag} {path} is a file; pass a directory." in lines[0]


def test_eval_output_dir_that_is_a_file(tiny_setup: TinySetup, tmp_path: Path) -> None:
    data = write_toy_eval_dataset(tmp_path / "eval_data", num_test=2)
    out = tmp_path / "results.txt"
    out.write_text("keep me\n")
    with ToyJudge() as judge:
        proc = _run(
            "eval",
            "--model_name_or_path", tiny_setup.policy,
            "--dataset_name", data,
            "--judge_base_url", judge.base_url,
            "--judge_model", MODEL,
            "--engine", "transformers",
            "--max_new_tokens", "2",
            "--output_dir", out,
        )  # fmt: skip
    _assert_one_line(proc, "--output_dir", out)
    assert out.read_text() == "keep me\n"


def test_push_output_dir_that_is_a_file(tiny_setup: TinySetup, tmp_path: Path) -> None:
    out = tmp_path / "push.txt"
    out.write_text("keep me\n")
    proc = _run(
        "push",
        "--model_path", tiny_setup.policy,
        "--storage_uri", tmp_path / "published",
        "--output_dir", out,
    )  # fmt: skip
    _assert_one_line(proc, "--output_dir", out)
    assert out.read_text() == "keep me\n"
    assert not (tmp_path / "published").exists()


# boto/botocore botocore/configprovider.py reads AWS_MAX_ATTEMPTS with int() and botocore/config.py
# (Config._validate_retry_configuration) accepts the modes ('legacy', 'standard', 'adaptive') and
# max_attempts >= 0; anything else was a ValueError / InvalidRetryModeError traceback from s3_client.
@pytest.mark.parametrize(
    ("name", "value", "expect"),
    [
        (
            "AWS_MAX_ATTEMPTS",
            "abc",
            "AWS_MAX_ATTEMPTS='abc' is not a number of attempts: set an integer >= 0",
        ),
        ("AWS_MAX_ATTEMPTS", "-3", "AWS_MAX_ATTEMPTS='-3' is not a number of attempts"),
        (
            "AWS_RETRY_MODE",
            "bogus",
            "AWS_RETRY_MODE='bogus' is not a retry mode: use one of legacy, standard",
        ),
    ],
)
def test_s3_retry_settings_from_garbage_env(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str, expect: str
) -> None:
    monkeypatch.setenv("S3_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv(name, value)
    with pytest.raises(UserError) as err:
        s3_client()
    assert expect in str(err.value)


def test_s3_retry_settings_in_range_still_build_a_client(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("S3_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "0")
    monkeypatch.setenv("AWS_RETRY_MODE", "adaptive")
    # botocore counts the first try too: 0 retries is 1 attempt in all
    assert s3_client().meta.config.retries == {"mode": "adaptive", "total_max_attempts": 1}


def test_s3_endpoint_not_a_url_names_the_variable_that_was_set(monkeypatch: pytest.MonkeyPatch) -> None:
    """The endpoint comes from the first set of S3_ENDPOINT_URL, AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL; the
    fix names the one the user set, not always S3_ENDPOINT_URL."""
    for other in ("S3_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(other, raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "junk")
    with pytest.raises(UserError) as err:
        s3_client()
    assert "set AWS_ENDPOINT_URL to http(s)://host:port" in str(err.value)


def test_demo_output_dir_that_is_a_file(tmp_path: Path) -> None:
    """``rloo demo`` builds its models under ``<output_dir>/assets`` first (the same ``Path.mkdir``)."""
    out = tmp_path / "demo.txt"
    out.write_text("keep me\n")
    proc = _run("demo", "--updates", "1", "--output_dir", out)
    _assert_one_line(proc, "--output_dir", out)
    assert out.read_text() == "keep me\n"


def test_ui_backend_store_that_is_a_plain_file_path(tmp_path: Path) -> None:
    """mlflow/mlflow ``mlflow/tracking/_tracking_service/utils.py`` registers the empty scheme (a plain path)
    as a FileStore, a directory: a file path there is no store, and the usual file is a SQLite database."""
    db = tmp_path / "mlflow.db"
    db.write_bytes(b"")
    proc = _run("ui", "--backend-store-uri", db, "--port", "1")
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert f"is a file, not a store URI: for a SQLite database pass sqlite:///{db}" in proc.stderr


def test_compile_with_an_image_registry_that_is_no_reference(tmp_path: Path) -> None:
    """distribution/reference ``regexp.go``: a reference's path components are lowercase alphanumerics joined
    by separators, a tag is ``[\\w][\\w.-]{0,127}``; a registry with capitals or a space compiled into every
    step and failed only on the cluster."""
    out = tmp_path / "pipeline.yaml"
    env = {**os.environ, "RLOO_IMAGE_REGISTRY": "Registry Example/x"}
    proc = subprocess.run(
        [sys.executable, "-m", "rloo.cli", "pipeline", "compile", "--output", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env=env,
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "RLOO_IMAGE_REGISTRY / RLOO_IMAGE_TAG: 'Registry Example/x/rloo-" in proc.stderr
    assert "is not an image reference" in proc.stderr
    assert not out.exists()
