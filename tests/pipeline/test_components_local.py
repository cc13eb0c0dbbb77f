"""The thin components really run: kfp.local executes their serialized bodies in a subprocess (this venv)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from rloo.pipeline.compile import repo_root
from tests.fixtures.weights import safetensors_bytes

local = pytest.importorskip("kfp.local")

# The SubprocessRunner warns that our images are not plain Python ones: here this venv stands in for them.
pytestmark = pytest.mark.filterwarnings("ignore:You may be attemping:RuntimeWarning")

# Every pipeline parameter, the defaults filled in: what the pipeline hands the validate step.
GIVEN: dict[str, Any] = dict(
    model="org/m",
    dataset_name="org/d",
    reward_model_path="org/rm",
    learning_rate=1e-5,
    total_episodes=100,
    rloo_k=4,
    seed=1,
    extra_train_args="--bf16",
    eval_dataset_name="org/e",
    judge_base_url="http://judge/v1",
    judge_model="j",
    output_uri="/tmp/rloo-validate-out",  # s3:// ones are asked for access: test_storage_access.py
)


def _good() -> dict[str, Any]:
    from rloo.pipeline.params import with_defaults

    return with_defaults(GIVEN)


@pytest.fixture(scope="module")
def components(tmp_path_factory: pytest.TempPathFactory) -> Any:
    local.init(
        runner=local.SubprocessRunner(use_venv=False),
        pipeline_root=str(tmp_path_factory.mktemp("root")),
        # not the system temp dir: only a whole pipeline run removes its workspace, single components don't
        workspace_root=str(tmp_path_factory.mktemp("workspace")),
    )
    sys.path.insert(0, str(repo_root()))
    from components.fetch_sft.component import fetch_sft
    from components.validate.component import validate_params

    return validate_params, fetch_sft


def test_validate_returns_the_plan(components: Any) -> None:
    from rloo.stages.plan import PipelinePlan

    validate_params, _ = components
    task = validate_params(**{**_good(), "gpu_count": 4})
    plan = PipelinePlan.from_json(task.outputs["plan"])
    config = plan.train
    assert (config["rloo_k"], config["learning_rate"], config["bf16"]) == (4, 1e-5, True)
    assert config["dataset_name"] == "org/d" and "output_dir" not in config  # the pod sets its own
    assert plan.eval["judge_model"] == "j" and plan.cluster.gpu_count == 4
    # the KFP UI's summary of the step shows the plan
    summary = Path(task.outputs["summary"].path).read_text()
    assert "## Run plan" in summary and "`rloo_k` | 4" in summary and "`judge_model` | j" in summary
    # the accelerator limit of the train pod: text, as KFP's driver reads pod-spec placeholders
    assert task.outputs["gpu_limit"] == "4"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"rloo_k": 1}, "rloo_k must be >= 2"),
        ({"judge_base_url": ""}, "judge_base_url is required"),
        ({"eval_memory": "8Gi"}, "eval_memory must be more than the 16Gi of /dev/shm"),
    ],
)
def test_validate_fails_with_the_reason(
    components: Any, capfd: pytest.CaptureFixture[str], change: dict[str, Any], message: str
) -> None:
    validate_params, _ = components
    with pytest.raises(RuntimeError, match="FAILURE"):
        validate_params(**{**_good(), **change})
    assert f"invalid pipeline parameters: {message}" in capfd.readouterr().out


def test_fetch_publishes_the_model_with_its_digest(components: Any, tmp_path: Path) -> None:
    from rloo.stages.fetch import manifest_digest
    from rloo.stages.validate import build_plan
    from rloo.storage import read_manifest

    _, fetch_sft = components
    src = tmp_path / "sft"
    src.mkdir()
    (src / "config.json").write_text("{}")
    weights = safetensors_bytes(b"weights")  # the fetch step reads the header of what it publishes
    (src / "model.safetensors").write_bytes(weights)
    plan = build_plan(
        {**_good(), "model": str(src), "output_uri": str(tmp_path / "store")}, check_paths=False
    )
    task = fetch_sft(plan=plan.to_json(), kfp_run_id="run-1")
    meta = task.outputs["sft_model"].metadata
    dest = tmp_path / "store" / "run-1" / "sft"
    assert meta["uri"] == str(dest) and (dest / "model.safetensors").read_bytes() == weights
    assert meta["manifest_digest"] == manifest_digest(read_manifest(dest))


def test_local_pipeline_run_stops_at_validation(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """The whole DAG under kfp.local: a bad parameter fails the first step, nothing is fetched or trained,
    and the exit handler still runs. (precheck=False: 'rloo pipeline run --local' refuses such a value
    before kfp.local starts, see the next test; a cluster run has only the step.)"""
    from rloo.errors import UserError
    from rloo.pipeline.local import run_pipeline_locally

    params = {
        k: GIVEN[k] for k in ("model", "dataset_name", "eval_dataset_name", "judge_base_url", "judge_model")
    }
    params |= {"reward_model_path": "org/rm", "rloo_k": 1, "output_uri": str(tmp_path / "out")}
    with pytest.raises(UserError) as err:
        run_pipeline_locally(tmp_path / "work", params, precheck=False)
    captured = capfd.readouterr()
    (log,) = (tmp_path / "work" / "logs").glob("*/validate-params.log")
    assert "invalid pipeline parameters: rloo_k must be >= 2" in log.read_text()
    assert "validate-params failed after " in captured.out and f"(log: {log})" in captured.out
    # what is wrong (the step's reason, not only which step failed), in one line
    assert str(err.value) == (
        "local pipeline run failed at step validate-params: invalid pipeline parameters: rloo_k must be >= 2 "
        "(got 1): the leave-one-out baseline needs at least two completions per prompt. "
        f"(log: {log})"
    )
    (run_dir,) = (tmp_path / "work" / "kfp").iterdir()
    steps = {p.name for p in run_dir.iterdir()}  # a step's directory holds its outputs
    assert "finish-run" in steps and not steps & {"fetch-sft", "train-rloo", "evaluate", "push-model"}
    assert not (tmp_path / "out").exists()
    # the failure is in MLflow too: the exit handler creates the pipeline run it never got, marked FAILED
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'work' / 'mlruns' / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("rloo").experiment_id])
    assert run.info.status == "FAILED" and run.data.tags["rloo.kind"] == "pipeline"
    assert run.data.tags["kfp.run_name"] == run_dir.name


def test_local_run_refuses_a_bad_value_before_kfp_starts(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """The validate step's checks run before kfp.local: one line, no workspace, no FAILED run in MLflow."""
    from rloo.cli.pipeline_cmd import main

    params = {
        k: GIVEN[k] for k in ("model", "dataset_name", "eval_dataset_name", "judge_base_url", "judge_model")
    }
    params |= {"reward_model_path": "org/rm", "namespace": "Team_A", "output_uri": str(tmp_path / "out")}
    argv = ["run", "--local", "--workdir", str(tmp_path / "work")]
    for key, value in params.items():
        argv += ["--param", f"{key}={value}"]
    assert main(argv) == 2
    captured = capfd.readouterr()
    assert captured.err == (
        "rloo pipeline: error: namespace must be a Kubernetes namespace name (lower-case a-z, 0-9, '-'; "
        "got 'Team_A').\n"
    )
    assert "Traceback" not in captured.out
    assert not (tmp_path / "work" / "kfp").exists() and not (tmp_path / "work" / "logs").exists()
    assert not (tmp_path / "work" / "mlruns").exists() and not (tmp_path / "out").exists()


def test_local_run_rejects_unknown_and_missing_parameters(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from rloo.cli.pipeline_cmd import main

    work = ["--workdir", str(tmp_path / "work")]
    assert main(["run", "--local", *work, "--param", "nope=1"]) == 2
    assert "unknown pipeline parameter(s) nope" in capsys.readouterr().err
    assert not (tmp_path / "work").exists()  # checked before anything was built
    # with a model of their own, users give the rest too: the toy datasets are only the embedded defaults
    assert main(["run", "--local", *work, "--param", "model=x"]) == 2
    assert "missing pipeline parameter(s) dataset_name" in capsys.readouterr().err
    assert main(["run"]) == 2
    assert "pass --local" in capsys.readouterr().err


def test_failed_step_reason_is_read_from_its_own_log() -> None:
    """The reason comes from the failed step's part of the console (kfp.local's frames), not another's."""
    from rloo.pipeline.failure import run_failure

    console = "\n".join(
        [
            "12:00:00.000 - INFO - Executing task \x1b[96m'fetch-sft'\x1b[0m",
            "    rloo train: error: not this one",
            "12:00:01.000 - INFO - Task \x1b[96m'fetch-sft'\x1b[0m finished with status \x1b[92mSUCCESS\x1b[0m",
            "12:00:02.000 - INFO - Executing task \x1b[96m'train-rloo'\x1b[0m",
            "    Traceback (most recent call last):",
            '      File "x.py", line 1, in <module>',
            "    rloo.errors.UserError: --dataset_name d: no 'prompt' column; rename the column",
            "12:00:03.000 - ERROR - Task \x1b[96m'train-rloo'\x1b[0m finished with status \x1b[91mFAILURE\x1b[0m",
            "12:00:04.000 - INFO - Executing task \x1b[96m'finish-run'\x1b[0m",
            "    ValueError: not this one either",
        ]
    )
    error = "Pipeline \x1b[95m'rloo-rlhf'\x1b[0m finished with status FAILURE. Inner task failed: \x1b[96m'train-rloo'\x1b[0m inside 'condition-1'."
    assert run_failure(error, console) == (
        "local pipeline run failed at step train-rloo: --dataset_name d: no 'prompt' column; rename the column"
    )
    # no reason in the log: kfp.local's own message, without its colours
    assert run_failure(error, "") == (
        "local pipeline run failed: Pipeline 'rloo-rlhf' finished with status FAILURE. Inner task failed: "
        "'train-rloo' inside 'condition-1'."
    )
