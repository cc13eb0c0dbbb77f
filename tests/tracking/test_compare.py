"""What a user comparing runs in the MLflow UI looks for: two real training runs, queried back through
MlflowClient, with the documented metrics (per update), system metrics, sample tables and curves."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from rloo.config import RLOOConfig
from rloo.demo.tiny import TinySetup
from rloo.training.trainer import train
from tests.fixtures.servers import SECRET_KEY, MlflowServer, free_port

pytestmark = pytest.mark.slow

# The metric names the README documents (the classic set, the current set, phases and throughput).
DOCUMENTED = [
    "objective/kl",
    "objective/entropy",
    "objective/non_score_reward",
    "objective/rlhf_reward",
    "objective/scores",
    "policy/approxkl_avg",
    "policy/clipfrac_avg",
    "loss/policy_avg",
    "policy/entropy_avg",
    "val/ratio",
    "val/ratio_var",
    "val/num_eos_tokens",
    "val/clipfrac_avg",
    "lr",
    "episode",
    "eps",
    "num_tokens",
    "completions/mean_length",
    "rewards/letter_reward/mean",
    "rewards/letter_reward/std",
    "reward",
    "reward_std",
    "frac_reward_zero_std",
    "entropy",
    "kl",
    "clip_ratio/region_mean",
    "time/generation_s",
    "time/optimization_s",
    "throughput/generated_tokens_per_s",
]


def test_two_training_runs_can_be_compared(
    tracking_env: MlflowServer,
    monkeypatch: pytest.MonkeyPatch,
    tiny_setup: TinySetup,
    toy_dataset: Path,
    tmp_path: Path,
) -> None:
    experiment = f"compare-{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", experiment)
    monkeypatch.setenv("KFP_RUN_ID", f"kfp-{uuid.uuid4()}")
    monkeypatch.setenv("KFP_RUN_NAME", "sweep")
    for name, lr in (("a", 5e-3), ("b", 1e-2)):
        cfg = RLOOConfig(
            model_name_or_path=str(tiny_setup.policy),
            reward_funcs=["rloo.demo.toy:letter_reward"],
            dataset_name=str(toy_dataset),
            output_dir=str(tmp_path / name),
            per_device_train_batch_size=8,
            rloo_k=4,
            num_ppo_epochs=1,
            response_length=6,
            learning_rate=lr,
            max_steps=3,
            num_sample_generations=2,
            save_steps=0,
            disable_tqdm=True,
            seed=7,
        )
        # The trainer is not told about MLflow: its logger's default sinks follow MLFLOW_TRACKING_URI.
        train(cfg)

    client = MlflowClient(tracking_env.uri)
    exp = client.get_experiment_by_name(experiment)
    runs = client.search_runs([exp.experiment_id], "tags.`rloo.stage` = 'train'")
    assert len(runs) == 2
    parents = {r.data.tags["mlflow.parentRunId"] for r in runs}
    assert len(parents) == 1 and client.get_run(parents.pop()).data.tags["kfp.run_name"] == "sweep"
    for run in runs:
        assert run.info.status == "FINISHED"
        missing = [m for m in DOCUMENTED if m not in run.data.metrics]
        assert not missing, missing
        assert [m.step for m in client.get_metric_history(run.info.run_id, "objective/scores")] == [1, 2, 3]
        assert any(k.startswith("system/cpu_utilization") for k in run.data.metrics)
        artifacts = {a.path for d in ("samples", "plots") for a in client.list_artifacts(run.info.run_id, d)}
        assert "plots/training_curves.png" in artifacts
        assert {p.rsplit(".", 1)[1] for p in artifacts if p.startswith("samples/")} == {"html", "json"}
    lrs = sorted(client.get_metric_history(r.info.run_id, "lr")[0].value for r in runs)
    assert lrs == [5e-3, 1e-2]  # the runs differ where they were set up to differ
    # the full config as params: what the UI's comparison table lines up
    params = [r.data.params for r in runs]
    assert sorted(float(p["learning_rate"]) for p in params) == [5e-3, 1e-2]
    assert all(p["rloo_k"] == "4" and p["kl_coef"] == "0.05" and p["seed"] == "7" for p in params)


def test_rloo_train_with_mlflow_unreachable_fails_in_one_line(
    tiny_setup: TinySetup, toy_dataset: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    # credentials as they must be given (never in the URI, which is refused): they still never show up
    dead = f"http://127.0.0.1:{free_port()}"
    argv = ["train", "--disable_tqdm", "--model_name_or_path", str(tiny_setup.policy)]
    argv += ["--reward_funcs", "rloo.demo.toy:letter_reward", "--dataset_name", str(toy_dataset)]
    argv += [
        "--output_dir",
        str(out),
        "--per_device_train_batch_size",
        "8",
        "--rloo_k",
        "4",
        "--max_steps",
        "1",
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "rloo.cli", *argv],
        env={
            **os.environ,
            "MLFLOW_TRACKING_URI": dead,
            "MLFLOW_TRACKING_USERNAME": "admin",
            "MLFLOW_TRACKING_PASSWORD": SECRET_KEY,
        },
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 75  # unreachable is temporary (EX_TEMPFAIL), not bad input
    (line,) = proc.stderr.strip().splitlines()
    assert "unreachable" in line and "MLFLOW_TRACKING_URI" in line and "127.0.0.1" in line
    assert SECRET_KEY not in proc.stderr + proc.stdout
    assert (
        "RLOO:" not in proc.stdout
    )  # the run plan is logged once models and data are loaded: never got there
    assert not out.exists()
