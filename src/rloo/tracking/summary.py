"""What a pipeline's parent run shows of its stages, so that one row per pipeline run in the MLflow UI's table
compares runs: their settings, final metrics and push decision, the headline results (:data:`HEADLINE_METRICS`,
named to sort before every other metric) and the training curves (:data:`PARENT_CURVES`)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from rloo.tracking.descriptions import describe_pipeline_run
from rloo.tracking.tags import (
    EVAL_STAGE,
    TAG_LOCATION_PREFIX,
    TAG_PARENT,
    TAG_PROMOTION,
    TAG_STAGE,
    TRAIN_STAGE,
    filter_value,
    pipeline_ids,
    stage_settings,
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
REWARD_SOURCE = "objective/scores"  # the train run's mean reward of an update's completions
GAIN_SOURCE = "diff_trained_minus_baseline/estimate"  # the eval run's paired difference, trained - SFT
# The training curves a pipeline's parent run gets with every step, so that the chart view, which draws the
# rows of the runs table (parents; their nested runs folded), overlays the runs' curves.
PARENT_CURVES = (REWARD_SOURCE, "objective/kl")


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
    run_ids = pipeline_ids(parent.data.tags)
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
