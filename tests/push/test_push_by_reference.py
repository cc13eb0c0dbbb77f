"""Registration by reference, against the real SeaweedFS (S3) and MLflow servers: the weights published in
object storage are not uploaded through the MLflow server a second time (measured with a counting proxy in
front of the server), the version still loads back, and its logged model is linked to the training run
(what MLflow 3's runs table shows in its "Models" column). A copy that is not in object storage is
uploaded through the server, as before."""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from rloo.demo.tiny import TinySetup, build_causal_lm
from rloo.push import PushConfig, run_push
from rloo.storage import read_manifest
from tests.fixtures.countproxy import CountingProxy
from tests.fixtures.servers import MlflowServer, S3Server
from tests.push.conftest import TRAIN_CONFIG, FakeHfApi, s3_push_config, write_eval

MB = 1_000_000


def _name() -> str:
    return f"rloo-ref-{uuid.uuid4().hex[:8]}"


def _cfg(s3: S3Server, model: Path, ev: Path, out: Path, name: str, **kw: object) -> PushConfig:
    """A push to the test bucket that registers, with no production copy and no Hub."""
    return s3_push_config(s3, model, ev, out, name, production_uri=None, hub_repo_id=None, **kw)


@pytest.fixture(scope="module")
def big_trained_dir(tiny_setup: TinySetup, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 'rloo train' output_dir whose safetensors file is ~26 MB: the tiny model with its
    vocabulary padded to Pythia's 50,304 rows (as real checkpoints pad theirs)."""
    out = tmp_path_factory.mktemp("big") / "rloo-out"
    build_causal_lm(out, tiny_setup.tokenizer, vocab_size=50_304)
    (out / "rloo_config.json").write_text(json.dumps(TRAIN_CONFIG))
    (out / "metrics.jsonl").write_text(json.dumps({"update": 1, "objective/scores": 0.1}) + "\n")
    (out / "training_complete.json").write_text(json.dumps({"updates": 1}))
    assert (out / "model.safetensors").stat().st_size >= 20 * MB
    return out


@pytest.fixture
def proxy(
    push_env: S3Server, mlflow_server: MlflowServer, monkeypatch: pytest.MonkeyPatch
) -> Iterator[CountingProxy]:
    """Every request to the MLflow server (tracking, registry and its artifact proxy) through a counter."""
    p = CountingProxy(mlflow_server.port)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", p.url)
    yield p
    p.close()


def test_registration_does_not_send_the_weights_through_mlflow(
    proxy: CountingProxy,
    push_env: S3Server,
    big_trained_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A 26 MB model: what passes through the MLflow server to register it stays far below the weights'
    size (the version refers to the copy in S3), and the version loads back from there and generates."""
    import mlflow.pyfunc
    import mlflow.transformers

    name = _name()
    ev = write_eval(tmp_path / "ev.json", lo=0.04)
    weights = (big_trained_dir / "model.safetensors").stat().st_size
    with caplog.at_level(logging.INFO, logger="rloo.push"):
        result = run_push(_cfg(push_env, big_trained_dir, ev, tmp_path / "out", name), hub_api=FakeHfApi())
    pushed = proxy.total
    print(f"weights {weights} bytes; through the MLflow server to push and register: {pushed} bytes")
    assert result.decision.promoted and result.mlflow is not None and result.mlflow.registered is not None
    assert pushed < 2 * MB, f"{pushed} bytes went through the MLflow server for a {weights}-byte model"
    storage = f"s3://{push_env.bucket}/push-tests/{name}/versions/{result.run_key}"
    assert result.mlflow.registered.source == storage
    assert "by reference to" in caplog.text and "do not pass through the MLflow server" in caplog.text

    # The MLflow files are next to the weights, outside the copy's manifest (its readers are unaffected).
    s3 = push_env.client()
    key = storage.split("/", 3)[3]
    mlmodel = yaml.safe_load(s3.get_object(Bucket=push_env.bucket, Key=f"{key}/MLmodel")["Body"].read())
    assert mlmodel["flavors"]["transformers"]["model_binary"] == "."
    assert mlmodel["model_id"] == result.mlflow.registered.model_id
    s3.head_object(Bucket=push_env.bucket, Key=f"{key}/components/tokenizer/tokenizer.json")
    listed = read_manifest(storage).by_path
    assert "model.safetensors" in listed and "MLmodel" not in listed
    # nothing of the model in the push run's own artifacts
    assert {a.path for a in MlflowClient().list_artifacts(result.mlflow.run_id)} == {"push_result.json"}

    # Loading reads s3:// directly, with the bucket's credentials and endpoint: a few kB through MLflow.
    monkeypatch.setenv("MLFLOW_S3_ENDPOINT_URL", push_env.endpoint)
    proxy.reset()
    uri = f"models:/{name}/{result.mlflow.registered.version}"
    (tmp_path / "tf").mkdir()
    pipe = mlflow.transformers.load_model(uri, dst_path=str(tmp_path / "tf"))
    loaded = proxy.total
    print(f"through the MLflow server to load it back: {loaded} bytes")
    assert loaded < 1 * MB
    assert pipe.model.config.vocab_size == 50_304
    (generated,) = pipe("hello", max_new_tokens=3, do_sample=False)
    assert generated["generated_text"].startswith("hello")
    (tmp_path / "pyfunc").mkdir()
    model = mlflow.pyfunc.load_model(f"models:/{name}@champion", dst_path=str(tmp_path / "pyfunc"))
    (text,) = model.predict(["hello"], params={"max_new_tokens": 3})
    assert isinstance(text, str) and text


def test_logged_model_is_an_output_of_the_training_run(
    push_env: S3Server, trained_dir: Path, tmp_path: Path
) -> None:
    """In a pipeline run the logged model's source is the training stage's run (found under the same
    parent run), which lists it among its outputs (the runs table's "Models" column), the push run among
    its inputs; the version is created from it. A retried push creates no second logged model."""
    name = _name()
    client = MlflowClient()
    exp_id = client.create_experiment(f"push-{name}")
    parent = client.create_run(exp_id, run_name="pipeline", tags={"rloo.kind": "pipeline"}).info.run_id
    stage_tags = {"mlflow.parentRunId": parent, "rloo.stage": "train"}
    failed = client.create_run(exp_id, run_name="train", tags=stage_tags).info.run_id
    client.set_terminated(failed, "FAILED")
    train = client.create_run(exp_id, run_name="train", tags=stage_tags).info.run_id
    client.set_terminated(train, "FINISHED")
    ev = write_eval(tmp_path / "ev.json", lo=0.04)
    cfg = _cfg(
        push_env, trained_dir, ev, tmp_path / "out", name, run_id="lineage", mlflow_parent_run_id=parent
    )

    result = run_push(cfg, hub_api=FakeHfApi()).to_dict()
    model_id = result["mlflow"]["model_id"]
    model = client.get_logged_model(model_id)
    assert model.source_run_id == train and model.experiment_id == exp_id
    assert model.status.to_int() == model.status.READY.to_int()
    assert model.tags["rloo.source_run"] == "lineage" and model.tags["mlflow.model.isExternal"] == "true"
    assert model.tags["rloo.model_uri"] == result["storage"]["uri"] == result["mlflow"]["source"]
    assert json.loads(model.tags["mlflow.modelVersions"]) == [{"name": name, "version": 1}]
    # what the runs table reads (searched runs' outputs and inputs, then the logged models they name)
    rows = {r.info.run_id: r for r in client.search_runs([exp_id])}
    assert [o.model_id for o in rows[train].outputs.model_outputs] == [model_id]
    assert not rows[failed].outputs.model_outputs and not rows[parent].outputs.model_outputs
    push = client.get_run(result["mlflow"]["run_id"])
    assert [i.model_id for i in push.inputs.model_inputs] == [model_id]
    (found,) = client.search_logged_models([exp_id])
    assert found.model_id == model_id
    # the external model's own artifacts: a stub MLmodel that says where the model is, and the card
    from mlflow.artifacts import download_artifacts

    local = Path(download_artifacts(artifact_uri=model.artifact_location, dst_path=str(tmp_path / "lm")))
    assert sorted(p.name for p in local.iterdir()) == ["MLmodel", "README.md"]
    assert (
        yaml.safe_load((local / "MLmodel").read_text())["metadata"]["rloo.model_uri"]
        == result["storage"]["uri"]
    )

    again = run_push(cfg, hub_api=FakeHfApi()).to_dict()
    assert again["mlflow"]["reused"] is True and again["mlflow"]["version"] == "1"
    assert again["mlflow"]["model_id"] == model_id, again["mlflow"]
    assert len(client.search_logged_models([exp_id])) == 1
    assert len(client.get_run(train).outputs.model_outputs) == 1
    assert len(client.search_model_versions(f"name = '{name}'")) == 1


def test_retry_after_the_logged_model_reuses_it(
    push_env: S3Server, trained_dir: Path, tmp_path: Path
) -> None:
    """A push that dies after creating the logged model and before the version: the retry finds the logged
    model again (by its tags) and creates the version from it; --mlflow_train_run_id names the source."""

    class DiesBeforeTheVersion(MlflowClient):
        def create_model_version(self, *a: object, **kw: object) -> object:
            raise RuntimeError("killed")

    name = _name()
    client = MlflowClient()
    exp_id = client.create_experiment(f"push-{name}")
    train = client.create_run(exp_id, run_name="train").info.run_id
    ev = write_eval(tmp_path / "ev.json", lo=0.04)
    cfg = _cfg(push_env, trained_dir, ev, tmp_path / "out", name, run_id="retry", mlflow_train_run_id=train)
    with pytest.raises(RuntimeError, match="killed"):
        run_push(cfg, hub_api=FakeHfApi(), mlflow_client=DiesBeforeTheVersion())
    (first,) = client.search_logged_models([exp_id])
    assert first.source_run_id == train

    result = run_push(cfg, hub_api=FakeHfApi()).to_dict()
    assert result["mlflow"]["model_id"] == first.model_id and result["mlflow"]["version"] == "1"
    assert len(client.search_logged_models([exp_id])) == 1
    assert [o.model_id for o in client.get_run(train).outputs.model_outputs] == [first.model_id]


def test_a_local_copy_is_uploaded_through_mlflow_and_loads(
    push_env: S3Server, trained_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """No copy in object storage (a local --storage_uri, as in make demo): the model is uploaded through the
    server as the logged model's artifacts, which the version's source names; a log line says so; it loads
    without S3 access, and a challenger is compared with it (its eval_results.json read from MLflow)."""
    import mlflow.transformers

    name = _name()
    ev = write_eval(tmp_path / "ev.json", lo=0.04, scores=[0.5] * 20)
    local_store = tmp_path / "store"
    cfg = PushConfig(
        model_path=str(trained_dir),
        eval_results=str(ev),
        output_dir=str(tmp_path / "out"),
        storage_uri=str(local_store),
        registered_model_name=name,
        mlflow_experiment=f"push-{name}",
        run_id="local",
    )
    with caplog.at_level(logging.INFO, logger="rloo.push"):
        result = run_push(cfg).to_dict()
    assert "by uploading the model" in caplog.text and "not in object storage" in caplog.text
    client = MlflowClient()
    model = client.get_logged_model(result["mlflow"]["model_id"])
    assert (
        result["mlflow"]["source"] == model.artifact_location and "mlflow.model.isExternal" not in model.tags
    )
    exp_id = client.get_experiment_by_name(f"push-{name}").experiment_id
    assert [o.model_id for o in client.get_run(result["mlflow"]["run_id"]).outputs.model_outputs] == [
        model.model_id
    ]
    (tmp_path / "tf").mkdir()
    pipe = mlflow.transformers.load_model(f"models:/{name}@champion", dst_path=str(tmp_path / "tf"))
    assert type(pipe).__name__ == "TextGenerationPipeline"

    better = write_eval(tmp_path / "better.json", lo=0.04, scores=[1.0] * 20)
    shutil.rmtree(tmp_path / "out")
    challenger = run_push(dataclasses.replace(cfg, eval_results=str(better), run_id="local-2")).to_dict()
    assert challenger["decision"] == "champion"
    assert "against the champion (version 1 of run local)" in challenger["reason"]
    assert len(client.search_logged_models([exp_id])) == 2


def test_demo_store_registers_by_upload_and_loads(
    trained_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """make demo's setting: the embedded sqlite store, artifacts in a local directory, a local copy. The
    version is created from a logged model of the push run, uploaded into the store, and loads back."""
    import mlflow.transformers

    from rloo.tracking.experiment import get_or_create_experiment

    uri = f"sqlite:///{tmp_path / 'mlruns' / 'mlflow.db'}"
    (tmp_path / "mlruns").mkdir()
    for name in ("KFP_RUN_ID", "KFP_RUN_NAME", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_S3_ENDPOINT_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    client = MlflowClient(tracking_uri=uri)
    get_or_create_experiment(client, "rloo", (tmp_path / "mlruns" / "artifacts").as_uri())
    ev = write_eval(tmp_path / "ev.json", lo=0.04)
    result = run_push(
        PushConfig(
            model_path=str(trained_dir),
            eval_results=str(ev),
            output_dir=str(tmp_path / "out"),
            storage_uri=str(tmp_path / "store"),
            mlflow_experiment="rloo",
        )
    ).to_dict()
    model = client.get_logged_model(result["mlflow"]["model_id"])
    assert result["mlflow"]["source"] == model.artifact_location
    assert model.source_run_id == result["mlflow"]["run_id"]
    assert [o.model_id for o in client.get_run(model.source_run_id).outputs.model_outputs] == [model.model_id]
    (tmp_path / "tf").mkdir()
    pipe = mlflow.transformers.load_model("models:/rloo@champion", dst_path=str(tmp_path / "tf"))
    (generated,) = pipe("hello", max_new_tokens=2, do_sample=False)
    assert generated["generated_text"].startswith("hello")
