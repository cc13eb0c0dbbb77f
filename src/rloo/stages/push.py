"""The push step: ``rloo push`` for one pipeline run, behind the promotion gate. The version is published
under ``<output_uri>/published/<run id>`` and the decision (``push_result.json``) under the run's ``push/``
prefix, next to its model and evaluation.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from rloo.stages.context import StepResult
from rloo.stages.layout import RunLayout
from rloo.stages.plan import PipelinePlan
from rloo.stages.sft import durable_model_name


def run(
    plan: PipelinePlan, run_id: str, *, trained_uri: str, eval_results_uri: str, sft: dict[str, Any]
) -> StepResult:
    """Push the run's model (``sft``: the fetch step's record, which the model card names as the base model);
    staged in a temporary directory that is removed afterwards. The result: the gate's decision as its
    output, the push result (with the URI of ``push_result.json`` as ``result_uri``) as its record."""
    from rloo.push.config import PushConfig
    from rloo.push.runner import RESULT_FILE, run_push
    from rloo.storage import upload_dir

    layout = RunLayout(plan.run.output_uri, run_id)
    with tempfile.TemporaryDirectory(prefix="rloo-push-") as tmp:
        cfg = PushConfig(
            **plan.push,
            model_path=trained_uri,
            eval_results=eval_results_uri or None,
            output_dir=str(Path(tmp) / "push"),
            run_id=run_id,
            storage_uri=layout.published,
            base_model=durable_model_name(sft) or None,
            base_model_revision=str(sft.get("revision") or "") or None,
            mlflow_experiment=plan.run.mlflow_experiment,
        )
        result = run_push(cfg)
        publish = Path(tmp) / "result"
        publish.mkdir()
        (Path(cfg.output_dir) / RESULT_FILE).rename(publish / RESULT_FILE)
        upload_dir(publish, layout.push, progress=False)
    record = {**result.to_dict(), "result_uri": layout.push_result}
    return StepResult(output=record["decision"], record=record)
