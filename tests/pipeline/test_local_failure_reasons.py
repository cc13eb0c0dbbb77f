"""The last line of a failed local run is the failed step's own one-line reason, whichever way the step
gives it: the validate step's 'invalid pipeline parameters: ...', fetch's 'fetching the SFT model failed:
...', the '[rloo] ...' line of a step that gives up (train, evaluate, push: rloo.stages.retry), or a
traceback's exception line, whatever the exception's class is called."""

# no `from __future__ import annotations`: kfp reads the components' annotations as types
from pathlib import Path
from typing import Any

import pytest

from rloo.errors import UserError

local = pytest.importorskip("kfp.local")
dsl = pytest.importorskip("kfp.dsl")

pytestmark = [
    pytest.mark.filterwarnings("ignore:You may be attemping:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:Task .* have no effect in the current local runner:UserWarning"),
]


@dsl.component(base_image="python:3.11", install_kfp_package=False)
def judge_step(form: str, run_root: str) -> None:
    """Fails as the pipeline's steps do, through their own code paths."""
    from rloo.errors import ServiceUnavailable

    print("[rloo] judging 4 pairs", flush=True)  # what a step says on its way: not the reason
    if form == "gives up":  # evaluate, push and train: rloo.stages.retry prints '[rloo] <message>', exits 75
        from rloo.stages.retry import give_up_on_user_errors

        with give_up_on_user_errors(run_root, "evaluate"):
            raise ServiceUnavailable(
                "the judge at http://127.0.0.1:9/v1 is unreachable; check judge_base_url."
            )
    # any step: an exception left to Python, whose class is not called *Error
    raise ServiceUnavailable("the tracking server at http://mlflow:5000 answered 503; retry later.")


@dsl.component(base_image="python:3.11", install_kfp_package=False)
def close_run() -> None:
    print("[rloo] closed the pipeline run FAILED", flush=True)  # the exit handler runs after the failure


@dsl.pipeline(name="reasons")
def reasons(form: str, run_root: str) -> None:
    with dsl.ExitHandler(exit_task=close_run()):
        judge_step(form=form, run_root=run_root)


@pytest.mark.parametrize(
    ("form", "reason"),
    [
        ("gives up", "the judge at http://127.0.0.1:9/v1 is unreachable; check judge_base_url."),
        ("traceback", "the tracking server at http://mlflow:5000 answered 503; retry later."),
    ],
)
def test_the_failed_steps_reason_is_the_last_line(tmp_path: Path, form: str, reason: str) -> None:
    """kfp.local frames each step's output with "Executing task '<task>'" ... "Task '<task>' finished with
    status FAILURE" (kubeflow/pipelines ``sdk/python/kfp/local/task_dispatcher.py``) and ends a pipeline
    whose step failed inside the exit handler with ``RuntimeError("... Inner task failed: '<task>' inside
    'exit-handler-1'.")`` (``sdk/python/kfp/local/pipeline_orchestrator.py``,
    ``log_and_maybe_raise_for_failure``): the step is named, its reason is only in its output."""
    from rloo.pipeline.console import step_console
    from rloo.pipeline.failure import run_failure

    local.init(
        runner=local.SubprocessRunner(use_venv=False),
        pipeline_root=str(tmp_path / "root"),
        workspace_root=str(tmp_path / "workspace"),
    )
    with step_console(tmp_path / "logs") as console, pytest.raises(RuntimeError) as err:
        reasons(form=form, run_root=str(tmp_path / "run"))
    assert "Inner task failed: " in str(err.value) and "exit-handler-1" in str(err.value)
    assert (
        run_failure(str(err.value), console.text) == f"local pipeline run failed at step judge-step: {reason}"
    )


def test_a_local_run_that_fails_at_fetch_ends_with_fetchs_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole pipeline under kfp.local (validate's own checks left to the step): a Hub model while the
    Hub is offline passes validation and fails the fetch step, which says why (components/fetch_sft: on
    stderr as it exits; or huggingface_hub's exception, ``OfflineModeIsEnabled``, not called *Error);
    kfp.local names only the step, inside the exit handler (kubeflow/pipelines
    ``sdk/python/kfp/local/pipeline_orchestrator.py``)."""
    from rloo.pipeline.local import run_pipeline_locally

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    params: dict[str, Any] = dict(
        model="org/not-cached",
        dataset_name="org/d",
        eval_dataset_name="org/e",
        reward_model_path="org/rm",
        judge_base_url="http://judge.invalid/v1",
        judge_model="j",
        output_uri=str(tmp_path / "out"),
    )
    with pytest.raises(UserError) as err:
        run_pipeline_locally(tmp_path / "work", params, precheck=False)
    (log,) = (tmp_path / "work" / "logs").glob("*/fetch-sft.log")
    head, tail = "local pipeline run failed at step fetch-sft: ", f" (log: {log})"
    message = str(err.value)
    assert message.startswith(head) and message.endswith(tail), message
    reason = message.removeprefix(head).removesuffix(tail)
    # a line the step wrote (its one-line reason, or the exception that ended it), naming the model
    assert reason in {x.strip() for x in log.read_text().splitlines()} and "org/not-cached" in reason
