"""The MLflow experiment a run is recorded in: created (or restored) as a model-training experiment, with a
description and a saved view of the runs page (:data:`RESULTS_VIEW_NAME`) that shows the headline results.
"""

from __future__ import annotations

import json
import time
from typing import Any

from rloo.tracking.summary import HEADLINE_METRICS, REWARD_SOURCE
from rloo.tracking.tags import EXPERIMENT_KIND, TAG_EXPERIMENT_KIND, TAG_NOTE, TAG_PROMOTION, digest

EXPERIMENT_ENV = "MLFLOW_EXPERIMENT_NAME"
DEFAULT_EXPERIMENT = "rloo"

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


def _written_by_rloo(tag_value: str, recorded: str | None) -> bool:
    """Whether the saved view is still as rloo wrote it (not changed in the UI since): its state is the
    first one rloo wrote, or has the digest ``recorded`` beside it."""
    state = _view_state(tag_value)
    if state is None:
        return False
    return state == _FIRST_VIEW_STATE or digest(json.dumps(state, sort_keys=True)) == recorded


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
        TAG_VIEW_DIGEST: digest(json.dumps(state, sort_keys=True)),
    }
