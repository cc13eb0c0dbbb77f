"""The whole pipeline on this machine, as ``make demo`` runs it (``rloo pipeline run --local``), at its
smallest: tiny model, toy data, toy judge, sqlite MLflow store under the work directory.

About 40 s of subprocess start-up, CPU training, generation and judging. A failing step is retried with the
pipeline's real backoff, so a regression here shows up as a slow failure rather than a quick one.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.servers import MlflowServer, use_s3

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore:You may be attemping:RuntimeWarning"),
    # display names and GPU requests are cluster settings; kfp.local says it ignores them
    pytest.mark.filterwarnings("ignore:Task .* have no effect in the current local runner:UserWarning"),
]

STEPS = {"validate-params", "fetch-sft", "train-rloo", "evaluate", "push-model", "finish-run"}


@pytest.fixture(scope="module")
def local_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    import io
    from contextlib import redirect_stdout

    from rloo.cli.pipeline_cmd import main

    work = tmp_path_factory.mktemp("local")
    tmp = tmp_path_factory.mktemp("system-tmp")  # the steps' temporary directories go here
    mp = pytest.MonkeyPatch()
    mp.delenv("MLFLOW_TRACKING_URI", raising=False)
    mp.setenv("TMPDIR", str(tmp))
    out = io.StringIO()
    try:
        with redirect_stdout(out):
            rc = main(["run", "--local", "--workdir", str(work), "--updates", "3"])
    finally:
        mp.undo()
    return {"rc": rc, "stdout": out.getvalue(), "work": work, "tmp": tmp}


def _outputs(run_dir: Path, step: str) -> dict[str, Any]:
    return json.loads((run_dir / step / "executor_output.json").read_text())


def test_every_step_ran_and_the_summary_says_where_things_are(local_run: dict[str, Any]) -> None:
    assert local_run["rc"] == 0, local_run["stdout"][-2000:]
    work: Path = local_run["work"]
    (run_dir,) = (work / "kfp").iterdir()
    assert {p.name for p in run_dir.iterdir()} == STEPS
    model = Path(_outputs(run_dir, "train-rloo")["parameterValues"]["Output"])
    assert model.parent.parent == work / "store"
    lines = local_run["stdout"].strip().splitlines()
    summary = "\n".join(lines[lines.index(next(x for x in lines if x.startswith("pipeline run "))) :])
    assert f"trained model:   {model}" in summary
    # a command that works as printed: the venv's own rloo, an absolute work directory
    assert f"MLflow UI:       {Path(sys.executable).parent / 'rloo'} ui --workdir {work}" in summary
    # the runs table in model-training mode (the UI's default mode is GenAI: a traces overview)
    assert "http://127.0.0.1:5000/#/experiments/1/runs?workflowType=machine_learning" in summary
    assert "push decision:" in summary and "win rate vs references: trained" in summary
    (published,) = (work / "store" / "published").iterdir()
    assert f"published:       {published}" in summary
    # progress and the summary on the terminal (it was ~730 lines of executor JSON); the rest in files
    assert len(lines) < 30, local_run["stdout"]
    assert "Got executor_input" not in local_run["stdout"] and "Traceback" not in local_run["stdout"]
    assert sum(f"  {step} done in " in local_run["stdout"] for step in STEPS) == len(STEPS)
    (logs,) = (work / "logs").iterdir()
    assert f"step logs:       {logs}" in summary
    assert {p.name for p in logs.iterdir()} >= {"pipeline.log", *(f"{step}.log" for step in STEPS)}
    assert "Got executor_input" in (logs / "train-rloo.log").read_text()


def test_object_store_holds_verified_models_and_results(local_run: dict[str, Any]) -> None:
    from rloo.storage import verify_prefix

    store: Path = local_run["work"] / "store"
    (run,) = (p for p in store.iterdir() if p.name != "published")
    for part in ("sft", "model", "eval"):
        verify_prefix(str(run / part))  # every file matches its manifest's SHA-256
    assert (run / "model" / "training_complete.json").is_file() and (
        run / "model" / "metrics.jsonl"
    ).is_file()
    results = json.loads((run / "eval" / "eval_results.json").read_text())
    assert results["num_examples"] == 32  # the toy evaluation split, judged in full
    (published,) = (store / "published").iterdir()
    card = (published / "README.md").read_text()
    assert "rloo" in card  # the model card
    verify_prefix(str(published))
    # durable locations, not the steps' deleted temporary copies
    assert f"base_model: {run / 'sft'}" in card
    models = results["models"]
    assert (models["trained"]["path"], models["baseline"]["path"]) == (str(run / "model"), str(run / "sft"))
    assert results["settings"]["output_dir"] == str(run / "eval")
    # push_result.json beside the model and the evaluation, not only an MLflow artifact
    verify_prefix(str(run / "push"))
    pushed = json.loads((run / "push" / "push_result.json").read_text())
    assert (
        pushed["storage"]["uri"] == published.as_uri() and pushed["mlflow"]["registered_model_name"] == "rloo"
    )
    leftovers = [
        p.name
        for p in local_run["tmp"].iterdir()
        if p.name.startswith(("rloo-train-", "rloo-eval-", "rloo-push-"))
    ]
    assert leftovers == []


def test_kfp_ui_artifacts(local_run: dict[str, Any]) -> None:
    """Metrics for the KFP UI, and a Markdown summary per stage with its MLflow run."""
    (run_dir,) = (local_run["work"] / "kfp").iterdir()
    train = _outputs(run_dir, "train-rloo")["artifacts"]
    headline = train["metrics"]["artifacts"][0]["metadata"]
    assert headline["updates"] == 3 and headline["episodes"] == 3 * 32
    assert 0.0 <= headline["final_score"] <= 1.0  # the toy reward is a fraction of letters
    fetch_meta = _outputs(run_dir, "fetch-sft")["artifacts"]["sft_model"]["artifacts"][0]["metadata"]
    assert fetch_meta["manifest_digest"].startswith("sha256:")
    evaluation = _outputs(run_dir, "evaluate")["artifacts"]["metrics"]["artifacts"][0]["metadata"]
    assert evaluation["trained_num_valid"] == 32 and evaluation["baseline_num_valid"] == 32
    # the demo's reward model trains at weight 0 (the policy never chases it): no judge/reward-model
    # agreement, which would say nothing of reward hacking (tests/eval covers the monitor)
    assert not any(k.startswith("judge_rm_agreement") for k in evaluation)
    for step in ("fetch-sft", "train-rloo", "evaluate", "push-model"):
        text = (run_dir / step / "summary").read_text()
        assert text.startswith("## ")
        if step != "fetch-sft":
            assert "MLflow run `" in text, (step, text)
    assert "### Sample generations" in (run_dir / "train-rloo" / "summary").read_text()
    assert (run_dir / "evaluate" / "report").read_text().lstrip().lower().startswith("<!doctype html")


def test_mlflow_has_the_pipeline_run_and_its_stages(local_run: dict[str, Any]) -> None:
    from mlflow.tracking import MlflowClient

    work: Path = local_run["work"]
    client = MlflowClient(tracking_uri=f"sqlite:///{work / 'mlruns' / 'mlflow.db'}")
    exp = client.get_experiment_by_name("rloo")
    assert exp is not None and exp.artifact_location.startswith((work / "mlruns").as_uri())
    # a model-training experiment: the UI opens on its runs, not on the GenAI traces overview
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"
    runs = client.search_runs([exp.experiment_id])
    (parent,) = (r for r in runs if r.data.tags.get("rloo.kind") == "pipeline")
    assert parent.info.status == "FINISHED"  # closed by the exit handler
    stages = {
        r.data.tags["rloo.stage"]: r
        for r in runs
        if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id
    }
    assert set(stages) == {"train", "eval", "push"}
    assert all(r.info.status == "FINISHED" for r in stages.values())
    # stage runs carry their pipeline run's name, so chart legends tell two runs' stages apart
    assert {r.info.run_name for r in stages.values()} == {
        f"{parent.info.run_name} · {s}" for s in ("train", "eval", "push")
    }
    # one row per pipeline run compares runs: the settings and the headline results on the parent
    train_params, eval_params = stages["train"].data.params, stages["eval"].data.params
    assert parent.data.params["learning_rate"] == train_params["learning_rate"]
    assert parent.data.params["rloo_k"] == train_params["rloo_k"]
    assert parent.data.params["eval.judge_model"] == eval_params["judge_model"]
    assert parent.data.metrics["objective/scores"] == stages["train"].data.metrics["objective/scores"]
    assert parent.data.metrics["trained/win_rate"] == stages["eval"].data.metrics["trained/win_rate"]
    assert parent.data.tags["rloo.promotion"] == stages["push"].data.tags["rloo.promotion"]
    assert not any(k.startswith("system/") for k in parent.data.metrics)
    history = client.get_metric_history(stages["train"].info.run_id, "objective/scores")
    assert [m.step for m in history] == [1, 2, 3]
    # the train run names the store's copies, not the train step's deleted temporary ones
    (run,) = (p for p in (work / "store").iterdir() if p.name != "published")
    train = stages["train"].data
    assert (train.tags["rloo.location.model_name_or_path"], train.tags["rloo.output_dir"]) == (
        str(run / "sft"),
        str(run / "model"),
    )
    assert train.tags["rloo.location.output_dir"] == str(run / "model")
    assert not {"model_name_or_path", "output_dir"} & set(train.params)  # locations are tags
    assert stages["eval"].data.tags["rloo.output_dir"] == str(run / "eval")
    # no stage starts before its pipeline run
    assert parent.info.start_time <= min(r.info.start_time for r in stages.values())
    assert "trained/win_rate" in stages["eval"].data.metrics
    eval_files = {a.path for a in client.list_artifacts(stages["eval"].info.run_id, "eval")}
    assert "eval/eval_results.json" in eval_files and "eval/eval_report.html" in eval_files
    assert stages["push"].data.tags.get("rloo.promotion") in {"champion", "candidate", "rejected"}
    # artifacts live under the work directory, not in some step's temporary cwd
    assert any(Path(exp.artifact_location.removeprefix("file://")).rglob("eval_results.json"))
    # registered by default, under the experiment's name, with the push decision as its alias
    (version,) = client.search_model_versions("name = 'rloo'")
    assert client.get_model_version("rloo", version.version).aliases == [
        stages["push"].data.tags["rloo.promotion"]
    ]


def test_rloo_ui_serves_the_demo_runs(local_run: dict[str, Any]) -> None:
    """The command the summary prints: the UI's page, and its REST API lists the run and its stages."""
    from tests.fixtures.servers import free_port

    work: Path = local_run["work"]
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    rloo = str(Path(sys.executable).parent / "rloo")
    proc = subprocess.Popen(
        [rloo, "ui", "--workdir", str(work), "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=work.parent,  # anywhere: the printed command is absolute
    )
    try:
        assert proc.stdout is not None
        seen = [proc.stdout.readline() for _ in range(2)]
        assert seen[1].startswith(f"MLflow UI: http://127.0.0.1:{port}"), seen
        base = f"http://127.0.0.1:{port}"
        with urllib.request.urlopen(base + "/", timeout=30) as resp:
            page = resp.read().decode()
        assert page.lower().startswith("<!doctype html") and "static-files" in page
        req = urllib.request.Request(
            base + "/api/2.0/mlflow/runs/search",
            data=json.dumps({"experiment_ids": ["1"]}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=30) as resp:
            runs = json.loads(resp.read())["runs"]
        names = {r["info"]["run_name"] for r in runs}
        # the pipeline run and its three stage runs, named after it (`<run> · train`)
        assert len(runs) == 4 and {n.rpartition(" · ")[2] for n in names} >= {"train", "eval", "push"}, names
    finally:
        proc.send_signal(signal.SIGTERM)  # `kill` stops the UI and its server, like Ctrl-C
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert "stopping the MLflow UI" in out
    with socket.socket() as s:  # nothing of the server is left listening on the port
        # SO_REUSEADDR, as servers bind: the closed connections' TIME_WAIT is no listener
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))


def test_rloo_ui_without_a_store_says_how_to_make_one(tmp_path: Path) -> None:
    rloo = str(Path(sys.executable).parent / "rloo")
    done = subprocess.run(
        [rloo, "ui", "--workdir", str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("rloo ui: error: no MLflow store at ") and "make demo" in line


def test_same_command_reports_to_a_real_mlflow_server_and_bucket(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mlflow_server: MlflowServer
) -> None:
    """MLFLOW_TRACKING_URI and the S3 variables of the environment reach every step: models and results
    land in the bucket (verified uploads), runs on the server with their artifacts proxied to S3."""
    import io
    from contextlib import redirect_stdout

    from mlflow.tracking import MlflowClient

    from rloo.cli.pipeline_cmd import main
    from rloo.storage import verify_prefix

    use_s3(mlflow_server.s3, monkeypatch)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server.uri)
    prefix = f"s3://{mlflow_server.s3.bucket}/{tmp_path.name}"
    experiment = f"local-{tmp_path.name}"
    argv = ["run", "--local", "--workdir", str(tmp_path / "work"), "--updates", "1"]
    for k, v in {"output_uri": prefix, "mlflow_experiment": experiment, "eval_num_examples": 4}.items():
        argv += ["--param", f"{k}={v}"]
    out = io.StringIO()
    with redirect_stdout(out):
        assert main(argv) == 0, out.getvalue()[-2000:]
    assert f"MLflow:          {mlflow_server.uri}" in out.getvalue()
    assert not (tmp_path / "work" / "store").exists() and not (tmp_path / "work" / "mlruns").exists()
    (run_dir,) = (tmp_path / "work" / "kfp").iterdir()
    model = json.loads((run_dir / "train-rloo" / "executor_output.json").read_text())["parameterValues"]
    assert model["Output"].startswith(prefix)
    run_prefix = model["Output"].rsplit("/", 1)[0]
    for part in ("sft", "model", "eval"):
        verify_prefix(f"{run_prefix}/{part}")

    client = MlflowClient(tracking_uri=mlflow_server.uri)
    exp = client.get_experiment_by_name(experiment)
    assert exp is not None
    runs = client.search_runs([exp.experiment_id])
    (parent,) = (r for r in runs if r.data.tags.get("rloo.kind") == "pipeline")
    assert parent.info.status == "FINISHED"
    stages = {r.data.tags.get("rloo.stage") for r in runs if r is not parent}
    assert stages == {"train", "eval", "push"}
    (ev,) = (r for r in runs if r.data.tags.get("rloo.stage") == "eval")
    assert {a.path for a in client.list_artifacts(ev.info.run_id, "eval")} >= {"eval/eval_results.json"}
    # a tracking server registers the model by default, under the experiment's name
    (version,) = client.search_model_versions(f"name = '{experiment}'")
    assert version.tags["rloo.source_run"] == run_prefix.rsplit("/", 1)[1]
    verify_prefix(f"{run_prefix}/push")
