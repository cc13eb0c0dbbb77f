"""Every path-like flag of every command with an ``s3://`` value: it either reaches object storage (here a
bucket that does not exist on the real SeaweedFS server, so the answer is that bucket's one-line error) or
is refused in one line naming the flag, exit 2. Never a local directory named ``s3:``, never a traceback.

The flags that work with ``s3://`` end to end are covered elsewhere: ``train --output_dir`` and
``--checkpoint_uri`` in tests/integration/test_resume_and_scale.py, ``push --model_path`` /
``--eval_results`` / ``--storage_uri`` / ``--production_uri`` in tests/push/test_push_servers.py, the
pipeline's ``output_uri`` / ``model`` parameters in tests/pipeline.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from rloo.cli import main
from rloo.demo.tiny import TinySetup
from tests.fixtures.servers import S3Server, use_s3

MISSING = "rloo-no-such-bucket"
S3 = f"s3://{MISSING}/x"
EVAL = ["--model_name_or_path", "m", "--dataset_name", "d", "--judge_base_url", "http://127.0.0.1:9"]
EVAL += ["--judge_model", "j"]

# (argv, the flag the error line must name): refused before anything is read or written. --reward_model_path
# takes s3:// (fetched into the machine's temp dir: tests/storage/test_any_upload.py)
REFUSED: dict[str, tuple[list[str], str]] = {
    "train --model_name_or_path": (["train", "--model_name_or_path", S3], "--model_name_or_path"),
    "train --sft_model_path": (["train", "--sft_model_path", S3], "--sft_model_path"),
    "train --local_dir": (["train", "--output_dir", S3, "--local_dir", S3], "--local_dir"),
    "train --resume_from_checkpoint": (["train", "--resume_from_checkpoint", S3], "--resume_from_checkpoint"),
    "train --config": (["train", "--config", f"{S3}/run.yaml"], "--config"),
    "train --output_dir gs://": (["train", "--output_dir", "gs://bucket/x"], "--output_dir"),
    "train --output_dir s3://bucket": (["train", "--output_dir", f"s3://{MISSING}"], "--output_dir"),
    "eval --model_name_or_path": (["eval", *EVAL, "--model_name_or_path", S3], "--model_name_or_path"),
    "eval --baseline_model": (["eval", *EVAL, "--baseline_model", S3], "--baseline_model"),
    "eval --dataset_name": (["eval", *EVAL, "--dataset_name", S3], "--dataset_name"),
    "eval --judge_template": (["eval", *EVAL, "--judge_template", S3], "--judge_template"),
    "eval --output_dir": (["eval", *EVAL, "--output_dir", S3], "--output_dir"),
    "eval --config": (["eval", "--config", f"{S3}/eval.yaml"], "--config"),
    "push --output_dir": (["push", "--model_path", S3, "--output_dir", S3], "--output_dir"),
    "push --config": (["push", "--config", f"{S3}/push.yaml"], "--config"),
    "pipeline compile --output": (["pipeline", "compile", "--output", f"{S3}/p.yaml"], "--output"),
    "pipeline run --workdir": (["pipeline", "run", "--local", "--workdir", S3], "--workdir"),
    "pipeline run --params": (["pipeline", "run", "--local", "--params", f"{S3}/p.yaml"], "--params"),
    "pipeline upload --package": (
        ["pipeline", "upload", "--host", "http://127.0.0.1:9", "--package", f"{S3}/p.yaml"],
        "--package",
    ),
    "pipeline submit --params": (
        ["pipeline", "submit", "--host", "http://127.0.0.1:9", "--params", f"{S3}/p.yaml"],
        "--params",
    ),
    "demo --output_dir": (["demo", "--output_dir", S3], "--output_dir"),
}


def _one_line_error(capsys: pytest.CaptureFixture[str], rc: int) -> str:
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert len(err.splitlines()) == 1, err
    assert "Traceback" not in err
    return err


@pytest.mark.parametrize("case", list(REFUSED), ids=list(REFUSED))
def test_local_only_flags_refuse_s3_in_one_line(
    case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    argv, flag = REFUSED[case]
    monkeypatch.chdir(tmp_path)
    start = time.monotonic()
    err = _one_line_error(capsys, main(argv))
    assert time.monotonic() - start < 10
    assert flag in err
    assert list(tmp_path.iterdir()) == []  # nothing written, no directory named 's3:'


@pytest.fixture
def aws(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> S3Server:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("RLOO_REPORT_TO", raising=False)
    monkeypatch.chdir(tmp_path)
    return use_s3(s3_server, monkeypatch)


@pytest.mark.parametrize("flag", ["--output_dir", "--checkpoint_uri", "--dataset_name"])
def test_train_flags_that_take_s3_reach_the_bucket(
    flag: str,
    aws: S3Server,
    tiny_setup: TinySetup,
    toy_dataset: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["train", "--model_name_or_path", str(tiny_setup.policy), "--dataset_name", str(toy_dataset)]
    argv += ["--reward_funcs", "rloo.demo.toy:letter_reward", "--disable_tqdm", "--max_steps", "1"]
    argv += ["--per_device_train_batch_size", "4", "--response_length", "4", "--num_sample_generations", "0"]
    if flag in ("--checkpoint_uri", "--dataset_name"):
        argv += ["--output_dir", str(tmp_path / "out")]
    argv += [flag, S3]
    err = _one_line_error(capsys, main(argv))
    assert f"bucket '{MISSING}' does not exist" in err
    assert not (tmp_path / "s3:").exists()


def test_push_model_path_reaches_the_bucket(aws: S3Server, capsys: pytest.CaptureFixture[str]) -> None:
    err = _one_line_error(capsys, main(["push", "--model_path", S3, "--output_dir", "out"]))
    assert f"bucket '{MISSING}' does not exist" in err
