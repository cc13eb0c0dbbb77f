"""The experiment's kind, the parent run's summary row, and ``rloo ui``'s store and port checks, on real
sqlite stores (no server needed)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from rloo.errors import UserError


def _client(tmp_path: Path):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")


def test_experiments_are_model_training_experiments(tmp_path: Path) -> None:
    from rloo.tracking.experiment import get_or_create_experiment

    client = _client(tmp_path)
    new = get_or_create_experiment(client, "made-here")
    assert client.get_experiment(new).tags["mlflow.experimentKind"] == "custom_model_development"
    # made elsewhere without a kind: gets one; with a kind someone chose: kept
    bare = client.create_experiment("bare")
    chosen = client.create_experiment("chosen", tags={"mlflow.experimentKind": "genai_development"})
    assert get_or_create_experiment(client, "bare") == bare
    assert client.get_experiment(bare).tags["mlflow.experimentKind"] == "custom_model_development"
    get_or_create_experiment(client, "chosen")
    assert client.get_experiment(chosen).tags["mlflow.experimentKind"] == "genai_development"


def test_experiments_have_the_results_view_and_ui_links_open_it(tmp_path: Path) -> None:
    import json

    from rloo.tracking.experiment import get_or_create_experiment
    from rloo.tracking.ui import experiment_urls

    client = _client(tmp_path)
    ours = get_or_create_experiment(client, "ours")
    view = json.loads(client.get_experiment(ours).tags["mlflow.sharedViewState.rloo-results"])
    assert view["name"] == "RLOO results"
    assert json.loads(view["state"])["selectedColumns"][:4] == [
        "tags.`rloo.promotion`",
        "metrics.`Result/win_rate`",
        "metrics.`Result/gain_vs_sft`",
        "metrics.`Result/final_reward`",
    ]
    # a view someone changed in the UI is theirs; an experiment made elsewhere gets it when rloo uses it
    client.set_experiment_tag(ours, "mlflow.sharedViewState.rloo-results", "changed")
    get_or_create_experiment(client, "ours")
    assert client.get_experiment(ours).tags["mlflow.sharedViewState.rloo-results"] == "changed"
    bare = client.create_experiment("bare")
    urls = experiment_urls(f"sqlite:///{tmp_path / 'mlflow.db'}", "http://ui")
    assert urls == [
        f"http://ui/#/experiments/{ours}/runs?workflowType=machine_learning&compareRunsMode=CHART&viewStateShareKey=rloo-results  (ours)",
        f"http://ui/#/experiments/{bare}/runs?workflowType=machine_learning  (bare)",
    ]
    get_or_create_experiment(client, "bare")
    assert "mlflow.sharedViewState.rloo-results" in client.get_experiment(bare).tags


def test_closing_a_pipeline_run_copies_its_stages_results(tmp_path: Path) -> None:
    from rloo.tracking.lifecycle import finish_pipeline_run, start_stage_run

    client = _client(tmp_path)
    train = start_stage_run("train", experiment="e", client=client, pipeline_run_id="p1")
    client.log_param(train.run_id, "learning_rate", "3e-06")
    client.set_tag(train.run_id, "rloo.location.output_dir", "/store/p1/model")
    client.log_metric(train.run_id, "objective/scores", 0.2, step=1)
    client.log_metric(train.run_id, "objective/scores", 0.7, step=2)  # the last value is the one copied
    client.log_metric(train.run_id, "system/cpu_utilization_percentage", 50.0)
    ev = start_stage_run("eval", experiment="e", client=client, pipeline_run_id="p1")
    client.log_param(ev.run_id, "judge_model", "judge")
    client.log_param(ev.run_id, "learning_rate", "x")  # a clash with train's: kept apart by its prefix
    client.log_param(ev.run_id, "output_dir", "/store/p1/eval")  # an older rloo's: a location, not a param
    client.log_metric(ev.run_id, "trained/win_rate", 0.6)
    client.log_metric(ev.run_id, "baseline/win_rate", 0.4)  # the SFT model's: stays on the eval run
    client.log_metric(ev.run_id, "diff_trained_minus_baseline/estimate", 0.2)
    push = start_stage_run("push", experiment="e", client=client, pipeline_run_id="p1")
    client.set_tag(push.run_id, "rloo.promotion", "candidate")

    parent_id = finish_pipeline_run(pipeline_run_id="p1", experiment="e", client=client)
    assert parent_id == train.parent_run_id
    parent = client.get_run(parent_id)
    assert parent.info.status == "FINISHED"
    assert parent.data.params == {
        "learning_rate": "3e-06",
        "eval.judge_model": "judge",
        "eval.learning_rate": "x",
    }
    assert parent.data.tags["rloo.location.output_dir"] == "/store/p1/model"
    assert parent.data.tags["rloo.location.eval.output_dir"] == "/store/p1/eval"
    assert parent.data.metrics == {
        "objective/scores": 0.7,
        "trained/win_rate": 0.6,
        "diff_trained_minus_baseline/estimate": 0.2,
        # the headline: first in the UI's sort, the final reward a mean of the last updates
        "Result/win_rate": 0.6,
        "Result/gain_vs_sft": 0.2,
        "Result/win_rate_minus_sft": 0.2,  # its earlier name
        "Result/final_reward": pytest.approx(0.45),
    }
    assert parent.data.tags["rloo.promotion"] == "candidate"
    # named (the settings are the defaults) and described, the KFP run included
    assert parent.info.run_name == "defaults (p1)"
    assert "`judge`" in parent.data.tags["mlflow.note.content"]
    # a retried exit handler: params are immutable in MLflow, the copy must not fail on them
    assert finish_pipeline_run(pipeline_run_id="p1", experiment="e", client=client) == parent_id


def test_ui_store_is_the_work_directorys_or_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rloo.tracking.ui import store_uri

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with pytest.raises(UserError, match=r"no MLflow store at .*mlruns/mlflow.db: run 'make demo'"):
        store_uri(tmp_path, None)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://user:s3cret@mlflow.example:5000")
    with pytest.raises(UserError, match="names a tracking server, open") as err:
        store_uri(tmp_path, None)
    assert "s3cret" not in str(err.value)
    (tmp_path / "mlruns").mkdir()
    (tmp_path / "mlruns" / "mlflow.db").touch()
    assert store_uri(tmp_path, None) == f"sqlite:///{tmp_path.resolve() / 'mlruns' / 'mlflow.db'}"
    assert store_uri(None, "sqlite:///elsewhere.db") == "sqlite:///elsewhere.db"


def test_ui_refuses_a_port_in_use(tmp_path: Path) -> None:
    from rloo.tracking.ui import start_ui

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(UserError, match=f"port {port} on 127.0.0.1 is in use .*--port {port + 1}"):
            start_ui(f"sqlite:///{tmp_path / 'x.db'}", port=port, log_dir=tmp_path)
