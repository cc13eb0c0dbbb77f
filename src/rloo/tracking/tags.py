"""The tags rloo writes on MLflow runs and reads back (what the UI and :func:`MlflowClient.search_runs` filter
on), the stage names they hold, and how a tag value goes into a search filter.

- a pipeline's parent run: ``rloo.kind=pipeline``, ``rloo.pipeline_run_id``, ``kfp.run_id``, ``kfp.run_name``;
- a stage's run: ``rloo.kind=stage``, ``rloo.stage``, ``mlflow.parentRunId``, the KFP tags, ``rloo.output_dir``,
  and ``rloo.resumed_from`` when it replaces a run of the same stage that was left RUNNING (a pod that died);
- both: ``rloo.location.<name>`` for the locations among a stage's settings (its outputs, per-run copies,
  endpoints: :func:`rloo.tracking.params.split_locations`), which are tags rather than params so that params
  are the settings that can differ between runs; ``mlflow.note.content``, the run's description.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

from rloo.tracking.params import split_locations

TAG_KIND = "rloo.kind"
TAG_STAGE = "rloo.stage"
TAG_PIPELINE_RUN_ID = "rloo.pipeline_run_id"
TAG_RESUMED_FROM = "rloo.resumed_from"
TAG_KFP_RUN_ID = "kfp.run_id"
TAG_KFP_RUN_NAME = "kfp.run_name"
TAG_PARENT = "mlflow.parentRunId"
TAG_OUTPUT_DIR = "rloo.output_dir"
TAG_ERROR = "rloo.error"
# MLflow 3 records what an experiment holds in this tag (its tools take an untagged one for GenAI): these
# hold model-training runs. The UI's own mode comes from the URL (rloo.tracking.ui.runs_path).
TAG_EXPERIMENT_KIND = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"
TAG_CLOSED_BY = "rloo.closed_by"
TAG_LOCATION_PREFIX = "rloo.location."
# A run's (and an experiment's) description in the MLflow UI; the digest of the one rloo wrote, so that a
# description edited in the UI is never overwritten.
TAG_NOTE = "mlflow.note.content"
TAG_NOTE_DIGEST = "rloo.note_digest"
# The name rloo gave a run: renamed only while it still has it (or the one it was created with).
TAG_GENERATED_NAME = "rloo.generated_name"
TRAIN_STAGE = "train"
EVAL_STAGE = "eval"
TAG_PROMOTION = "rloo.promotion"  # champion | candidate | superseded | rejected, set by the push stage


def filter_value(value: str) -> str:
    """``value`` made safe inside a quoted literal of an MLflow search filter (quotes and backslashes go)."""
    return value.replace("\\", "").replace("'", "")


def digest(text: str) -> str:
    """The short digest kept beside a value rloo wrote (a description, a saved view), which tells it from one
    changed in the UI since."""
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def pipeline_ids(tags: Mapping[str, str]) -> list[str]:
    """The pipeline run id of a run's tags, as the ``run_ids`` of :func:`split_locations`."""
    run_id = tags.get(TAG_PIPELINE_RUN_ID)
    return [run_id] if run_id else []


def stage_settings(run: Any, run_ids: list[str]) -> tuple[dict[str, str], dict[str, str]]:
    """A stage run's (settings, locations): its params (less any location a run of an older rloo logged as
    a param) and its ``rloo.location.*`` tags."""
    settings, locations = split_locations(dict(run.data.params), run_ids)
    for key, value in run.data.tags.items():
        if key.startswith(TAG_LOCATION_PREFIX):
            locations[key[len(TAG_LOCATION_PREFIX) :]] = value
    return settings, locations
