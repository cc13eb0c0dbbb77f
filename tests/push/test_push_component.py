"""The push step through the step context: a bad value is one line and exit 2, never a traceback, and a
retried attempt stops at once."""

from __future__ import annotations

import io
import json
from contextlib import redirect_stderr
from pathlib import Path
from typing import Any

import pytest

from tests.push.conftest import eval_results


def _executor_input(tmp_path: Path, plan: str, trained: Path, ev: Path) -> dict[str, Any]:
    """What KFP's launcher hands ``push_model`` (an ``ExecutorInput``): its parameters, the fetch step's
    Model artifact and where its summary and return value go."""
    sft = {"source": "org/sft", "revision": "c" * 40, "uri": "s3://b/run-1/sft"}
    return {
        "inputs": {
            "parameterValues": {
                "trained_model_uri": str(trained),
                "eval_results": str(ev),
                "plan": plan,
                "kfp_run_id": "run-1",
                "kfp_run_name": "nightly",
            },
            "artifacts": {
                "sft_model": {
                    "artifacts": [
                        {
                            "name": "sft_model",
                            "uri": str(tmp_path / "sft_model"),
                            "type": {"schemaTitle": "system.Model"},
                            "metadata": sft,
                        }
                    ]
                }
            },
        },
        "outputs": {
            "artifacts": {
                "summary": {
                    "artifacts": [
                        {
                            "name": "summary",
                            "uri": str(tmp_path / "summary"),
                            "type": {"schemaTitle": "system.Markdown"},
                            "metadata": {},
                        }
                    ]
                }
            },
            "parameters": {"Output": {"outputFile": str(tmp_path / "Output")}},
            "outputFile": str(tmp_path / "executor_output.json"),
        },
    }


def _attempt(executor_input: dict[str, Any]) -> tuple[int | str | None, str]:
    """One attempt of the component, as ``kfp.dsl.executor_main`` runs it: its exit status and stderr."""
    from kfp.dsl.executor import Executor

    from components.push_model.component import push_model

    err = io.StringIO()
    with redirect_stderr(err), pytest.raises(SystemExit) as exit_:
        Executor(executor_input=executor_input, function_to_execute=push_model.python_func).execute()
    return exit_.value.code, err.getvalue()


def test_a_bad_value_in_push_is_one_line_and_exit_2(
    trained_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """KFP runs the component function inside ``Executor.execute`` (kubeflow/pipelines
    sdk/python/kfp/dsl/executor.py): an exception left to it is a traceback and exit 1, which the step's
    retry policy tries again as if a retry could heal a bad value. Through the step context it is the
    error's one line, exit 2, recorded, and the retried attempt stops at once with the same message."""
    from rloo.pipeline.compile import load_pipeline
    from rloo.stages.validate import build_plan
    from tests.stages.test_validate import good

    load_pipeline()  # components/ on sys.path
    for name in ("MLFLOW_TRACKING_URI", "KFP_RUN_ID", "KFP_RUN_NAME", "MLFLOW_EXPERIMENT_NAME"):
        monkeypatch.delenv(name, raising=False)  # the step sets the run's; restored after the test
    bad = eval_results()
    bad["trained"]["win_rate"] = 1.5
    ev = tmp_path / "eval_results.json"
    ev.write_text(json.dumps(bad))
    plan = build_plan(good(output_uri=str(tmp_path / "runs")), check_paths=False).to_json()
    executor_input = _executor_input(tmp_path, plan, trained_dir, ev)

    code, err = _attempt(executor_input)
    assert code == 2
    assert "Traceback" not in err
    (line,) = err.strip().splitlines()
    assert line == f"[rloo] {ev}: 'trained.win_rate' must be in [0, 1] (got 1.5)."

    code, err = _attempt(executor_input)  # KFP's retry of the step
    assert code == 2
    assert err.strip() == f"[rloo] not retrying push: an earlier attempt failed for good: {line[7:]}"
