"""Every stage run records the dataset it read as an MLflow dataset input (the runs table's Dataset column):
name, digest, source and the context tag, against the real MLflow server (and SeaweedFS for s3:// data)."""

from __future__ import annotations

import json
import tempfile
import uuid
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from rloo.config import RLOOConfig
from rloo.data import dataset_record
from rloo.demo.tiny import TinySetup
from rloo.storage import upload_dir
from rloo.tracking import MlflowSink
from tests.fixtures.servers import MlflowServer, use_s3


def _only_input(client: MlflowClient, run_id: str) -> tuple[object, dict[str, str]]:
    (dataset_input,) = client.get_run(run_id).inputs.dataset_inputs
    return dataset_input.dataset, {t.key: t.value for t in dataset_input.tags}


def test_train_run_records_its_s3_dataset(
    tracking_env: MlflowServer,
    tiny_setup: TinySetup,
    toy_dataset: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from rloo.training.trainer import train

    server = use_s3(tracking_env.s3, monkeypatch)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # a private s3:// dataset cache
    experiment = f"test-{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", experiment)
    uri = f"s3://{server.bucket}/datasets-{uuid.uuid4().hex[:8]}/toy"
    upload_dir(toy_dataset, uri, progress=False)
    cfg = RLOOConfig(
        model_name_or_path=str(tiny_setup.policy),
        reward_funcs=["rloo.demo.toy:letter_reward"],
        dataset_name=uri,
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=16,
        rloo_k=4,
        num_ppo_epochs=1,
        response_length=4,
        max_steps=1,
        num_sample_generations=0,
        save_steps=0,
        disable_tqdm=True,
        report_to="mlflow",
    )
    train(cfg)
    client = MlflowClient(tracking_env.uri)
    exp = client.get_experiment_by_name(experiment)
    (run,) = client.search_runs([exp.experiment_id])
    dataset, tags = _only_input(client, run.info.run_id)
    record = dataset_record(uri, "train")
    assert record.digest is not None and record.digest.startswith("sha256:")
    assert dataset.name == "toy:train" and dataset.digest == record.digest.removeprefix("sha256:")[:12]
    assert dataset.source_type == "s3" and json.loads(dataset.source) == {"uri": uri}
    profile = json.loads(dataset.profile)
    assert profile == {
        "split": "train",
        "num_rows": 16,
        "digest": record.digest,
        "files": [f.to_dict() for f in record.files],
    }
    # the upload's files as its manifest lists them, with the keys and ETags the store holds them under
    (only,) = profile["files"]
    head = server.client().head_object(Bucket=server.bucket, Key=only["key"])
    assert only["path"] == "data/train-00000-of-00001.parquet" and only["etag"] == head["ETag"].strip('"')
    assert only["size"] == head["ContentLength"]
    assert tags == {"mlflow.data.context": "training"}
    # beside the model, for its card: the record as the trainer read it, whatever the config says later
    from rloo.data import TRAINING_DATASET_FILE, DatasetRecord
    from rloo.push.staging import _training_dataset

    assert DatasetRecord.from_json((tmp_path / "out" / TRAINING_DATASET_FILE).read_text()) == record
    assert _training_dataset({"dataset_name": "elsewhere"}, tmp_path / "out") == record.describe()


def test_hub_and_local_datasets_are_recorded_too(tracking_env: MlflowServer, tmp_path: Path) -> None:
    """A Hub dataset by its id (hugging_face source: id, config, split, commit), a local one by its
    directory; each stage's split parameter gives the context."""
    client = MlflowClient(tracking_env.uri)
    local = tmp_path / "prompts"
    (local / "data").mkdir(parents=True)
    (local / "data" / "test.jsonl").write_text('{"prompt": "p", "completion": "c"}\n')
    for params, context in (
        (
            {"dataset_name": "trl-lib/tldr", "dataset_config": None, "dataset_train_split": "train"},
            "training",
        ),
        ({"dataset_name": str(local), "dataset_config": None, "dataset_split": "test"}, "evaluation"),
    ):
        sink = MlflowSink(experiment=f"test-{uuid.uuid4().hex[:8]}", system_metrics_interval=None)
        sink.open(tmp_path / "run")
        sink.log_params({"learning_rate": 1e-5, **params})
        sink.log_params(params)  # a resumed stage logs its params again: still one dataset input
        sink.finish()
        dataset, tags = _only_input(client, sink.run_id)  # type: ignore[arg-type]
        assert tags == {"mlflow.data.context": context}
        if context == "training":
            assert (dataset.name, dataset.source_type) == ("trl-lib/tldr:train", "hugging_face")
            source = json.loads(dataset.source)
            assert (source["path"], source["split"], source["revision"]) == ("trl-lib/tldr", "train", None)
            assert len(dataset.digest) == 12  # the Hub commit is unknown offline: name and split decide it
        else:
            record = dataset_record(str(local), "test")
            assert (dataset.name, dataset.source_type) == ("prompts:test", "local")
            assert json.loads(dataset.source) == {"uri": local.resolve().as_uri()}
            assert record.digest is not None and dataset.digest == record.digest[len("sha256:") :][:12]


def test_an_s3_dataset_copied_without_rloo_is_recorded_file_by_file(
    tracking_env: MlflowServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A dataset a data team copied up with plain boto3 (`aws s3 cp`: no _MANIFEST.json) is the run's dataset
    input all the same: source s3 (mlflow/data/artifact_dataset_sources.py's {"uri": ...}), the profile
    listing each file read with its key, size, ETag (ListObjectsV2's entity tag, AWS S3 API reference) and
    SHA-256. Its split is the datasets library's (huggingface/datasets src/datasets/data_files.py: a
    keyword in the file name)."""
    import hashlib

    server = use_s3(tracking_env.s3, monkeypatch)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    prefix = f"copied-{uuid.uuid4().hex[:8]}"
    body = b'{"prompt": "p", "completion": "c"}\n'
    etag = server.client().put_object(Bucket=server.bucket, Key=f"{prefix}/eval.jsonl", Body=body)["ETag"]
    uri = f"s3://{server.bucket}/{prefix}"
    sink = MlflowSink(experiment=f"test-{uuid.uuid4().hex[:8]}", system_metrics_interval=None)
    sink.open(tmp_path / "run")
    sink.log_params({"dataset_name": uri, "dataset_config": None, "dataset_split": "test"})
    sink.finish()
    dataset, tags = _only_input(MlflowClient(tracking_env.uri), sink.run_id)  # type: ignore[arg-type]
    assert tags == {"mlflow.data.context": "evaluation"}
    assert (dataset.name, dataset.source_type, json.loads(dataset.source)) == (
        f"{prefix}:test",
        "s3",
        {"uri": uri},
    )
    (read,) = json.loads(dataset.profile)["files"]
    assert read == {
        "path": "eval.jsonl",
        "key": f"{prefix}/eval.jsonl",
        "size": len(body),
        "etag": etag.strip('"'),
        "sha256": hashlib.sha256(body).hexdigest(),
    }
