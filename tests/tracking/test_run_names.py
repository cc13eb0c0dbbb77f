"""What a user comparing two pipeline runs in the MLflow UI sees, against the real tracking server: run names
that say what differs, a description of the settings, params that are settings (locations as tags), and the
headline results where the runs table and the chart view find them first.

Each pipeline run is played as the stages play it: the train stage's sink gets the recorded training config
(the durable locations of the pipeline's per-run copies in it, as on the cluster and in ``make demo``), the
eval stage's sink the recorded evaluation settings (the toy judge on a new port each run), then the exit
handler closes the parent run.
"""

from __future__ import annotations

import json
import random
import uuid
from pathlib import Path
from typing import Any

import pytest
from mlflow.tracking import MlflowClient

from rloo.config import RLOOConfig
from rloo.eval.config import EvalConfig
from rloo.eval.runner import recorded_settings
from rloo.tracking import MlflowSink, finish_pipeline_run, flatten_params
from rloo.tracking.experiment import RESULTS_VIEW_ID, VIEW_TAG_PREFIX
from rloo.tracking.summary import HEADLINE_METRICS
from rloo.tracking.tags import TAG_OUTPUT_DIR
from rloo.training.metrics import MetricsLogger
from tests.fixtures.servers import MlflowServer

TOTAL_PARAMS = 165_632
PATH_LIKE = ("/", "s3://", "file://", "http://", "https://")


def _sink(stage: str, experiment: str) -> MlflowSink:
    return MlflowSink(stage=stage, experiment=experiment, system_metrics_interval=None, retry_initial=0.2)


def pipeline_run(
    experiment: str,
    work: Path,
    monkeypatch: pytest.MonkeyPatch,
    *,
    kfp_name: str | None = None,
    **train: Any,
) -> tuple[str, str]:
    """One pipeline run's train and eval stages and its exit handler; (KFP run id, parent run id)."""
    kfp_id = str(random.randint(10_000_000, 99_999_999))  # as kfp.local makes them
    monkeypatch.setenv("KFP_RUN_ID", kfp_id)
    monkeypatch.setenv(
        "KFP_RUN_NAME", kfp_name or f"rloo-rlhf-2026-11-25-10-15-{random.randint(10, 59)}-563613"
    )
    store, pod, assets = work / "store" / kfp_id, work / "pod" / kfp_id, work / "assets"
    cfg = RLOOConfig(
        model_name_or_path=str(pod / "sft"),
        model_source=str(store / "sft"),
        output_dir=str(pod / "output"),
        publish_uri=str(store / "model"),
        checkpoint_uri=str(store / "checkpoints"),
        dataset_name=str(assets / "prompts"),
        reward_model_path=str(assets / "reward_model"),
        reward_funcs=["rloo.demo.toy:letter_reward"],
        **{"rloo_k": 4, "kl_coef": 0.01, "seed": 0, "per_device_train_batch_size": 32, **train},
    )
    sink = _sink("train", experiment)
    sink.tags[TAG_OUTPUT_DIR] = str(store / "model")
    logger = MetricsLogger(total_updates=4, show_progress=False, sinks=[sink], plots=False)
    logger.log_params(
        {**cfg.recorded(), "model/trainable_params": TOTAL_PARAMS, "model/total_params": TOTAL_PARAMS}
    )
    for update in (1, 2, 3, 4):
        logger.log({"update": update, "objective/scores": 0.1 * update, "objective/kl": 0.01})
    logger.open(pod / "output")
    logger.close("FINISHED")

    judge_port = random.randint(20_000, 60_000)  # the toy judge is served anew by each run
    settings = recorded_settings(
        EvalConfig(
            model_name_or_path=str(pod / "model"),
            baseline_model=str(pod / "sft"),
            dataset_name=str(assets / "eval"),
            judge_base_url=f"http://127.0.0.1:{judge_port}/v1",
            judge_model="toy-judge",
            output_dir=str(pod / "eval"),
        ),
        {"trained": str(store / "model"), "baseline": str(store / "sft"), "output": str(store / "eval")},
    )
    ev = _sink("eval", experiment)
    ev.tags[TAG_OUTPUT_DIR] = str(store / "eval")
    ev.open(pod / "eval")
    ev.log_params(flatten_params(settings))
    win_rate = 0.5 + float(train.get("learning_rate", 0)) * 100
    ev.log_metrics(
        {
            "trained/win_rate": win_rate,
            "baseline/win_rate": 0.62,  # the same SFT model and data in every run
            "baseline/num_wins": 20,
            "diff_trained_minus_baseline/estimate": win_rate - 0.62,
        },
        step=0,
    )
    ev.finish("FINISHED")
    parent_id = finish_pipeline_run("FINISHED", experiment=experiment)
    assert parent_id is not None
    return kfp_id, parent_id


@pytest.fixture
def experiment(tracking_env: MlflowServer) -> str:
    return f"names-{uuid.uuid4().hex[:8]}"


def test_two_demo_runs_differ_where_they_were_set_differently(
    experiment: str, tracking_env: MlflowServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """make demo twice, with learning rates 5e-4 and 1e-3."""
    runs = [
        pipeline_run(experiment, tmp_path, monkeypatch, learning_rate=5e-4),
        pipeline_run(experiment, tmp_path, monkeypatch, learning_rate=1e-3),
    ]
    client = MlflowClient(tracking_env.uri)
    parents = [client.get_run(parent_id) for _, parent_id in runs]

    # 1. names: what differs, the model (its size: its source is the run's own copy), the run id
    names = [p.info.run_name for p in parents]
    assert names == [
        f"lr=5e-4 k=4 kl=0.01 seed=0 on 166K-param ({runs[0][0]})",
        f"lr=1e-3 k=4 kl=0.01 seed=0 on 166K-param ({runs[1][0]})",
    ]
    note = parents[0].data.tags["mlflow.note.content"]
    assert "`learning_rate=0.0005`" in note and "`rloo_k=4`" in note and "`kl_coef=0.01`" in note
    assert "166K parameters" in note and "judge `toy-judge`" in note and f"(id `{runs[0][0]}`)" in note
    assert "`reward_model_path" not in note  # it has a line of its own: "Reward: ..."
    assert len(note) < 2000 and note.count("\n") < 10

    # 2. params are settings: "show diff only" between the two shows the learning rate, nothing else
    for parent in parents:
        train = client.get_run(_child(client, parent, "train")).data
        for run in (parent.data, train):
            per_run = {k: v for k, v in run.params.items() if any(i in v for i, _ in runs)}
            assert per_run == {}
            endpoints = {k: v for k, v in run.params.items() if v.startswith(("http://", "https://"))}
            assert endpoints == {}
        assert "learning_rate" in train.params and "rloo_k" in train.params
        assert "dataset_name" in train.params and "reward_model_path" in train.params  # the same every run
        # the locations are tags: the trained model's store copy, the eval run's endpoint
        assert train.tags["rloo.location.output_dir"].endswith("/model")
        assert parent.data.tags["rloo.location.output_dir"] == train.tags["rloo.location.output_dir"]
        assert parent.data.tags["rloo.location.eval.judge_base_url"].startswith("http://127.0.0.1:")
    first, second = (p.data.params for p in parents)
    assert set(first) == set(second)
    assert {k for k in first if first[k] != second[k]} == {"learning_rate"}
    assert not [k for k, v in first.items() if v.startswith(PATH_LIKE) and "assets" not in v]

    # 3. the headline results first: MLflow's UI orders chart sections by code point
    for parent in parents:
        metrics = parent.data.metrics
        assert set(HEADLINE_METRICS) <= set(metrics)
        assert not [m for m in metrics if m.startswith("baseline/")]  # the SFT's, identical: on eval only
        sections = sorted({m.rsplit("/", 1)[0] for m in metrics if "/" in m})
        assert sections[0] == "Result"
    assert parents[0].data.metrics["Result/final_reward"] == pytest.approx((0.2 + 0.3 + 0.4) / 3)
    assert parents[1].data.metrics["Result/win_rate"] == pytest.approx(0.6)
    assert parents[1].data.metrics["Result/win_rate_minus_sft"] == pytest.approx(0.6 - 0.62)

    # ... and a saved view of the experiment shows them as the runs table's columns
    exp = client.get_experiment_by_name(experiment)
    envelope = json.loads(exp.tags[VIEW_TAG_PREFIX + RESULTS_VIEW_ID])
    assert isinstance(envelope["name"], str) and isinstance(envelope["createdAt"], int)
    columns = json.loads(envelope["state"])["selectedColumns"]
    for column in columns:
        kind, name = column.split(".", 1)
        if kind == "tags":
            continue  # the promotion: these runs have no push stage
        assert name.startswith("`") and name.endswith("`")
        found = parents[0].data.metrics if kind == "metrics" else parents[0].data.params
        assert name[1:-1] in found, column
    assert [c for c in columns if c.startswith("metrics.")] == [f"metrics.`{m}`" for m in HEADLINE_METRICS]
    assert "Result/win_rate" in exp.tags["mlflow.note.content"]


def _child(client: MlflowClient, parent: Any, stage: str) -> str:
    (run,) = client.search_runs(
        [parent.info.experiment_id],
        f"tags.`mlflow.parentRunId` = '{parent.info.run_id}' and tags.`rloo.stage` = '{stage}'",
    )
    return str(run.info.run_id)


def test_a_name_the_user_gave_is_kept_and_so_is_their_description(
    experiment: str, tracking_env: MlflowServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    client = MlflowClient(tracking_env.uri)
    # rloo pipeline submit --run_name lr-sweep-a: the KFP run name is the user's
    _, named = pipeline_run(experiment, tmp_path, monkeypatch, kfp_name="lr-sweep-a", learning_rate=5e-4)
    assert client.get_run(named).info.run_name == "lr-sweep-a"
    # extra_train_args="--run_name ...": the training config's name names the pipeline run
    _, configured = pipeline_run(experiment, tmp_path, monkeypatch, run_name="warmup-test")
    assert client.get_run(configured).info.run_name == "warmup-test"
    # a description written in the UI survives the exit handler of a retried pipeline run
    client.set_tag(configured, "mlflow.note.content", "mine")
    client.update_run(configured, name="renamed in the UI")
    finish_pipeline_run("FAILED", experiment=experiment)
    run = client.get_run(configured)
    assert run.data.tags["mlflow.note.content"] == "mine" and run.info.run_name == "renamed in the UI"


def test_a_training_run_outside_a_pipeline_is_named_after_its_settings(
    experiment: str, tracking_env: MlflowServer, tmp_path: Path
) -> None:
    client = MlflowClient(tracking_env.uri)
    cfg = RLOOConfig(
        model_name_or_path="Qwen/Qwen2.5-0.5B-Instruct",
        dataset_name="trl-lib/tldr",
        reward_model_path="my-org/rm",
        output_dir=str(tmp_path / "out"),
        learning_rate=1e-5,
    )
    ids = []
    for name in (None, "mine"):
        sink = MlflowSink(stage="train", experiment=experiment, run_name=name, system_metrics_interval=None)
        sink.open(tmp_path / "out")
        sink.log_params(cfg.recorded())
        sink.log_metrics({"objective/scores": 1.0}, 1)
        sink.finish("FINISHED")
        ids.append(sink.run_id)
    unnamed, named = (client.get_run(i) for i in ids)
    assert unnamed.info.run_name == f"lr=1e-5 on Qwen2.5-0.5B-Instruct ({unnamed.info.run_id[:8]})"
    assert "Model: `Qwen/Qwen2.5-0.5B-Instruct`" in unnamed.data.tags["mlflow.note.content"]
    assert "output_dir" not in unnamed.data.params
    assert unnamed.data.tags["rloo.location.output_dir"] == str(tmp_path / "out")
    assert named.info.run_name == "mine"  # the caller's name
