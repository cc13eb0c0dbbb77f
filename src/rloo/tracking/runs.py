"""MLflow runs: one parent run per pipeline run, one nested run per stage; where runs are recorded.

Pipeline identity comes from the environment of the stage's pod. KFP v2 does not export it by itself: the
pipeline definition sets ``KFP_RUN_ID`` from ``dsl.PIPELINE_JOB_ID_PLACEHOLDER`` and ``KFP_RUN_NAME`` from
``dsl.PIPELINE_JOB_NAME_PLACEHOLDER`` on every task. Without them a stage's run is a top-level run.

Tags written (what the UI and :func:`MlflowClient.search_runs` filter on):

- parent: ``rloo.kind=pipeline``, ``rloo.pipeline_run_id``, ``kfp.run_id``, ``kfp.run_name``;
- stage: ``rloo.kind=stage``, ``rloo.stage``, ``mlflow.parentRunId``, the KFP tags, ``rloo.output_dir``, and
  ``rloo.resumed_from`` when it replaces a run of the same stage that was left RUNNING (a pod that died);
- both: ``rloo.location.<name>`` for the locations among a stage's settings (its outputs, per-run copies,
  endpoints: :func:`rloo.tracking.params.split_locations`), which are tags rather than params so that params
  are the settings that can differ between runs; ``mlflow.note.content``, the run's description.

A pipeline's parent run is named after what was set (``lr=5e-4 k=4 on Qwen2.5-0.5B (1a2b3c4d)``, see
:func:`rloo.tracking.params.run_label`) unless its KFP run name was given by the user (not a generated
``<pipeline>-<timestamp>`` one) or the training config has a ``run_name``; when it closes it gets the
headline results (:data:`HEADLINE_METRICS`) under names that sort before every other metric.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from rloo.errors import ServiceUnavailable, UserError
from rloo.storage.redact import redact
from rloo.tracking.params import (
    changed_settings,
    distinguishing_settings,
    human_count,
    run_label,
    split_locations,
    training_defaults,
)

log = logging.getLogger(__name__)

KFP_RUN_ID_ENV = "KFP_RUN_ID"
KFP_RUN_NAME_ENV = "KFP_RUN_NAME"
EXPERIMENT_ENV = "MLFLOW_EXPERIMENT_NAME"
DEFAULT_EXPERIMENT = "rloo"
EMBEDDED_DIR = "mlruns"

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
# What KFP and 'rloo pipeline submit' call a run nobody named: '<pipeline>-<date>-<time>[-<micros>]',
# the KFP UI's 'Run of <pipeline> (<5 hex>)'.
_GENERATED_KFP_NAME = re.compile(
    r".+-\d{4}-?\d{2}-?\d{2}-\d{2}-?\d{2}-?\d{2}(-\d+)?|Run of .+ \([0-9a-f]{5}\)"
)

# The headline results of a pipeline run, on its parent run: capitalised, so that they sort before every
# other metric (MLflow's UI orders chart sections and metrics by code point: 'Result' before 'baseline'),
# and distinct within the first characters that a narrow column header or chart title shows.
METRIC_WIN_RATE = "Result/win_rate"  # the trained model's win rate against the references
METRIC_GAIN_VS_SFT = "Result/gain_vs_sft"  # paired difference of win rates, trained minus SFT
METRIC_FINAL_REWARD = "Result/final_reward"  # mean reward of the last FINAL_UPDATES updates
HEADLINE_METRICS = (METRIC_WIN_RATE, METRIC_GAIN_VS_SFT, METRIC_FINAL_REWARD)
# The gain's earlier name, still written for whoever reads it (the same value); not in the results view.
METRIC_WIN_RATE_GAIN = "Result/win_rate_minus_sft"
FINAL_UPDATES = 3  # one update's batch is noisy (the KFP UI's final_score is the same mean)
# Stage metrics not copied onto the parent: utilisation over time (meaningless as one number) and the SFT
# model's results, the same in every run of one SFT model (identical charts first in the chart view);
# they stay on the eval run, and the difference to them is METRIC_GAIN_VS_SFT.
_NOT_COPIED = ("system/", "baseline/")
TRAIN_STAGE = "train"
EVAL_STAGE = "eval"
TAG_PROMOTION = "rloo.promotion"  # champion | candidate | superseded | rejected, set by the push stage
REWARD_SOURCE = "objective/scores"  # the train run's mean reward of an update's completions
GAIN_SOURCE = "diff_trained_minus_baseline/estimate"  # the eval run's paired difference, trained - SFT
# The training curves a pipeline's parent run gets with every step, so that the chart view, which draws the
# rows of the runs table (parents; their nested runs folded), overlays the runs' curves.
PARENT_CURVES = (REWARD_SOURCE, "objective/kl")
# How a stage run nested under a pipeline run is named: '<pipeline run's name> · train', so that a chart
# legend or a list of runs says whose stage it is.
STAGE_NAME_SEPARATOR = " · "

# MLflow 3.17 keeps an experiment's saved views (the runs page's "Views" menu) in experiment tags
# 'mlflow.sharedViewState.<id>': {"name", "createdAt", "updatedAt", "state": JSON of the page's state}; the
# page opens one with ?viewStateShareKey=<id>, in the chart view with &compareRunsMode=CHART. Every
# experiment rloo makes has this one.
VIEW_TAG_PREFIX = "mlflow.sharedViewState."
RESULTS_VIEW_ID = "rloo-results"
RESULTS_VIEW_NAME = "RLOO results"
RESULTS_VIEW_PARAMS = ("learning_rate", "rloo_k", "kl_coef", "seed")
# The query of the runs page that opens the results view in the chart view: the runs' reward curves
# overlaid, what differs between them (the promotion among the tags), the headline results.
RESULTS_VIEW_QUERY = f"compareRunsMode=CHART&viewStateShareKey={RESULTS_VIEW_ID}"
# The digest of the view state rloo wrote: a view someone changed in the UI is theirs, one rloo wrote is
# brought up to date.
TAG_VIEW_DIGEST = "rloo.results_view_digest"
EXPERIMENT_NOTE = (
    "RLOO runs: one row per pipeline run, its train, eval and push runs nested under it. The "
    f"'{RESULTS_VIEW_NAME}' view (Views menu) shows the headline results: "
    + ", ".join(f"`{m}`" for m in HEADLINE_METRICS)
    + f", and which run is the champion (`{TAG_PROMOTION}`); its chart view overlays the reward curves."
)
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


def refuse_credentials_in_uri(uri: str | None) -> None:
    """Refuse ``user:password@`` in a tracking URI: MLflow prints the URI as it is in its "View run ... at"
    lines and in run metadata, so the password would end up in every pod log. Credentials belong in
    ``MLFLOW_TRACKING_USERNAME`` / ``MLFLOW_TRACKING_PASSWORD`` (or ``MLFLOW_TRACKING_TOKEN``), which MLflow
    sends as a header and never prints."""
    if not uri:
        return
    try:
        parsed = urlparse(uri)
        userinfo = parsed.username is not None or parsed.password is not None
    except ValueError:  # an unparsable port etc.: check_tracking_server says what is wrong with it
        userinfo = "@" in uri.split("://", 1)[-1].split("/", 1)[0]
    if userinfo:
        raise UserError(
            f"MLFLOW_TRACKING_URI={redact(uri)} carries credentials, which MLflow would print in its log "
            "lines: remove 'user:password@' from the URI and set MLFLOW_TRACKING_USERNAME / "
            "MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN) instead."
        )


def resolve_tracking_uri(
    tracking_uri: str | None = None, work_dir: str | Path | None = None
) -> tuple[str, str | None]:
    """(tracking URI, artifact location for new experiments).

    The argument, else ``MLFLOW_TRACKING_URI``, else the embedded default: a sqlite store at
    ``<work_dir>/mlruns/mlflow.db`` with artifacts in ``<work_dir>/mlruns/artifacts`` (no server needed).
    """
    uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        refuse_credentials_in_uri(uri)
        return uri, None
    base = Path(work_dir or Path.cwd()).resolve() / EMBEDDED_DIR
    return f"sqlite:///{base / 'mlflow.db'}", (base / "artifacts").as_uri()


def configure_mlflow_http(*, max_retries: int = 0, timeout_s: int = 30) -> None:
    """Make each MLflow HTTP call of this process fail fast: by default for the sinks, whose background loop
    owns retrying (with backoff and a buffer), so MLflow's own minutes-long retry chain would only delay
    flushing. User settings win."""
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", str(max_retries))
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(timeout_s))


def check_tracking_server(tracking_uri: str | None = None, *, timeout: float = 10.0) -> None:
    """Fail fast, in one line, if the tracking server cannot be used; call before training starts.

    Only HTTP(S) servers are contacted (one request, no retries); the embedded sqlite store needs nothing.
    """
    uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        return
    refuse_credentials_in_uri(uri)
    scheme = urlparse(uri).scheme
    shown = redact(uri)
    if scheme == "sqlite":
        try:
            import alembic  # noqa: F401
            import sqlalchemy  # noqa: F401
        except ImportError:
            raise UserError(
                f"MLFLOW_TRACKING_URI={shown} needs sqlalchemy and alembic: pip install 'rloo-kfp[tracking]'."
            ) from None
        return
    if scheme not in ("http", "https"):
        return
    from mlflow.utils.credentials import get_default_host_creds
    from mlflow.utils.rest_utils import http_request

    endpoint = "/api/2.0/mlflow/experiments/search"
    try:
        resp = http_request(
            get_default_host_creds(uri),
            endpoint,
            "POST",
            max_retries=0,
            timeout=timeout,
            raise_on_status=False,
            json={"max_results": 1},
        )
    except Exception as e:
        reason = _reason(e)
        # exit 75, not 2: a server restarting or a network blip heals, and a retried pipeline step tries again
        raise ServiceUnavailable(
            f"MLflow tracking server {shown} is unreachable ({reason}): start it or fix MLFLOW_TRACKING_URI, "
            "or unset MLFLOW_TRACKING_URI to record runs in a local sqlite store under the output directory."
        ) from None
    if resp.status_code in (401, 403):
        raise UserError(
            f"MLflow tracking server {shown} refused the request (HTTP {resp.status_code}): set "
            "MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD or MLFLOW_TRACKING_TOKEN."
        )
    if resp.status_code in (502, 503, 504):
        raise ServiceUnavailable(
            f"MLflow tracking server {shown} is unavailable (HTTP {resp.status_code}): it is starting or "
            "overloaded; try again, or unset MLFLOW_TRACKING_URI to record runs locally."
        )
    if resp.status_code != 200:
        raise UserError(
            f"{shown} does not answer like an MLflow tracking server (HTTP {resp.status_code} on {endpoint}): "
            "MLFLOW_TRACKING_URI must be the server's base URL, e.g. http://mlflow.example:5000."
        )


def _reason(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    for needle in (
        "Connection refused",
        "Name or service not known",
        "timed out",
        "Read timed out",
        "No route to host",
    ):
        if needle.lower() in text.lower():
            return needle.lower()
    return redact(text)[:160]


# ----------------------------------------------------------------------------------------------------
def get_or_create_experiment(client: Any, name: str, artifact_location: str | None = None) -> str:
    """The id of experiment ``name``, created (as a model-training experiment) or restored as needed."""
    from mlflow.exceptions import MlflowException

    exp = client.get_experiment_by_name(name)
    if exp is None:
        tags = {TAG_EXPERIMENT_KIND: EXPERIMENT_KIND, TAG_NOTE: EXPERIMENT_NOTE, **results_view_tag()}
        try:
            return client.create_experiment(name, artifact_location=artifact_location, tags=tags)
        except MlflowException as e:
            if e.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
            exp = client.get_experiment_by_name(name)
    if exp.lifecycle_stage == "deleted":
        client.restore_experiment(exp.experiment_id)
    have = exp.tags or {}
    if TAG_EXPERIMENT_KIND not in have:  # one made elsewhere; a kind someone chose is kept
        client.set_experiment_tag(exp.experiment_id, TAG_EXPERIMENT_KIND, EXPERIMENT_KIND)
    view_key = f"{VIEW_TAG_PREFIX}{RESULTS_VIEW_ID}"
    if view_key not in have or _written_by_rloo(have[view_key], have.get(TAG_VIEW_DIGEST)):
        # none yet (an experiment made elsewhere), or one an earlier rloo wrote: this rloo's view; one a
        # user changed in the UI is kept
        current = results_view_tag()
        if _view_state(have.get(view_key, "")) != _view_state(current[view_key]):
            for key, value in current.items():
                client.set_experiment_tag(exp.experiment_id, key, value)
    return exp.experiment_id


# The saved view's state as the first rloo wrote it: an experiment that still has it gets the current one.
_FIRST_VIEW_STATE = {
    "selectedColumns": [
        "metrics.`Result/win_rate`",
        "metrics.`Result/win_rate_minus_sft`",
        "metrics.`Result/final_reward`",
        "params.`learning_rate`",
        "params.`rloo_k`",
        "params.`kl_coef`",
    ]
}


def _view_state(tag_value: str) -> Any:
    """The page state a saved view's tag holds (its envelope's ``state``, decoded), or None."""
    try:
        return json.loads(json.loads(tag_value)["state"])
    except (ValueError, KeyError, TypeError):
        return None


def _written_by_rloo(tag_value: str, digest: str | None) -> bool:
    """Whether the saved view is still as rloo wrote it (not changed in the UI since)."""
    state = _view_state(tag_value)
    if state is None:
        return False
    return state == _FIRST_VIEW_STATE or _digest(json.dumps(state, sort_keys=True)) == digest


def results_view_state() -> dict[str, Any]:
    """The runs page's state in the saved view :data:`RESULTS_VIEW_NAME` (its fields are MLflow's
    ``ExperimentPageUIState``): in the table, the promotion, the headline results and the main settings as
    columns, wide enough for their names; in the chart view, first the reward curves and what differs
    between the runs (parameters and tags: the promotion), then the headline results, then every other
    metric as MLflow lays them out."""
    promotion = f"tags.`{TAG_PROMOTION}`"
    metrics = [f"metrics.`{m}`" for m in HEADLINE_METRICS]
    params = [f"params.`{p}`" for p in RESULTS_VIEW_PARAMS]
    name = "attributes.`Run Name`"
    # MLflow applies a width only to a column of columnOrder; ~8 px a character of a header
    widths = {name: 320, promotion: 130, **{m: 16 + 8 * len(m.split("`")[1]) for m in metrics}}
    compare, result = "rloo-compare", "rloo-result"

    def card(uuid: str, section: str, kind: str, **fields: Any) -> dict[str, Any]:
        return {
            "uuid": uuid,
            "type": kind,
            "metricSectionId": section,
            "isGenerated": False,
            "deleted": False,
            "runsCountToCompare": 10,
            **fields,
        }

    charts = [
        card(
            "rloo-reward",
            compare,
            "LINE",
            metricKey=REWARD_SOURCE,
            selectedMetricKeys=[REWARD_SOURCE],
            xAxisKey="step",
            xAxisScaleType="linear",
            scaleType="linear",
            selectedXAxisMetricKey="",
            lineSmoothness=0,
            useGlobalXaxisKey=False,
            useGlobalLineSmoothing=False,
        ),
        card(
            "rloo-difference",
            compare,
            "DIFFERENCE",
            chartName="What differs",
            compareGroups=["Parameters", "Tags"],
            showChangeFromBaseline=False,
            showDifferencesOnly=True,
            baselineColumnUuid="",
        ),
        *(card(f"rloo-{m}", result, "BAR", metricKey=m) for m in HEADLINE_METRICS),
    ]
    return {
        "selectedColumns": [promotion, *metrics, *params],
        "columnOrder": [name, promotion, *metrics, *params],
        "columnWidths": widths,
        "compareRunCharts": charts,
        "compareRunSections": [
            {
                "uuid": compare,
                "name": "Compare",
                "display": True,
                "isReordered": True,
                "columns": 2,
                "cardHeight": 640,
            },
            {"uuid": result, "name": "Result", "display": True, "isReordered": True, "columns": 3},
        ],
        # the sections in this order, MLflow's own (one per metric prefix) after them
        "isAccordionReordered": True,
    }


def results_view_tag() -> dict[str, str]:
    """The experiment tags of the saved view :data:`RESULTS_VIEW_NAME` (:func:`results_view_state`) and of
    the digest that tells it from one changed in the UI."""
    state = results_view_state()
    now = int(time.time() * 1000)
    envelope = {"name": RESULTS_VIEW_NAME, "createdAt": now, "updatedAt": now, "state": json.dumps(state)}
    return {
        f"{VIEW_TAG_PREFIX}{RESULTS_VIEW_ID}": json.dumps(envelope),
        TAG_VIEW_DIGEST: _digest(json.dumps(state, sort_keys=True)),
    }


def filter_value(value: str) -> str:
    """``value`` made safe inside a quoted literal of an MLflow search filter (quotes and backslashes go)."""
    return value.replace("\\", "").replace("'", "")


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


def copy_stage_results(client: Any, experiment_id: str, parent_run_id: str) -> dict[str, int]:
    """Copy the stages' settings and final metric values onto their pipeline (parent) run, so that one row
    per pipeline run in the MLflow UI's table compares runs: training settings under their own names (the
    pipeline's parameter names), other stages' as ``<stage>.<name>``; their locations as ``rloo.location.*``
    tags (named the same way), never params; metrics under their names (the stages' names do not overlap; a
    clash is prefixed with the stage), the SFT model's (``baseline/*``) left on the eval run; the headline
    results (:data:`HEADLINE_METRICS`); the training curves of :data:`PARENT_CURVES` with every step (the
    chart view overlays them); the push decision as a tag; the run's name and description.

    Params are immutable in MLflow: ones the parent already has are left alone (a retried exit handler).
    Returns how many params and metrics were copied."""
    from mlflow.entities import Metric, Param, RunTag

    children = client.search_runs(
        [experiment_id],
        filter_string=f"tags.`{TAG_PARENT}` = '{filter_value(parent_run_id)}'",
        order_by=["attributes.start_time ASC"],
        max_results=200,
    )
    parent = client.get_run(parent_run_id)
    have = dict(parent.data.params)
    run_ids = _pipeline_ids(parent.data.tags)
    params: dict[str, str] = {}
    tags: dict[str, str] = {}
    metrics: dict[str, float] = {}
    stages: dict[str, tuple[Any, dict[str, str], dict[str, str]]] = {}
    now = int(time.time() * 1000)
    for run in children:
        stage = run.data.tags.get(TAG_STAGE)
        if not stage:
            continue
        settings, locations = stage_settings(run, run_ids)
        stages[stage] = (run, settings, locations)  # the latest run of a stage (a retried one) wins
        for name, value in settings.items():
            key = name if stage == TRAIN_STAGE else f"{stage}.{name}"
            if key not in have and key not in params:
                params[key] = value
        for name, value in locations.items():
            tags[TAG_LOCATION_PREFIX + (name if stage == TRAIN_STAGE else f"{stage}.{name}")] = value
        for name, value in run.data.metrics.items():
            if name.startswith(_NOT_COPIED) or (stage == TRAIN_STAGE and name in PARENT_CURVES):
                continue  # the curves are copied whole, below
            metrics[name if name not in metrics else f"{stage}.{name}"] = value
        if run.data.tags.get(TAG_PROMOTION):
            tags[TAG_PROMOTION] = run.data.tags[TAG_PROMOTION]
    metrics.update(headline_metrics(client, stages))
    items = list(params.items())
    for i in range(0, len(items), 100):  # MLflow takes at most 100 params per batch
        client.log_batch(parent_run_id, params=[Param(k, v) for k, v in items[i : i + 100]])
    values = [Metric(k, float(v), now, 0) for k, v in metrics.items()]
    if TRAIN_STAGE in stages:
        values += missing_curve_points(client, stages[TRAIN_STAGE][0].info.run_id, parent_run_id)
    for i in range(0, len(values), 1000):
        client.log_batch(parent_run_id, metrics=values[i : i + 1000])
    tag_items = [RunTag(k, v[:8000]) for k, v in tags.items()]
    for i in range(0, len(tag_items), 100):
        client.log_batch(parent_run_id, tags=tag_items[i : i + 100])
    train = stages.get(TRAIN_STAGE)
    evaluation = stages.get(EVAL_STAGE)
    describe_pipeline_run(
        client,
        parent_run_id,
        train=(train[1], train[2]) if train else None,
        evaluation=evaluation[1] if evaluation else None,
    )
    return {"params": len(params), "metrics": len(metrics)}


def _pipeline_ids(tags: Mapping[str, str]) -> list[str]:
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


def headline_metrics(client: Any, stages: Mapping[str, tuple[Any, Any, Any]]) -> dict[str, float]:
    """:data:`HEADLINE_METRICS` from the train and eval runs of a pipeline run (those they have)."""
    out: dict[str, float] = {}
    if EVAL_STAGE in stages:
        found = stages[EVAL_STAGE][0].data.metrics
        sources = {METRIC_WIN_RATE: "trained/win_rate", METRIC_GAIN_VS_SFT: GAIN_SOURCE}
        sources[METRIC_WIN_RATE_GAIN] = GAIN_SOURCE
        for name, source in sources.items():
            if source in found:
                out[name] = float(found[source])
    if TRAIN_STAGE in stages:
        history = client.get_metric_history(stages[TRAIN_STAGE][0].info.run_id, REWARD_SOURCE)
        last: dict[int, float] = {m.step: m.value for m in sorted(history, key=lambda m: m.timestamp)}
        tail = [last[step] for step in sorted(last)[-FINAL_UPDATES:]]
        if tail:
            out[METRIC_FINAL_REWARD] = sum(tail) / len(tail)
    return out


def missing_curve_points(client: Any, train_run_id: str, parent_run_id: str) -> list[Any]:
    """The points of the train run's :data:`PARENT_CURVES` that its pipeline's parent run lacks (the train
    stage's sink sends them as they come: :meth:`rloo.tracking.mlflow_sink.MlflowSink.log_metrics`; what
    an outage or an older rloo left out comes here), with their steps and times."""
    from mlflow.entities import Metric

    out = []
    for key in PARENT_CURVES:
        have = {(m.step, m.timestamp, m.value) for m in client.get_metric_history(parent_run_id, key)}
        for m in client.get_metric_history(train_run_id, key):
            if (m.step, m.timestamp, m.value) not in have:
                out.append(Metric(key, m.value, m.timestamp, m.step))
    return out


# ----------------------------------------------------------------------------------------------------
# Names and descriptions
def stage_run_name(parent_name: str | None, stage: str) -> str:
    """The name of a pipeline run's stage run: ``lr=5e-4 k=4 ... (1a2b3c4d) · train``."""
    return f"{parent_name}{STAGE_NAME_SEPARATOR}{stage}" if parent_name else stage


def is_generated_kfp_name(name: str | None) -> bool:
    """Whether a KFP run name is one nobody chose (a timestamp): see :data:`_GENERATED_KFP_NAME`."""
    return bool(name) and _GENERATED_KFP_NAME.fullmatch(str(name)) is not None


def _user_run_name(settings: Mapping[str, str]) -> str | None:
    name = settings.get("run_name")
    return name if name not in (None, "", "None") else None


def _rename(client: Any, run: Any, name: str, replaceable: set[str]) -> bool:
    """Name ``run`` ``name`` if it still has a name rloo gave it or one of ``replaceable``; whether it has
    ``name`` now."""
    current = run.info.run_name
    if current == name:
        return True
    if current in replaceable or current == run.data.tags.get(TAG_GENERATED_NAME):
        client.update_run(run.info.run_id, name=name)
        client.set_tag(run.info.run_id, TAG_GENERATED_NAME, name)
        return True
    return False


def _rename_pipeline_run(client: Any, parent: Any, name: str, replaceable: set[str]) -> None:
    """Name a pipeline's parent run ``name`` (as :func:`_rename`) and its stage runs after it, those that
    still have the name rloo gave them (or their stage's)."""
    if not _rename(client, parent, name, replaceable):
        name = parent.info.run_name  # the user's: the stages are named after it all the same
    children = client.search_runs(
        [parent.info.experiment_id],
        filter_string=f"tags.`{TAG_PARENT}` = '{filter_value(parent.info.run_id)}'",
        max_results=200,
    )
    for child in children:
        stage = child.data.tags.get(TAG_STAGE)
        if stage:
            _rename(client, child, stage_run_name(name, stage), {stage})


# Peers a run's name is told apart from: the latest training runs of its experiment.
_MAX_PEERS = 50


def _training_peers(client: Any, experiment_id: str) -> list[Any]:
    """The latest training runs of an experiment (a pipeline's train stage, or a training run alone)."""
    return list(
        client.search_runs(
            [experiment_id],
            filter_string=f"tags.`{TAG_STAGE}` = '{TRAIN_STAGE}'",
            order_by=["attributes.start_time DESC"],
            max_results=_MAX_PEERS,
        )
    )


def _peer_label(run: Any, parent: Any | None, first: set[str]) -> str | None:
    """The name a training run's peer (its train run ``run``, its pipeline's parent run ``parent``) gets
    among runs that differ in ``first``; None where its user named it."""
    tags = (parent or run).data.tags
    kfp_id = tags.get(TAG_PIPELINE_RUN_ID)
    settings, locations = stage_settings(run, [kfp_id] if kfp_id else [])
    if _user_run_name(settings):
        return None
    suffix = (kfp_id or parent.info.run_id)[:8] if parent is not None else run.info.run_id[:8]
    return run_label(settings, locations, suffix=suffix, run_ids=[kfp_id] if kfp_id else [], first=first)


def name_apart(client: Any, experiment_id: str, settings: Mapping[str, str], me: str) -> set[str]:
    """The training settings that tell the runs of an experiment apart (:func:`distinguishing_settings`
    over ``settings``, the run being named, and its peers, :func:`_training_peers`), and the peers renamed
    to start with them too, those that still have the name rloo gave them: two runs compared side by side
    read differently in the first words of their names. ``me``: the run being named (its train run or its
    parent run), not a peer."""
    peers = [
        r
        for r in _training_peers(client, experiment_id)
        if me not in (r.info.run_id, r.data.tags.get(TAG_PARENT))
    ]
    first = distinguishing_settings(
        [dict(settings), *(stage_settings(r, _pipeline_ids(r.data.tags))[0] for r in peers)]
    )
    if not first:
        return first
    parent_ids = {r.data.tags[TAG_PARENT] for r in peers if r.data.tags.get(TAG_PARENT)}
    parents = {}
    if parent_ids:
        found = client.search_runs(
            [experiment_id],
            filter_string=f"tags.`{TAG_KIND}` = 'pipeline'",
            order_by=["attributes.start_time DESC"],
            max_results=_MAX_PEERS * 2,
        )
        parents = {p.info.run_id: p for p in found if p.info.run_id in parent_ids}
    for run in peers:
        parent = parents.get(run.data.tags.get(TAG_PARENT, ""))
        if run.data.tags.get(TAG_PARENT) and parent is None:
            continue  # its pipeline run is gone, or older than the ones looked at
        label = _peer_label(run, parent, first)
        target = parent or run
        if label is None or label == target.info.run_name:
            continue
        if target.info.run_name != target.data.tags.get(TAG_GENERATED_NAME):
            continue  # named by its user (or renamed in the UI)
        if parent is not None:
            _rename_pipeline_run(client, parent, label, set())
        else:
            _rename(client, run, label, set())
    return first


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _describe(client: Any, run: Any, text: str) -> None:
    """Set ``run``'s description to ``text`` unless someone wrote it another one."""
    from mlflow.entities import RunTag

    current = run.data.tags.get(TAG_NOTE)
    if current == text or (current and _digest(current) != run.data.tags.get(TAG_NOTE_DIGEST)):
        return
    client.log_batch(run.info.run_id, tags=[RunTag(TAG_NOTE, text), RunTag(TAG_NOTE_DIGEST, _digest(text))])


def training_note(settings: Mapping[str, str], locations: Mapping[str, str]) -> list[str]:
    """Markdown lines of a description saying what a training run was given."""

    def code(value: str) -> str:
        return f"`{value}`"

    changed = changed_settings(settings, training_defaults())
    lines = [
        "- Training, changed from the defaults: "
        + (", ".join(code(f"{k}={v}") for k, v in changed.items()) or "nothing")
    ]
    model = (
        locations.get("model_source")
        or settings.get("model_name_or_path")
        or locations.get("model_name_or_path")
    )
    size = human_count(settings.get("model/total_params", ""))
    if model:
        lines.append(f"- Model: {code(model)}" + (f", {size} parameters" if size else ""))
    if settings.get("dataset_name") not in (None, "None"):
        split = settings.get("dataset_train_split", "train")
        lines.append(f"- Prompts: {code(settings['dataset_name'])}, split {code(split)}")
    rewards = (
        [settings["reward_model_path"]] if settings.get("reward_model_path") not in (None, "None") else []
    )
    try:
        funcs = json.loads(settings.get("reward_funcs") or "[]")
    except ValueError:
        funcs = [settings["reward_funcs"]]
    rewards += [str(f) for f in funcs] if isinstance(funcs, list) else []
    if rewards:
        lines.append("- Reward: " + ", ".join(code(r) for r in rewards))
    output = locations.get("publish_uri") or locations.get("output_dir")
    if output:
        lines.append(f"- Trained model: {code(output)}")
    return lines


def describe_pipeline_run(
    client: Any,
    parent_run_id: str,
    *,
    train: tuple[Mapping[str, str], Mapping[str, str]] | None = None,
    evaluation: Mapping[str, str] | None = None,
) -> None:
    """Name a pipeline's parent run after its training settings (``train``: the train run's settings and
    locations) unless the user named it, and describe it: training, evaluation (``evaluation``: the eval
    run's settings) and KFP run. Called when training starts and again when the pipeline run closes."""
    parent = client.get_run(parent_run_id)
    tags = parent.data.tags
    kfp_id, kfp_name = tags.get(TAG_PIPELINE_RUN_ID), tags.get(TAG_KFP_RUN_NAME)
    run_ids = [kfp_id] if kfp_id else []
    if train is not None:
        settings, locations = train
        name = _user_run_name(settings) or run_label(
            settings,
            locations,
            suffix=(kfp_id or parent_run_id)[:8],
            run_ids=run_ids,
            first=name_apart(client, parent.info.experiment_id, settings, parent_run_id),
        )
        replaceable = {f"pipeline-{(kfp_id or '')[:8]}"}
        if kfp_name and is_generated_kfp_name(kfp_name):
            replaceable.add(kfp_name)
        _rename_pipeline_run(client, parent, name, replaceable)
    lines = training_note(*train) if train is not None else []
    if evaluation is not None:
        judge, data = evaluation.get("judge_model", "?"), evaluation.get("dataset_name", "?")
        split, n = evaluation.get("dataset_split", "test"), evaluation.get("num_examples", "None")
        rows = "all rows" if n in ("None", "0", "") else f"first {n} rows"
        lines.append(f"- Evaluation: judge `{judge}` on `{data}`, split `{split}`, {rows}")
    if kfp_id:
        lines.append(f"- KFP run: `{kfp_name or '?'}` (id `{kfp_id}`)")
    if lines:
        _describe(client, client.get_run(parent_run_id), "\n".join(lines))


def describe_training_run(
    client: Any,
    run_id: str,
    settings: Mapping[str, str],
    locations: Mapping[str, str],
    *,
    keep_name: bool = False,
) -> None:
    """Name a training run that is not part of a pipeline after its settings (unless ``keep_name``: its
    caller named it, or the config's ``run_name`` did) and describe it."""
    run = client.get_run(run_id)
    if not keep_name:
        first = name_apart(client, run.info.experiment_id, settings, run_id)
        name = _user_run_name(settings) or run_label(settings, locations, suffix=run_id[:8], first=first)
        _rename(client, run, name, {TRAIN_STAGE})
        run = client.get_run(run_id)
    _describe(client, run, "\n".join(training_note(settings, locations)))
