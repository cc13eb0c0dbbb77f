"""Fixtures for the push tests: a finished 'rloo train' output_dir built from the tiny model, an
eval_results.json, and the real SeaweedFS / MLflow servers shared with tests/storage and tests/tracking."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from rloo.demo.tiny import TinySetup
from rloo.push import PushConfig
from tests.fixtures.servers import MlflowServer, S3Server, use_s3

TRAIN_CONFIG = {
    "model_name_or_path": "EleutherAI/pythia-14m-sft",
    "sft_model_path": None,
    "dataset_name": "trl-internal-testing/descriptiveness-sentiment-trl-style",
    "rloo_k": 2,
    "learning_rate": 3e-6,
    "kl_coef": 0.05,
    "seed": 42,
}


def eval_results(
    lo: float = 0.04, *, estimate: float = 0.11, hi: float = 0.18, scores: list[float | None] | None = None
) -> dict[str, Any]:
    """An eval_results.json; ``scores``: the trained model's per-example scores (examples ``ex0``, ``ex1``..)
    that a challenger is compared with the champion by."""
    data: dict[str, Any] = {
        "trained": {"win_rate": 0.61, "ci95": [0.55, 0.67]},
        "baseline": {"win_rate": 0.50, "ci95": [0.44, 0.56]},
        "paired_difference": {"estimate": estimate, "ci95": [lo, hi]},
        "judge": {"model": "judge-model-x", "base_url": "http://judge.local/v1", "template_sha256": "t1"},
        "num_examples": 200,
        "invalid": 3,
        "ties": 12,
    }
    if scores is not None:
        data["per_example"] = {"keys": [f"ex{i}" for i in range(len(scores))], "trained": scores}
    return data


def s3_push_config(
    s3: S3Server, trained: Path | str, ev: Path, out: Path, name: str, **kw: Any
) -> PushConfig:
    """A push of ``trained`` to the test bucket under ``push-tests/<name>``: storage and production there, the
    registry and the Hub named ``name`` (``kw`` replaces any field, e.g. ``production_uri=""``)."""
    base = f"s3://{s3.bucket}/push-tests/{name}"
    fields: dict[str, Any] = dict(
        model_path=str(trained),
        eval_results=str(ev),
        output_dir=str(out),
        storage_uri=f"{base}/versions",
        production_uri=f"{base}/production",
        registered_model_name=name,
        hub_repo_id=f"org/{name}",
        mlflow_experiment=f"push-{name}",
    )
    return PushConfig(**{**fields, **kw})


def write_eval(path: Path, **kw: Any) -> Path:
    path.write_text(json.dumps(eval_results(**kw)))
    return path


@pytest.fixture(scope="session")
def trained_dir(tiny_setup: TinySetup, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What 'rloo train' leaves in output_dir, with a checkpoint and samples that must not be published."""
    out = tmp_path_factory.mktemp("trained") / "rloo-out"
    shutil.copytree(tiny_setup.policy, out)
    (out / "rloo_config.json").write_text(json.dumps(TRAIN_CONFIG))
    rows = [
        {
            "update": i,
            "objective/scores": 0.1 * i,
            "objective/kl": 0.01 * i,
            "objective/rlhf_reward": 0.09 * i,
        }
        for i in range(1, 6)
    ]
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (out / "training_complete.json").write_text(json.dumps({"updates": 5}))
    (out / "checkpoint-5").mkdir()
    (out / "checkpoint-5" / "optimizer.pt").write_bytes(b"x" * 64)
    (out / "samples").mkdir()
    (out / "samples" / "update-5.jsonl").write_text("{}\n")
    return out


@pytest.fixture
def push_env(s3_server: S3Server, mlflow_server: MlflowServer, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    """A push pod's environment: S3 and MLflow test servers, a Hub token, no KFP run."""
    use_s3(s3_server, monkeypatch)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server.uri)
    monkeypatch.setenv("HF_TOKEN", "hf_test_token_abcdef123")
    for name in ("KFP_RUN_ID", "KFP_RUN_NAME", "RLOO_REPORT_TO", "MLFLOW_EXPERIMENT_NAME"):
        monkeypatch.delenv(name, raising=False)
    return s3_server


class FakeHfApi:
    """Records the calls the Hub adapter makes; ``fail_upload`` makes upload_folder raise like a 5xx."""

    def __init__(self, fail_upload: bool = False) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.fail_upload = fail_upload
        self.files: list[str] = []

    def create_repo(self, **kw: Any) -> Any:
        self.calls.append(("create_repo", kw))
        return f"https://huggingface.co/{kw['repo_id']}"

    def upload_folder(self, **kw: Any) -> Any:
        self.calls.append(("upload_folder", kw))
        if self.fail_upload:
            raise RuntimeError(f"500 Server Error for url https://huggingface.co/api (token {kw['token']})")
        self.files = sorted(p.name for p in Path(kw["folder_path"]).iterdir())

        class Commit:
            oid = "c0ffee"

        return Commit()
