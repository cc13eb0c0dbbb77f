"""Comparing two pipeline runs in the MLflow UI, as rloo records them: names that differ in their first words,
stage runs named after their pipeline run, the reward curve on the pipeline (parent) run with its steps, and
the saved "RLOO results" view that lays the comparison out.

What the UI does with these records, in MLflow's own code (mlflow/mlflow):

- ``mlflow/server/js/src/experiment-tracking/components/experiment-page/models/ExperimentPageUIState.tsx``:
  the fields a saved view's state may hold (``selectedColumns``, ``columnOrder``, ``columnWidths``,
  ``compareRunCharts``, ``compareRunSections``, ``isAccordionReordered``);
- ``.../experiment-page/hooks/useSharedExperimentViewState.ts`` and ``.../utils/savedViewEnvelope.ts``: the
  view a link's ``viewStateShareKey`` opens, from the experiment tag ``mlflow.sharedViewState.<id>``;
- ``.../runs-charts/runs-charts.types.ts``: the chart cards (LINE, BAR, DIFFERENCE) and their fields; a
  metric with more than one point is drawn as a line, one with a single value as a bar;
- ``mlflow/store/tracking/sqlalchemy_store.py`` (``_log_metrics``): a point sent twice is stored once.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from rloo.tracking.experiment import (
    RESULTS_VIEW_ID,
    VIEW_TAG_PREFIX,
    get_or_create_experiment,
    results_view_state,
)
from rloo.tracking.summary import HEADLINE_METRICS, METRIC_WIN_RATE_GAIN, PARENT_CURVES, REWARD_SOURCE
from rloo.tracking.tags import TAG_PROMOTION
from tests.fixtures.servers import MlflowServer
from tests.tracking.test_run_names import pipeline_run

# What the runs table and a chart legend show of a name before cutting it: "seed=1 lr=5e-4 k=4 ..."
SHOWN = 18
# What a narrow column header or chart title shows of a metric's name: "Result/win_rate" ...
HEADER = 15


@pytest.fixture
def experiment(tracking_env: MlflowServer) -> str:
    return f"compare-{uuid.uuid4().hex[:8]}"


def test_two_runs_that_differ_in_their_seed_read_apart_and_overlay_their_curves(
    experiment: str, tracking_env: MlflowServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """make demo twice, the second with another seed: the same learning rate, k and KL coefficient."""
    client = MlflowClient(tracking_env.uri)
    runs = [pipeline_run(experiment, tmp_path, monkeypatch, learning_rate=5e-4, seed=seed) for seed in (1, 2)]
    parents = [client.get_run(parent_id) for _, parent_id in runs]

    # the setting that tells them apart comes first, in both (the first one was renamed)
    names = [p.info.run_name for p in parents]
    assert names[0].startswith("seed=1 lr=5e-4") and names[1].startswith("seed=2 lr=5e-4"), names
    assert names[0][:SHOWN] != names[1][:SHOWN]

    for parent in parents:
        # every stage run says whose stage it is
        children = client.search_runs(
            [parent.info.experiment_id], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'"
        )
        assert sorted(c.info.run_name for c in children) == [
            f"{parent.info.run_name} · eval",
            f"{parent.info.run_name} · train",
        ]
        # the reward curve, every update, on the row the chart view draws
        for key in PARENT_CURVES:
            history = sorted(client.get_metric_history(parent.info.run_id, key), key=lambda m: m.step)
            assert [m.step for m in history] == [1, 2, 3, 4], key
        scores = [m.value for m in client.get_metric_history(parent.info.run_id, REWARD_SOURCE)]
        assert sorted(scores) == pytest.approx([0.1, 0.2, 0.3, 0.4])
        assert parent.data.metrics[REWARD_SOURCE] == pytest.approx(0.4)  # the last update's
        # the headline results read apart in a narrow header; the gain's earlier name is still written
        assert set(HEADLINE_METRICS) <= set(parent.data.metrics)
        assert parent.data.metrics[METRIC_WIN_RATE_GAIN] == parent.data.metrics[HEADLINE_METRICS[1]]
    assert len({m[:HEADER] for m in HEADLINE_METRICS}) == len(HEADLINE_METRICS)

    # a retried exit handler copies nothing twice
    from rloo.tracking import finish_pipeline_run

    monkeypatch.setenv("KFP_RUN_ID", runs[1][0])
    finish_pipeline_run("FINISHED", experiment=experiment)
    assert len(client.get_metric_history(runs[1][1], REWARD_SOURCE)) == 4

    # a run renamed in the UI keeps its name when a third run is told apart from it
    client.update_run(runs[0][1], name="my baseline")
    third = pipeline_run(experiment, tmp_path, monkeypatch, learning_rate=5e-4, seed=3, kl_coef=0.02)
    assert client.get_run(runs[0][1]).info.run_name == "my baseline"
    assert client.get_run(runs[1][1]).info.run_name.startswith("kl=0.01 seed=2 lr=5e-4")
    assert client.get_run(third[1]).info.run_name.startswith("kl=0.02 seed=3 lr=5e-4")


def test_the_results_view_lays_out_the_comparison(tracking_env: MlflowServer) -> None:
    client = MlflowClient(tracking_env.uri)
    exp_id = get_or_create_experiment(client, f"view-{uuid.uuid4().hex[:8]}")
    envelope = json.loads(client.get_experiment(exp_id).tags[VIEW_TAG_PREFIX + RESULTS_VIEW_ID])
    state = json.loads(envelope["state"])
    assert state == results_view_state()

    # the table: the promotion first, then the headline results, each wide enough for its name
    promotion = f"tags.`{TAG_PROMOTION}`"
    assert state["selectedColumns"][0] == promotion
    assert state["selectedColumns"][1:4] == [f"metrics.`{m}`" for m in HEADLINE_METRICS]
    assert set(state["columnWidths"]) <= set(state["columnOrder"])  # widths apply to ordered columns only
    for m in HEADLINE_METRICS:
        assert state["columnWidths"][f"metrics.`{m}`"] >= 8 * len(m)

    # the chart view: its first section the reward curve and what differs (the promotion is a tag)
    first = state["compareRunSections"][0]["uuid"]
    cards = [c for c in state["compareRunCharts"] if c["metricSectionId"] == first]
    assert [c["type"] for c in cards] == ["LINE", "DIFFERENCE"]
    assert cards[0]["metricKey"] == REWARD_SOURCE and cards[0]["xAxisKey"] == "step"
    assert {"Parameters", "Tags"} <= set(cards[1]["compareGroups"]) and cards[1]["showDifferencesOnly"]
    assert state["isAccordionReordered"]  # the sections stay in this order

    # a view an earlier rloo wrote is brought up to date; one changed in the UI is the user's
    old_state = {
        "selectedColumns": [
            "metrics.`Result/win_rate`",
            "metrics.`Result/win_rate_minus_sft`",
            "metrics.`Result/final_reward`",
            "params.`learning_rate`",
            "params.`rloo_k`",
            "params.`kl_coef`",
        ]
    }
    for state_text, kept in ((json.dumps(old_state), False), (json.dumps({"selectedColumns": []}), True)):
        tag = json.dumps({"name": "RLOO results", "createdAt": 1, "updatedAt": 1, "state": state_text})
        client.set_experiment_tag(exp_id, VIEW_TAG_PREFIX + RESULTS_VIEW_ID, tag)
        get_or_create_experiment(client, client.get_experiment(exp_id).name)
        now = client.get_experiment(exp_id).tags[VIEW_TAG_PREFIX + RESULTS_VIEW_ID]
        assert (now == tag) is kept
