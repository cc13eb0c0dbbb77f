"""The validate step asks the output bucket first: wrong credentials, a missing bucket or no credentials at all
fail there, in one line and in seconds, against the real SeaweedFS server, instead of in the fetch step with a
traceback and minutes of KFP retries."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from rloo.errors import UserError
from rloo.pipeline.compile import repo_root
from rloo.stages.validate import build_plan
from tests.fixtures.servers import S3Server, use_s3
from tests.stages.test_validate import good

local = pytest.importorskip("kfp.local")
pytestmark = pytest.mark.filterwarnings("ignore:You may be attemping:RuntimeWarning")

MISSING = "rloo-no-such-bucket"
# the valid parameters of the validate-step tests, with the output location left to each test


@pytest.fixture
def aws(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    return use_s3(s3_server, monkeypatch)


def _no_credentials(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance-metadata lookup off a cloud VM


@pytest.mark.parametrize(
    ("problem", "expect"),
    [
        ("wrong secret", ("rejected the credentials", "AWS_SECRET_ACCESS_KEY", "'rloo-test'")),
        ("missing bucket", (f"bucket '{MISSING}' does not exist",)),
        ("no credentials", ("no S3 credentials found", "AWS_ACCESS_KEY_ID")),
        ("no server", ("cannot connect", "S3_ENDPOINT_URL")),
    ],
)
def test_validate_checks_the_output_bucket_in_seconds(
    aws: S3Server, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, problem: str, expect: tuple[str, ...]
) -> None:
    bucket = MISSING if problem == "missing bucket" else aws.bucket
    if problem == "wrong secret":
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    if problem == "no credentials":
        _no_credentials(monkeypatch, tmp_path)
    if problem == "no server":
        from tests.fixtures.servers import free_port

        monkeypatch.setenv("S3_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    start = time.monotonic()
    with pytest.raises(UserError) as err:
        build_plan(good(output_uri=f"s3://{bucket}/runs"))
    took = time.monotonic() - start
    message = str(err.value)
    assert took < 10, took
    assert "\n" not in message and message.startswith("output_uri: ")
    for part in expect:
        assert part in message
    assert aws.secret_key not in message


def test_validate_passes_a_reachable_bucket(aws: S3Server) -> None:
    params = good(output_uri=f"s3://{aws.bucket}/runs")
    checked = build_plan(params)  # nothing written there
    assert checked == build_plan(params, check_paths=False)


def test_fetch_step_fails_in_one_line_without_a_traceback(
    aws: S3Server, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    # the same mistake reaching the fetch step (credentials revoked after validation) is one line too
    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(tmp_path / "root"))
    monkeypatch.syspath_prepend(str(repo_root()))
    from components.fetch_sft.component import fetch_sft

    src = tmp_path / "sft"
    src.mkdir()
    (src / "config.json").write_text("{}")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    with pytest.raises(RuntimeError, match="FAILURE"):
        plan = build_plan(good(model=str(src), output_uri=f"s3://{aws.bucket}/runs"), check_paths=False)
        fetch_sft(plan=plan.to_json(), kfp_run_id="run-1")
    out = capfd.readouterr().out
    assert "fetching the SFT model failed: accessing s3://" in out and "rejected the credentials" in out
    assert "Traceback" not in out


def test_the_validate_step_refuses_an_s3_dataset_that_is_not_a_complete_upload(
    aws: S3Server, tmp_path: Path
) -> None:
    """A dataset prefix that holds no data fails in the validate step, naming the parameter, before any GPU."""
    from rloo.storage import upload_dir

    data = tmp_path / "prompts" / "data"
    data.mkdir(parents=True)
    (data / "train-00000.jsonl").write_text('{"prompt": "hi"}\n')
    (data / "test-00000.jsonl").write_text('{"prompt": "hi", "reference": "hello"}\n')
    uploaded = f"s3://{aws.bucket}/validate-datasets/{tmp_path.name}/ok"
    upload_dir(tmp_path / "prompts", uploaded, progress=False)
    output = f"s3://{aws.bucket}/validate-datasets/{tmp_path.name}/out"
    build_plan(good(output_uri=output, dataset_name=uploaded, eval_dataset_name=uploaded))
    bare = f"s3://{aws.bucket}/validate-datasets/{tmp_path.name}/bare"
    for name in ("dataset_name", "eval_dataset_name"):
        with pytest.raises(UserError, match=rf"^{name} {bare}: no objects under this prefix"):
            build_plan(good(output_uri=output, **{name: bare}))
