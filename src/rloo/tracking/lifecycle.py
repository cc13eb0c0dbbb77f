"""The lifecycle of MLflow runs: one parent run per pipeline run, one nested run per stage, started,
taken over from a process that died, and closed (a pipeline's run by its last stage or its exit handler).

Pipeline identity comes from the environment of the stage's pod. KFP v2 does not export it by itself: the
pipeline definition sets ``KFP_RUN_ID`` from ``dsl.PIPELINE_JOB_ID_PLACEHOLDER`` and ``KFP_RUN_NAME`` from
``dsl.PIPELINE_JOB_NAME_PLACEHOLDER`` on every task. Without them a stage's run is a top-level run. The tags
the runs get are :mod:`rloo.tracking.tags`'; when a pipeline's parent run closes it gets its stages' results
(:func:`rloo.tracking.summary.copy_stage_results`).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rloo.storage.redact import redact
from rloo.tracking.descriptions import stage_run_name
from rloo.tracking.experiment import DEFAULT_EXPERIMENT, EXPERIMENT_ENV, get_or_create_experiment
from rloo.tracking.server import refuse_credentials_in_uri
from rloo.tracking.summary import copy_stage_results
from rloo.tracking.tags import (
    TAG_CLOSED_BY,
    TAG_ERROR,
    TAG_GENERATED_NAME,
    TAG_KFP_RUN_ID,
    TAG_KFP_RUN_NAME,
    TAG_KIND,
    TAG_OUTPUT_DIR,
    TAG_PARENT,
    TAG_PIPELINE_RUN_ID,
    TAG_RESUMED_FROM,
    TAG_STAGE,
    filter_value,
)

log = logging.getLogger(__name__)

KFP_RUN_ID_ENV = "KFP_RUN_ID"
KFP_RUN_NAME_ENV = "KFP_RUN_NAME"
# Written into a stage's output directory when its run could not be closed (MLflow unreachable at exit):
# the run id and the status it should get; the next run on that directory applies it.
UNCLOSED_FILE = "mlflow_unclosed.json"


@dataclass(frozen=True)
class StageRun:
    run_id: str
    experiment_id: str
    parent_run_id: str | None
    tracking_uri: str


def pipeline_run_from_env() -> tuple[str | None, str | None]:
    """(KFP run id, KFP run name) from the environment, None where unset or left as a raw placeholder."""

    def get(name: str) -> str | None:
        v = os.environ.get(name, "").strip()
        return v if v and "{{" not in v else None

    return get(KFP_RUN_ID_ENV), get(KFP_RUN_NAME_ENV)


def _kfp_tags(pipeline_run_id: str | None, pipeline_run_name: str | None) -> dict[str, str]:
    tags = {}
    if pipeline_run_id:
        tags[TAG_KFP_RUN_ID] = pipeline_run_id
        tags[TAG_PIPELINE_RUN_ID] = pipeline_run_id
    if pipeline_run_name:
        tags[TAG_KFP_RUN_NAME] = pipeline_run_name
    return tags


def get_or_create_parent_run(
    client: Any,
    experiment_id: str,
    pipeline_run_id: str,
    pipeline_run_name: str | None = None,
    start_time_ms: int | None = None,
) -> str:
    """The parent run of pipeline run ``pipeline_run_id``, created by whichever stage comes first (starting
    at ``start_time_ms``, that stage's start, so that no stage starts before its pipeline)."""
    filt = (
        f"tags.`{TAG_PIPELINE_RUN_ID}` = '{filter_value(pipeline_run_id)}' and tags.`{TAG_KIND}` = 'pipeline'"
    )

    def find() -> list[Any]:
        return client.search_runs(
            [experiment_id], filter_string=filt, order_by=["attributes.start_time ASC"], max_results=20
        )

    runs = find()
    if not runs:
        tags = {TAG_KIND: "pipeline", **_kfp_tags(pipeline_run_id, pipeline_run_name)}
        mine = client.create_run(
            experiment_id,
            run_name=pipeline_run_name or f"pipeline-{pipeline_run_id[:8]}",
            tags=tags,
            start_time=start_time_ms,
        )
        # Two stages starting at once may both create one: all agree on the oldest, the others go.
        runs = find() or [mine]
        if runs[0].info.run_id != mine.info.run_id:
            client.delete_run(mine.info.run_id)
    parent = runs[0]
    if parent.info.status != "RUNNING":
        client.update_run(parent.info.run_id, status="RUNNING")  # a retried pipeline runs again
    return parent.info.run_id


def start_stage_run(
    stage: str,
    *,
    experiment: str | None = None,
    tracking_uri: str | None = None,
    client: Any = None,
    run_name: str | None = None,
    parent_run_id: str | None = None,
    pipeline_run_id: str | None = None,
    pipeline_run_name: str | None = None,
    tags: dict[str, str] | None = None,
    artifact_location: str | None = None,
    supersede_running: bool = True,
    start_time_ms: int | None = None,
) -> StageRun:
    """Create the MLflow run of one stage, nested under its pipeline's parent run when there is one.

    The parent is ``parent_run_id`` if given, else the run of ``pipeline_run_id`` (default: ``KFP_RUN_ID``),
    found or created. With ``supersede_running``, runs of the same stage still marked RUNNING (their process
    died) under the same parent, or without a parent with the same ``rloo.output_dir`` tag, are marked FAILED
    and named in this run's ``rloo.resumed_from`` tag; parallel tasks of one pipeline must therefore use
    distinct stage names. A nested run not given a name of its own (``run_name`` None or the stage) is named
    ``<pipeline run's name> · <stage>`` (:func:`stage_run_name`).
    """
    from mlflow.tracking import MlflowClient

    env_id, env_name = pipeline_run_from_env()
    pipeline_run_id = pipeline_run_id or env_id
    pipeline_run_name = pipeline_run_name or env_name
    uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if client is None:
        refuse_credentials_in_uri(uri)
    client = client or MlflowClient(tracking_uri=uri)
    exp_name = experiment or os.environ.get(EXPERIMENT_ENV) or DEFAULT_EXPERIMENT
    exp_id = get_or_create_experiment(client, exp_name, artifact_location)
    if parent_run_id is None and pipeline_run_id:
        parent_run_id = get_or_create_parent_run(
            client, exp_id, pipeline_run_id, pipeline_run_name, start_time_ms=start_time_ms
        )
    run_tags = {
        TAG_KIND: "stage",
        TAG_STAGE: stage,
        **_kfp_tags(pipeline_run_id, pipeline_run_name),
        **(tags or {}),
    }
    # The same stage of the same pipeline run, or (outside a pipeline) of the same output directory: a run
    # of it still RUNNING belongs to a process that died, and this one takes over.
    same = f"tags.`{TAG_STAGE}` = '{filter_value(stage)}' and attributes.status = 'RUNNING'"
    if parent_run_id:
        run_tags[TAG_PARENT] = parent_run_id
        same += f" and tags.`{TAG_PARENT}` = '{filter_value(parent_run_id)}'"
    elif run_tags.get(TAG_OUTPUT_DIR):
        same += f" and tags.`{TAG_OUTPUT_DIR}` = '{filter_value(run_tags[TAG_OUTPUT_DIR])}'"
    else:
        supersede_running = False
    if supersede_running:
        recorded = _read_unclosed(run_tags.get(TAG_OUTPUT_DIR))
        stale = client.search_runs([exp_id], filter_string=same, max_results=50)
        for old in stale:
            # A run whose process ended while MLflow was down recorded its status; one that died did not.
            status = recorded.get(old.info.run_id, "FAILED")
            client.set_terminated(old.info.run_id, status=status)
        if stale:
            run_tags[TAG_RESUMED_FROM] = ",".join(r.info.run_id for r in stale)
    if parent_run_id and run_name in (None, stage):
        # the stage's own name, which says whose stage it is (renamed with its pipeline run)
        run_name = stage_run_name(client.get_run(parent_run_id).info.run_name, stage)
        run_tags[TAG_GENERATED_NAME] = run_name
    run = client.create_run(exp_id, run_name=run_name or stage, tags=run_tags, start_time=start_time_ms)
    if parent_run_id:
        # KFP starts a stage only after the stages before it succeeded, so an earlier stage's run still
        # RUNNING under this parent is one whose final status never reached MLflow (the server was down when
        # it ended): it succeeded. (The pipeline is a chain; parallel stages would need their own rule.)
        others = client.search_runs(
            [exp_id],
            filter_string=f"tags.`{TAG_PARENT}` = '{filter_value(parent_run_id)}' and attributes.status = 'RUNNING'",
            max_results=50,
        )
        for old in others:
            if old.info.run_id != run.info.run_id and old.data.tags.get(TAG_STAGE) != stage:
                client.set_tag(old.info.run_id, TAG_CLOSED_BY, run.info.run_id)
                client.set_terminated(old.info.run_id, status="FINISHED")
    return StageRun(run.info.run_id, exp_id, parent_run_id, client.tracking_uri)


def _read_unclosed(output_dir: str | None) -> dict[str, str]:
    """{run id: status} left by a run of ``output_dir`` that could not close itself (and removes the note)."""
    import json

    if not output_dir:
        return {}
    path = Path(output_dir) / UNCLOSED_FILE
    try:
        data = json.loads(path.read_text())
        path.unlink()
    except (OSError, ValueError):
        return {}
    status = data.get("status") if isinstance(data, dict) else None
    if status not in ("FINISHED", "FAILED", "KILLED") or not isinstance(data.get("run_id"), str):
        return {}
    return {data["run_id"]: status}


def close_orphaned_stage_runs(client: Any, experiment_id: str, parent_run_id: str, status: str) -> list[str]:
    """End the stage runs of a pipeline run still RUNNING (their process ended while MLflow was down) with
    ``status``, the pipeline's own outcome; returns their ids."""
    runs = client.search_runs(
        [experiment_id],
        filter_string=f"tags.`{TAG_PARENT}` = '{filter_value(parent_run_id)}' and attributes.status = 'RUNNING'",
        max_results=100,
    )
    for r in runs:
        client.set_tag(r.info.run_id, TAG_CLOSED_BY, "pipeline exit handler")
        client.set_terminated(r.info.run_id, status=status)
    return [r.info.run_id for r in runs]


def finish_pipeline_run(
    status: str = "FINISHED",
    *,
    pipeline_run_id: str | None = None,
    pipeline_run_name: str | None = None,
    experiment: str | None = None,
    tracking_uri: str | None = None,
    client: Any = None,
    error: str | None = None,
) -> str | None:
    """Mark the parent run of a pipeline run FINISHED/FAILED (e.g. from the last stage or an exit handler).

    A FAILED pipeline without a parent run yet (it failed before any stage reported, e.g. in validation)
    gets one, so every failure is visible in MLflow; ``error`` is kept in its ``rloo.error`` tag.
    """
    from mlflow.tracking import MlflowClient

    env_id, env_name = pipeline_run_from_env()
    pipeline_run_id = pipeline_run_id or env_id
    if not pipeline_run_id:
        return None
    if client is None:
        refuse_credentials_in_uri(tracking_uri or os.environ.get("MLFLOW_TRACKING_URI"))
    client = client or MlflowClient(tracking_uri=tracking_uri or os.environ.get("MLFLOW_TRACKING_URI"))
    exp_name = experiment or os.environ.get(EXPERIMENT_ENV) or DEFAULT_EXPERIMENT
    exp = client.get_experiment_by_name(exp_name)
    if exp is None and status == "FINISHED":
        return None
    exp_id = exp.experiment_id if exp is not None else get_or_create_experiment(client, exp_name)
    runs = client.search_runs(
        [exp_id],
        filter_string=f"tags.`{TAG_PIPELINE_RUN_ID}` = '{filter_value(pipeline_run_id)}' and tags.`{TAG_KIND}` = 'pipeline'",
        order_by=["attributes.start_time ASC"],
        max_results=1,
    )
    if runs:
        run_id = runs[0].info.run_id
    elif status != "FINISHED":
        run_id = get_or_create_parent_run(client, exp_id, pipeline_run_id, pipeline_run_name or env_name)
    else:
        return None
    if error:
        client.set_tag(run_id, TAG_ERROR, error[:5000])
    close_orphaned_stage_runs(client, exp_id, run_id, status)
    try:
        copy_stage_results(client, exp_id, run_id)
    except Exception as e:  # the summary row is a convenience: the run must be closed regardless
        log.warning("could not copy the stages' results to pipeline run %s: %s", run_id, redact(str(e)))
    client.set_terminated(run_id, status=status)
    return run_id
