"""The exit handler: close the MLflow parent run of this pipeline run, FAILED if any step failed. It runs
whether or not the validate step did, so it takes its own parameters rather than the plan."""

from __future__ import annotations

import os


def run(state: str, *, run_id: str, run_name: str, experiment: str, error: str | None = None) -> str:
    """``state``: KFP's final status of the run (``SUCCEEDED``, ``FAILED``, ...). Returns what the MLflow run
    was closed as, or why nothing was closed."""
    os.environ["MLFLOW_EXPERIMENT_NAME"] = experiment
    if not os.environ.get("MLFLOW_TRACKING_URI"):
        return "no tracking server"  # nothing was tracked, nothing to close
    from rloo.tracking import finish_pipeline_run

    closed = "FINISHED" if state == "SUCCEEDED" else "FAILED"
    finish_pipeline_run(
        closed,
        pipeline_run_id=run_id,
        pipeline_run_name=run_name,
        experiment=experiment,
        error=error if closed == "FAILED" else None,
    )
    return closed
