"""Retried steps: a failure no retry heals is recorded once and later attempts stop at once; everything else
(object storage down, a crash, a lost node) stays retryable."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rloo.errors import UserError
from rloo.stages.node import FAILURE_FILE_ENV, launch_command, launcher_status
from rloo.stages.retry import PERMANENT_EXIT, give_up_on_user_errors, recorded_failure
from rloo.storage import StorageError, StorageUnavailable
from tests.fixtures.servers import S3Server, use_s3


def _attempt(root: str, step: str, error: BaseException | None) -> tuple[int | None, bool]:
    """One KFP attempt of ``step``: (its exit status or None for success, whether its body ran)."""
    ran = False
    try:
        with give_up_on_user_errors(root, step):
            ran = True
            if error is not None:
                raise error
    except SystemExit as e:
        return int(e.code or 0), ran
    return None, ran


def test_a_user_error_is_recorded_and_the_retry_stops_at_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = str(tmp_path / "run-1")
    assert _attempt(root, "train", UserError("--rloo_k must be >= 2 (got 1)")) == (PERMANENT_EXIT, True)
    assert recorded_failure(root, "train") == "--rloo_k must be >= 2 (got 1)"
    capsys.readouterr()
    # the retried attempt does not run its body (no GPU work, no model download)
    assert _attempt(root, "train", None) == (PERMANENT_EXIT, False)
    err = capsys.readouterr().err
    assert "not retrying train: an earlier attempt failed for good: --rloo_k must be >= 2" in err
    # another step of the same run is not affected
    assert _attempt(root, "evaluate", None) == (None, True)


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError("NCCL watchdog timeout"),
        StorageUnavailable("s3://b/p: cannot connect to the S3 endpoint"),
        SystemExit(1),
    ],
    ids=["crash", "storage", "exit-1"],
)
def test_failures_that_may_heal_stay_retryable(tmp_path: Path, error: BaseException) -> None:
    root = str(tmp_path / "run-1")
    with pytest.raises(type(error)) if not isinstance(error, (SystemExit, StorageError)) else _no_raise():
        status, _ = _attempt(root, "train", error)
        if isinstance(error, StorageUnavailable):
            assert status == 75  # EX_TEMPFAIL: not the permanent status
    assert recorded_failure(root, "train") is None
    assert _attempt(root, "train", None) == (None, True)  # the retry runs


class _no_raise:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return False


def test_an_exit_2_of_the_training_is_permanent(tmp_path: Path) -> None:
    root = str(tmp_path / "run-1")
    assert _attempt(root, "train", SystemExit(2)) == (2, True)
    assert "exited with status 2" in str(recorded_failure(root, "train"))


def test_the_record_lives_in_object_storage(
    s3_server: S3Server, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A retried attempt is a new pod: it finds the record only under the run's own prefix in the store."""
    use_s3(s3_server, monkeypatch)
    root = f"s3://{s3_server.bucket}/retry-test/run-{tmp_path.name}"
    assert _attempt(root, "evaluate", UserError("judge_model 'x' is not served by the judge")) == (2, True)
    assert _attempt(root, "evaluate", None) == (2, False)
    assert recorded_failure(root, "evaluate") == "judge_model 'x' is not served by the judge"


def test_launcher_status_prefers_the_recorded_status(tmp_path: Path) -> None:
    record = tmp_path / "failure.json"
    assert launcher_status(0, record) == (0, "")
    assert launcher_status(1, record) == (1, "")  # nothing recorded: the launcher's own status
    record.write_text('{"exit_code": 2, "message": "--kl_coef must be >= 0"}')
    assert launcher_status(1, record) == (2, "--kl_coef must be >= 0")
    record.write_text("{not json")
    assert launcher_status(1, record) == (1, "")


def test_accelerate_loses_the_status_and_the_failure_file_keeps_it(tmp_path: Path) -> None:
    """The real launcher: 'accelerate launch' exits 1 when 'rloo train' exits 2 on a bad flag; the file that
    rloo's CLI writes carries the 2 and the message to the step."""
    record = tmp_path / "failure.json"
    cmd = launch_command(
        ["--rloo_k", "1"],
        model_dir=str(tmp_path / "model"),
        output_dir=str(tmp_path / "out"),
        checkpoint_uri=str(tmp_path / "ckpt"),
        nproc=1,
        num_nodes=1,
    )
    env = {**_cpu_env(), FAILURE_FILE_ENV: str(record)}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-2000:]  # what accelerate gives the step
    status, message = launcher_status(proc.returncode, record)
    assert status == PERMANENT_EXIT and message and message in proc.stderr, (status, message)


def _cpu_env() -> dict[str, str]:
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith(("RLOO_", "ACCELERATE_"))}
    return env | {"CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": os.pathsep.join(sys.path)}


def test_a_missing_bucket_is_for_good_an_unreachable_store_is_not(
    s3_server: S3Server, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Through the real S3 client: a bucket that does not exist will not appear by itself (exit 2); an endpoint
    nobody listens on may come back (exit 75)."""
    from rloo.storage import upload_dir

    use_s3(s3_server, monkeypatch)
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    with pytest.raises(StorageError) as missing:
        upload_dir(tmp_path / "m", "s3://no-such-bucket-here/m", progress=False)
    assert missing.value.exit_code == PERMANENT_EXIT
    monkeypatch.setenv("S3_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    with pytest.raises(StorageUnavailable) as down:
        upload_dir(tmp_path / "m", f"s3://{s3_server.bucket}/m", progress=False)
    assert down.value.exit_code == 75
