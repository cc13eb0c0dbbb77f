"""The exit handler: delete the run's multi-node job if the run left it behind, and close the MLflow parent run
of this pipeline run, FAILED unless KFP says the run succeeded. It runs whether or not the validate step did,
so it takes its own parameters rather than the plan.

KFP's backends spell a success differently in ``PipelineTaskFinalStatus.state``: KFP 2.x's driver sends the
exit-handler DAG's MLMD execution state (``LastKnownState().String()``: ``COMPLETE``, or ``CACHED``), the
pipeline-spec task states (Vertex AI, ``kfp.local``) are ``SUCCEEDED`` (or ``SKIPPED``, a cache hit), and
KFP's v2beta1 runtime states are the same two words. Every other state, ``RUNNING`` included (an MLMD DAG
whose task died without reporting stays RUNNING), closes the run FAILED. The error in the status is never
what decides: KFP's driver leaves it empty, failure or not.
"""

from __future__ import annotations

import os

from rloo.stages.context import StepResult

# The success spellings above, each backend's enum name (compared upper-cased).
SUCCEEDED_STATES = frozenset({"COMPLETE", "CACHED", "SUCCEEDED", "SKIPPED"})


def closed_as(state: str | None) -> str:
    """The MLflow status a run whose KFP final state is ``state`` is closed with: FINISHED or FAILED."""
    return "FINISHED" if str(state or "").strip().upper() in SUCCEEDED_STATES else "FAILED"


def run(
    state: str,
    *,
    run_id: str,
    run_name: str,
    experiment: str,
    error: str | None = None,
    namespace: str = "",
) -> StepResult:
    """``state``: KFP's final status of the run (see the module docstring). ``namespace``: the multi-node job's
    (the ``namespace`` pipeline parameter; empty: this pod's own, from the downward API). The result's output:
    what the MLflow run was closed as, or why nothing was closed."""
    return StepResult(output=_finish(state, run_id, run_name, experiment, error, namespace))


def _finish(
    state: str, run_id: str, run_name: str, experiment: str, error: str | None, namespace: str
) -> str:
    delete_leftover_job(run_id, namespace)
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        return "no tracking server"  # nothing was tracked, nothing to close
    closed = closed_as(state)
    try:
        _close_run(uri, closed, run_id, run_name, experiment, error, state)
    except Exception as e:  # whatever MLflow raised: one line, never a traceback (KFP decided the outcome)
        from rloo.errors import UserError
        from rloo.storage.redact import redact

        reason = (
            str(e) if isinstance(e, UserError) else f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
        )
        print(
            f"[rloo] warning: the pipeline's MLflow run was not closed {closed} ({redact(reason).rstrip('.')}); it stays "
            "RUNNING in MLflow until it is closed there (the run's own outcome is KFP's)",
            flush=True,
        )
        return "not closed"
    return closed


# The exit handler's whole MLflow part is bounded: one reachability check, then each request once more at
# most, each within this many seconds. MLflow's own defaults (mlflow/environment_variables.py:
# MLFLOW_HTTP_REQUEST_MAX_RETRIES=7 with backoff factor 2, MLFLOW_HTTP_REQUEST_TIMEOUT=120) keep an exit
# handler whose server is down retrying for minutes.
MLFLOW_TIMEOUT_S = 10
MLFLOW_MAX_RETRIES = 1


def _close_run(
    uri: str, closed: str, run_id: str, run_name: str, experiment: str, error: str | None, state: str
) -> None:
    from rloo.tracking import check_tracking_server, finish_pipeline_run
    from rloo.tracking.server import configure_mlflow_http
    from rloo.tracking.uri import check_tracking_uri

    check_tracking_uri(uri)
    check_tracking_server(uri, timeout=MLFLOW_TIMEOUT_S)
    # this step's process ends with the run closed: its bounds need not be undone (a user's own setting wins)
    configure_mlflow_http(max_retries=MLFLOW_MAX_RETRIES, timeout_s=MLFLOW_TIMEOUT_S)
    finish_pipeline_run(
        closed,
        pipeline_run_id=run_id,
        pipeline_run_name=run_name,
        experiment=experiment,
        error=(error or f"the pipeline run ended {state or 'in an unknown state'}")
        if closed == "FAILED"
        else None,
    )


def delete_leftover_job(run_id: str, namespace: str) -> None:
    """Delete this run's multi-node job unless it succeeded (:func:`rloo.k8s.jobs.delete_unfinished_job`):
    when KFP terminates a run, the train step is killed before its own clean-up reaches the API. Nothing to do
    outside a cluster, or when no namespace is known (the downward API's is set on the cluster)."""
    from rloo.k8s.builders import POD_NAMESPACE_ENV, job_name

    namespace = namespace.strip() or os.environ.get(POD_NAMESPACE_ENV, "").strip()
    if not namespace:
        return
    from rloo.k8s.jobs import delete_unfinished_job

    for line in delete_unfinished_job(job_name(run_id), namespace):
        print(f"[rloo] {line}", flush=True)
