"""The push stage against the real SeaweedFS (S3) and MLflow servers: registry versions, aliases, tags,
idempotent re-runs, and a failure part-way that leaves nothing promoted."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
import yaml
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from rloo.errors import UserError
from rloo.push import PushConfig, run_push
from rloo.storage import is_complete, read_manifest, upload_dir
from tests.fixtures.servers import S3Server
from tests.push.conftest import FakeHfApi, s3_push_config, write_eval


def _name() -> str:
    return f"rloo-push-{uuid.uuid4().hex[:8]}"


def test_champion_end_to_end_and_idempotent(push_env: S3Server, trained_dir: Path, tmp_path: Path) -> None:
    name = _name()
    ev = write_eval(tmp_path / "eval_results.json", lo=0.04)
    cfg = s3_push_config(push_env, trained_dir, ev, tmp_path / "out", name, run_id="kfp-run-1")
    hub = FakeHfApi()
    result = run_push(cfg, hub_api=hub).to_dict()
    client = MlflowClient()

    assert result["decision"] == "champion"
    assert result["storage"]["uri"] == f"s3://{push_env.bucket}/push-tests/{name}/versions/kfp-run-1"
    assert "model.safetensors" in read_manifest(result["storage"]["uri"]).by_path
    production = read_manifest(result["production"]["uri"]).by_path
    assert production.keys() - read_manifest(result["storage"]["uri"]).by_path.keys() == {"promotion.json"}

    mv = client.get_model_version_by_alias(name, "champion")
    assert mv.version == result["mlflow"]["version"] == "1"
    assert mv.tags["rloo.source_run"] == "kfp-run-1" and mv.tags["rloo.promotion"] == "champion"
    assert "lower bound above the margin" in mv.tags["rloo.promotion_reason"]
    assert result["mlflow"]["aliases"] == ["champion"]
    run = client.get_run(result["mlflow"]["run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.tags["rloo.promotion"] == "champion" and run.data.tags["rloo.stage"] == "push"
    # Registered by reference to the copy in S3: the transformers flavor's MLmodel next to the weights (the
    # checkpoint is the copy's top level), the tokenizer under components/, nothing uploaded to MLflow.
    assert mv.source == result["mlflow"]["source"] == result["storage"]["uri"]
    key = result["storage"]["uri"].split("/", 3)[3]
    s3 = push_env.client()
    mlmodel = yaml.safe_load(s3.get_object(Bucket=push_env.bucket, Key=f"{key}/MLmodel")["Body"].read())
    assert mlmodel["flavors"]["transformers"]["model_binary"] == "."
    assert mlmodel["flavors"]["transformers"]["pipeline_model_type"] == "GPTNeoXForCausalLM"
    s3.head_object(Bucket=push_env.bucket, Key=f"{key}/components/tokenizer/tokenizer.json")
    assert not any(p.startswith("checkpoint-") for p in read_manifest(result["storage"]["uri"]).by_path)
    assert {a.path for a in client.list_artifacts(run.info.run_id)} == {"push_result.json"}
    assert client.get_logged_model(result["mlflow"]["model_id"]).tags["rloo.source_run"] == "kfp-run-1"
    assert [c for c, _ in hub.calls] == ["create_repo", "upload_folder"]
    assert hub.calls[0][1]["private"] is True and "README.md" in hub.files
    assert json.loads((tmp_path / "out" / "push_result.json").read_text())["mlflow"]["version"] == "1"

    # Re-run of the same pipeline run: no new version, no new run, nothing re-uploaded.
    again = run_push(cfg, hub_api=FakeHfApi()).to_dict()
    assert again["mlflow"]["version"] == "1" and again["mlflow"]["reused"] is True
    assert again["mlflow"]["run_id"] == result["mlflow"]["run_id"]
    assert again["storage"]["uploaded"] is False and again["production"]["uploaded"] is False
    assert len(client.search_model_versions(f"name = '{name}'")) == 1
    exp = client.get_experiment_by_name(f"push-{name}")
    assert len(client.search_runs([exp.experiment_id])) == 1
    assert len(client.search_logged_models([exp.experiment_id])) == 1


def test_candidate_gets_alias_and_reason_not_production(
    push_env: S3Server, trained_dir: Path, tmp_path: Path
) -> None:
    name = _name()
    ev = write_eval(tmp_path / "ev.json", lo=0.01)
    hub = FakeHfApi()
    result = run_push(
        s3_push_config(push_env, trained_dir, ev, tmp_path, name, promotion_margin=0.02), hub_api=hub
    ).to_dict()
    client = MlflowClient()
    assert result["decision"] == "candidate" and "not above the margin +0.020" in result["reason"]
    mv = client.get_model_version_by_alias(name, "candidate")
    assert mv.tags["rloo.promotion"] == "candidate" and result["mlflow"]["aliases"] == ["candidate"]
    assert client.get_run(result["mlflow"]["run_id"]).data.tags["rloo.promotion"] == "candidate"
    assert result["production"] is None and result["hub"] is None and hub.calls == []
    assert not is_complete(f"s3://{push_env.bucket}/push-tests/{name}/production")


def test_failure_part_way_promotes_nothing_and_rerun_completes(
    push_env: S3Server, trained_dir: Path, tmp_path: Path
) -> None:
    name = _name()
    ev = write_eval(tmp_path / "ev.json", lo=0.04)
    cfg = s3_push_config(push_env, trained_dir, ev, tmp_path / "out", name, run_id="kfp-run-2")
    with pytest.raises(UserError, match="Hub upload to"):
        run_push(cfg, hub_api=FakeHfApi(fail_upload=True))
    client = MlflowClient()
    (mv,) = client.search_model_versions(f"name = '{name}'")
    # search results do not carry aliases: ask for the version itself
    assert client.get_model_version(name, mv.version).aliases == []
    with pytest.raises(MlflowException, match="alias"):
        client.get_model_version_by_alias(name, "champion")
    assert not is_complete(cfg.production_uri)  # type: ignore[arg-type]
    assert not (tmp_path / "out" / "push_result.json").exists()
    exp = client.get_experiment_by_name(f"push-{name}")
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.status == "FAILED"

    result = run_push(cfg, hub_api=FakeHfApi()).to_dict()
    assert result["mlflow"]["version"] == mv.version and result["mlflow"]["aliases"] == ["champion"]
    assert len(client.search_model_versions(f"name = '{name}'")) == 1
    assert client.get_run(run.info.run_id).info.status == "FINISHED"
    assert is_complete(cfg.production_uri)  # type: ignore[arg-type]


def test_model_and_eval_from_s3(push_env: S3Server, trained_dir: Path, tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    prefix = f"s3://{push_env.bucket}/push-tests/{uuid.uuid4().hex[:8]}"
    upload_dir(trained_dir, f"{prefix}/model", progress=False)
    ev = write_eval(tmp_path / "eval_results.json", lo=0.04, scores=[1.0, 0.5, None])
    push_env.client().upload_file(str(ev), push_env.bucket, f"{prefix.split('/', 3)[3]}/eval_results.json")
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    result = run_push(
        PushConfig(
            model_path=f"{prefix}/model",
            eval_results=f"{prefix}/eval_results.json",
            output_dir=str(tmp_path / "out"),
            storage_uri=str(tmp_path / "store"),
        )
    ).to_dict()
    assert result["decision"] == "champion" and result["mlflow"] is None
    published = read_manifest(result["storage"]["uri"]).by_path
    # checkpoint-5 was uploaded with the model but is not republished
    assert "eval_results.json" in published and not any(p.startswith("checkpoint-") for p in published)
    # the evaluation is published as it was read: a later challenger is compared with this champion on its
    # per-example scores and judge template digest (the parsed results once dropped both)
    stored = Path(result["storage"]["uri"].removeprefix("file:")) / "eval_results.json"
    assert stored.read_bytes() == ev.read_bytes()
    assert json.loads(stored.read_text())["per_example"]["keys"] == ["ex0", "ex1", "ex2"]


def test_mlflow_refusal_is_one_line(push_env: S3Server, trained_dir: Path, tmp_path: Path) -> None:
    """A registry refusal (simulated: create_model_version fails as a 403 would) is a one-line UserError,
    the run ends FAILED and nothing is promoted."""

    class Refusing(MlflowClient):
        def create_model_version(self, *a: object, **kw: object) -> object:
            raise MlflowException(
                "Permission denied for user 'bot'\nmore lines", error_code="PERMISSION_DENIED"
            )

    name = _name()
    ev = write_eval(tmp_path / "ev.json", lo=0.04)
    client = Refusing()
    with pytest.raises(
        UserError, match="MLflow refused the push \\(Permission denied for user 'bot' more lines\\)"
    ):
        run_push(
            s3_push_config(push_env, trained_dir, ev, tmp_path, name),
            hub_api=FakeHfApi(),
            mlflow_client=client,
        )
    exp = client.get_experiment_by_name(f"push-{name}")
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.status == "FAILED"
    assert not is_complete(f"s3://{push_env.bucket}/push-tests/{name}/production")


def test_rerun_with_a_new_decision_moves_the_alias(
    push_env: S3Server, trained_dir: Path, tmp_path: Path
) -> None:
    name = _name()
    ev = write_eval(tmp_path / "ev.json", lo=0.01)
    first = run_push(
        s3_push_config(push_env, trained_dir, ev, tmp_path, name, run_id="r", promotion_margin=0.05),
        hub_api=FakeHfApi(),
    ).to_dict()
    assert first["mlflow"]["aliases"] == ["candidate"]
    second = run_push(
        s3_push_config(push_env, trained_dir, ev, tmp_path, name, run_id="r", promotion_margin=0.0),
        hub_api=FakeHfApi(),
    ).to_dict()
    assert second["decision"] == "champion" and second["mlflow"]["version"] == first["mlflow"]["version"]
    assert second["mlflow"]["aliases"] == ["champion"]
    assert (
        MlflowClient().get_model_version(name, second["mlflow"]["version"]).tags["rloo.promotion"]
        == "champion"
    )
    assert second["storage"]["uploaded"] is True  # the card records the new decision


def test_cli_in_a_pipeline_pod(
    push_env: S3Server, trained_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`rloo push` with KFP identity in the environment: version named by the KFP run, push run nested
    under the pipeline's parent run, decision in push_result.json."""
    from rloo.cli.push_cmd import main

    monkeypatch.setenv("KFP_RUN_ID", "kfp-cli-run")
    monkeypatch.setenv("KFP_RUN_NAME", "nightly")
    name = _name()
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", f"push-{name}")
    ev = write_eval(tmp_path / "ev.json", lo=0.04)
    base = f"s3://{push_env.bucket}/push-tests/{name}"
    rc = main(
        [
            "--model_path", str(trained_dir), "--eval_results", str(ev), "--output_dir", str(tmp_path / "o"),
            "--storage_uri", f"{base}/versions", "--registered_model_name", name,
        ]
    )  # fmt: skip
    assert rc == 0
    result = json.loads((tmp_path / "o" / "push_result.json").read_text())
    assert result["run_key"] == "kfp-cli-run" and is_complete(f"{base}/versions/kfp-cli-run")
    run = MlflowClient().get_run(result["mlflow"]["run_id"])
    assert run.data.tags["kfp.run_id"] == "kfp-cli-run" and run.data.tags["kfp.run_name"] == "nightly"
    parent = MlflowClient().get_run(run.data.tags["mlflow.parentRunId"])
    assert parent.data.tags["rloo.kind"] == "pipeline"


def test_registers_by_default_under_the_experiment_name_with_an_opt_out(
    push_env: S3Server, trained_dir: Path, tmp_path: Path
) -> None:
    """With a tracking server and no --registered_model_name the version goes to a model named after the
    experiment; --register_model false only logs the push run."""
    name = _name()
    ev = write_eval(tmp_path / "ev.json", lo=0.04)
    result = run_push(
        PushConfig(
            model_path=str(trained_dir),
            eval_results=str(ev),
            output_dir=str(tmp_path / "a"),
            mlflow_experiment=name,
            run_id="default-name",
        )
    ).to_dict()
    client = MlflowClient()
    assert result["mlflow"]["registered_model_name"] == name
    assert client.get_model_version_by_alias(name, "champion").version == result["mlflow"]["version"]

    other = _name()
    opted_out = run_push(
        PushConfig(
            model_path=str(trained_dir),
            eval_results=str(ev),
            output_dir=str(tmp_path / "b"),
            mlflow_experiment=other,
            register_model=False,
        )
    ).to_dict()
    assert set(opted_out["mlflow"]) == {"run_id"}
    with pytest.raises(MlflowException):
        client.get_registered_model(other)
    with pytest.raises(UserError, match="--register_model is false"):
        PushConfig(model_path=str(trained_dir), registered_model_name="x", register_model=False)


def test_rerun_that_decides_candidate_gives_champion_back(
    push_env: S3Server, trained_dir: Path, tmp_path: Path
) -> None:
    """Run 'old' is champion, run 'new' takes over; re-judging 'new' with a higher margin makes it candidate:
    'champion' (and the production copy) go back to 'old'. Demoting the last champion removes the alias."""
    name = _name()
    evals = {  # 'new' beats 'old' on every example
        run: write_eval(tmp_path / f"ev-{run}.json", lo=0.01, scores=[score] * 20)
        for run, score in (("old", 0.5), ("new", 1.0))
    }
    client = MlflowClient()

    def push(run: str, margin: float) -> dict:
        return run_push(
            s3_push_config(
                push_env, trained_dir, evals[run], tmp_path / run, name, run_id=run, promotion_margin=margin
            ),
            hub_api=FakeHfApi(),
        ).to_dict()

    old = push("old", 0.0)
    new = push("new", 0.0)
    assert client.get_model_version_by_alias(name, "champion").version == new["mlflow"]["version"]
    assert "against the champion (version 1 of run old) +0.500" in new["reason"]
    # one row claims champion: the version that lost the alias, and its run, say so
    old_mv = client.get_model_version(name, old["mlflow"]["version"])
    assert old_mv.tags["rloo.promotion"] == "superseded"
    assert f"until version {new['mlflow']['version']} (new)" in old_mv.tags["rloo.promotion_reason"]
    assert client.get_run(old["mlflow"]["run_id"]).data.tags["rloo.promotion"] == "superseded"
    demoted = push("new", 0.05)
    assert demoted["decision"] == "candidate" and demoted["mlflow"]["aliases"] == ["candidate"]
    assert demoted["mlflow"]["champion_version"] == old["mlflow"]["version"]
    assert client.get_model_version_by_alias(name, "champion").version == old["mlflow"]["version"]
    assert demoted["production"]["restored_from"] == old["storage"]["uri"]
    prod = read_manifest(demoted["production"]["uri"]).by_path
    assert prod.keys() - read_manifest(old["storage"]["uri"]).by_path.keys() == {"promotion.json"}
    # tags agree with the alias again: 'old' says champion, 'new' candidate
    old_mv = client.get_model_version(name, old["mlflow"]["version"])
    assert old_mv.tags["rloo.promotion"] == "champion" and "demoted" in old_mv.tags["rloo.promotion_reason"]
    assert client.get_run(old["mlflow"]["run_id"]).data.tags["rloo.promotion"] == "champion"
    assert client.get_run(new["mlflow"]["run_id"]).data.tags["rloo.promotion"] == "candidate"

    last = push("old", 0.05)
    assert last["decision"] == "candidate" and last["mlflow"]["champion_version"] is None
    with pytest.raises(MlflowException, match="alias"):
        client.get_model_version_by_alias(name, "champion")
    # nothing is left at production_uri pointing at the model the gate no longer approves
    assert last["production"]["withdrawn"] is True and not is_complete(last["production"]["uri"])


def test_retrying_an_older_run_does_not_take_champion_back(
    push_env: S3Server, trained_dir: Path, tmp_path: Path
) -> None:
    """Seniority is the pipeline (parent) run's start time: a run started earlier that pushes after a newer
    champion is registered as candidate, and push_result.json says why."""
    import time

    name = _name()
    ev = write_eval(tmp_path / "ev.json", lo=0.04, scores=[0.5] * 20)
    ev_early = write_eval(tmp_path / "ev-early.json", lo=0.04, scores=[1.0] * 20)  # better, but older
    client = MlflowClient()
    exp_id = client.create_experiment(f"push-{name}")
    now = int(time.time() * 1000)
    early = client.create_run(exp_id, start_time=now - 3_600_000, run_name="early").info.run_id
    late = client.create_run(exp_id, start_time=now, run_name="late").info.run_id

    newer = run_push(
        s3_push_config(
            push_env, trained_dir, ev, tmp_path / "late", name, run_id="late", mlflow_parent_run_id=late
        ),
        hub_api=FakeHfApi(),
    ).to_dict()
    assert newer["decision"] == "champion"
    hub = FakeHfApi()
    older = run_push(
        s3_push_config(
            push_env,
            trained_dir,
            ev_early,
            tmp_path / "early",
            name,
            run_id="early",
            mlflow_parent_run_id=early,
        ),
        hub_api=hub,
    ).to_dict()
    assert older["decision"] == "candidate" and older["promoted"] is False
    assert "lower bounds above the margin" in older["reason"] and "newer run" in older["reason"]
    assert f"version {newer['mlflow']['version']} of late" in older["reason"]
    assert older["mlflow"]["aliases"] == ["candidate"] and older["production"] is None and hub.calls == []
    assert client.get_model_version_by_alias(name, "champion").version == newer["mlflow"]["version"]
    on_disk = json.loads((tmp_path / "early" / "push_result.json").read_text())
    assert on_disk["decision"] == "candidate" and "newer run" in on_disk["reason"]
    mv = client.get_model_version(name, older["mlflow"]["version"])
    assert mv.tags["rloo.promotion"] == "candidate" and int(mv.tags["rloo.run_started_ms"]) == now - 3_600_000


def test_registered_version_loads_back(
    push_env: S3Server, trained_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hand-written MLmodel is a real transformers flavor: the registered champion loads through the
    registry (models:/name@champion) with mlflow.transformers and mlflow.pyfunc, and generates. Registered
    by reference, it is read from S3 with the bucket's credentials and MLflow's endpoint variable."""
    import mlflow.pyfunc
    import mlflow.transformers

    name = _name()
    ev = write_eval(tmp_path / "ev.json", lo=0.04)
    run_push(s3_push_config(push_env, trained_dir, ev, tmp_path / "out", name), hub_api=FakeHfApi())
    monkeypatch.setenv("MLFLOW_S3_ENDPOINT_URL", push_env.endpoint)
    uri = f"models:/{name}@champion"
    for d in ("tf", "pyfunc"):
        (tmp_path / d).mkdir()
    pipe = mlflow.transformers.load_model(uri, dst_path=str(tmp_path / "tf"))
    assert type(pipe).__name__ == "TextGenerationPipeline"
    assert pipe.model.config.architectures == ["GPTNeoXForCausalLM"]
    (generated,) = pipe("hello", max_new_tokens=3, do_sample=False)
    assert generated["generated_text"].startswith("hello")
    model = mlflow.pyfunc.load_model(uri, dst_path=str(tmp_path / "pyfunc"))
    (text,) = model.predict(["hello"], params={"max_new_tokens": 3})
    assert isinstance(text, str) and text
