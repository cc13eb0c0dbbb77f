"""The MLflow sink against a real tracking server (artifacts proxied to SeaweedFS) and the embedded store:
runs, nesting, statuses, outages, bad configuration."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from mlflow.tracking import MlflowClient

from rloo.errors import UserError
from rloo.tracking import MlflowSink, check_tracking_server, finish_pipeline_run, sinks_from_env
from rloo.training.metrics import MetricsLogger
from tests.fixtures.faultproxy import FaultProxy
from tests.fixtures.servers import SECRET_KEY, MlflowServer, free_port


def wait_for(cond: Callable[[], bool], what: str, timeout: float = 90.0) -> None:
    """Poll until ``cond()`` (a generous deadline only to end a hung test; no timing is asserted)."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.1)


def _experiment() -> str:
    return f"test-{uuid.uuid4().hex[:8]}"


def _sink(**kw: object) -> MlflowSink:
    kw.setdefault("system_metrics_interval", None)
    kw.setdefault("retry_initial", 0.2)
    kw.setdefault("retry_max", 1.0)
    return MlflowSink(**kw)  # type: ignore[arg-type]


def _history(client: MlflowClient, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def test_params_metrics_artifacts_reach_the_server_and_the_bucket(
    tracking_env: MlflowServer, tmp_path: Path
) -> None:
    sink = _sink(experiment=_experiment(), run_name="train-a", system_metrics_interval=60.0)
    logger = MetricsLogger(total_updates=3, show_progress=False, sinks=[sink])
    logger.log_params({"learning_rate": 3e-6, "hub_token": "hf_secret_value_123", "nested": {"k": 4}})
    for u in (1, 2, 3):
        logger.log({"update": u, "objective/scores": 0.1 * u, "objective/kl": 0.01, "bad!name": 1.0})
    logger.samples(1, [{"query": "q", "response": "r", "score": 1.0}])
    logger.open(tmp_path)
    logger.close("FINISHED")
    client = MlflowClient(tracking_env.uri)
    run = client.get_run(sink.run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "train-a"
    assert run.data.params["learning_rate"] == "3e-06" and run.data.params["nested.k"] == "4"
    assert run.data.params["hub_token"] == "***"
    assert _history(client, sink.run_id, "objective/scores") == [(1, 0.1), (2, 0.2), (3, pytest.approx(0.3))]
    assert "bad_name" in run.data.metrics
    assert any(k.startswith("system/cpu_utilization") for k in run.data.metrics)  # sampled at start and end
    arts = {a.path for d in ("samples", "plots") for a in client.list_artifacts(sink.run_id, d)}
    assert arts == {"samples/update_000001.html", "samples/update_000001.json", "plots/training_curves.png"}
    local = client.download_artifacts(sink.run_id, "samples/update_000001.json", str(tmp_path / "dl"))
    assert '"response": "r"' in Path(local).read_text()
    # the server proxied the artifacts into the SeaweedFS bucket
    keys = [
        o["Key"]
        for o in tracking_env.s3.client().list_objects_v2(Bucket="rloo-test", Prefix="mlflow/")["Contents"]
    ]
    assert any(k.endswith(f"{sink.run_id}/artifacts/plots/training_curves.png") for k in keys)


def test_pipeline_parent_run_with_nested_stage_runs(
    tracking_env: MlflowServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    exp, kfp_id = _experiment(), f"kfp-{uuid.uuid4()}"
    monkeypatch.setenv("KFP_RUN_ID", kfp_id)
    monkeypatch.setenv("KFP_RUN_NAME", "nightly-rloo")
    stages = {}
    for stage in ("fetch", "train"):
        sink = _sink(stage=stage, experiment=exp)
        sink.log_metrics({"x": 1.0}, 0)
        sink.finish("FINISHED")
        stages[stage] = sink
    client = MlflowClient(tracking_env.uri)
    parent_id = stages["fetch"].parent_run_id
    assert parent_id and stages["train"].parent_run_id == parent_id
    parent = client.get_run(parent_id)
    assert parent.info.run_name == "nightly-rloo" and parent.info.status == "RUNNING"  # more stages to come
    assert parent.data.tags["kfp.run_id"] == kfp_id and parent.data.tags["rloo.kind"] == "pipeline"
    train = client.get_run(stages["train"].run_id)
    assert train.data.tags["mlflow.parentRunId"] == parent_id and train.data.tags["rloo.stage"] == "train"
    assert train.data.tags["kfp.run_name"] == "nightly-rloo"
    # a stage that fails marks itself and the pipeline FAILED
    failing = _sink(stage="eval", experiment=exp)
    failing.log_metrics({"x": 1.0}, 0)
    failing.finish("FAILED")
    assert client.get_run(failing.run_id).info.status == "FAILED"
    assert client.get_run(parent_id).info.status == "FAILED"
    # a retry of the pipeline: the last stage succeeds and finishes the parent
    push = _sink(stage="push", experiment=exp, end_parent_on_success=True)
    push.log_metrics({"x": 1.0}, 0)
    push.finish("FINISHED")
    assert push.parent_run_id == parent_id and client.get_run(parent_id).info.status == "FINISHED"
    assert finish_pipeline_run("FAILED", experiment=exp) == parent_id
    assert client.get_run(parent_id).info.status == "FAILED"


def test_a_stage_whose_pod_died_is_superseded_not_left_running(
    tracking_env: MlflowServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    exp = _experiment()
    monkeypatch.setenv("KFP_RUN_ID", f"kfp-{uuid.uuid4()}")
    dead = _sink(experiment=exp, flush_timeout=30)
    dead.log_metrics({"x": 1.0}, 0)
    assert dead.flush(60)  # ... and the pod is killed: no finish()
    fresh = _sink(experiment=exp)
    fresh.log_metrics({"x": 2.0}, 1)
    fresh.finish("FINISHED")
    client = MlflowClient(tracking_env.uri)
    assert client.get_run(dead.run_id).info.status == "FAILED"
    assert client.get_run(fresh.run_id).data.tags["rloo.resumed_from"] == dead.run_id
    dead._abandon = True  # stop the orphaned worker thread of this process


def test_resumed_training_gets_a_complete_run_and_ends_the_dead_one(
    tracking_env: MlflowServer, tmp_path: Path
) -> None:
    exp, out = _experiment(), tmp_path / "out"
    first_sink = _sink(experiment=exp)
    first = MetricsLogger(total_updates=4, show_progress=False, sinks=[first_sink])
    first.open(out)
    for u in (1, 2, 3):
        first.log({"update": u, "objective/scores": float(u)})
    assert first_sink.flush(60)  # ... then SIGKILL: no close(); the checkpoint is at update 2
    second_sink = _sink(experiment=exp)
    second = MetricsLogger(total_updates=4, show_progress=False, sinks=[second_sink])
    second.open(out, keep_until_update=2)
    for u in (3, 4):
        second.log({"update": u, "objective/scores": 10.0 * u})
    second.close("FINISHED")
    client = MlflowClient(tracking_env.uri)
    assert client.get_run(first_sink.run_id).info.status == "FAILED"
    new = client.get_run(second_sink.run_id)
    assert new.info.status == "FINISHED" and new.data.tags["rloo.resumed_from"] == first_sink.run_id
    # one value per update, the kept ones replayed: the curve a user compares is whole and not duplicated
    assert _history(client, second_sink.run_id, "objective/scores") == [
        (1, 1.0),
        (2, 2.0),
        (3, 30.0),
        (4, 40.0),
    ]
    first_sink._abandon = True


@pytest.fixture
def mlflow_proxy(tracking_env: MlflowServer) -> Iterator[FaultProxy]:
    p = FaultProxy(tracking_env.port)
    yield p
    p.close()


def test_outage_buffers_retries_and_loses_nothing(
    tracking_env: MlflowServer, mlflow_proxy: FaultProxy, tmp_path: Path
) -> None:
    sink = _sink(tracking_uri=mlflow_proxy.url, experiment=_experiment())
    logger = MetricsLogger(total_updates=20, show_progress=False, sinks=[sink])
    logger.open(tmp_path)
    logger.log({"update": 1, "objective/scores": 1.0})
    assert sink.flush(60)
    mlflow_proxy.set_fault("refuse")  # the server is gone: new connections are reset ...
    mlflow_proxy.cut()  # ... and so are the open ones
    for u in range(2, 12):  # training goes on; every call returns at once
        logger.log({"update": u, "objective/scores": float(u)})
    wait_for(lambda: sink.last_error is not None, "the worker noticed the outage")
    assert sink.pending >= 10
    client = MlflowClient(tracking_env.uri)  # straight to the server, not through the proxy
    assert _history(client, sink.run_id, "objective/scores") == [(1, 1.0)]
    mlflow_proxy.clear()  # the server is back
    logger.close("FINISHED")
    assert _history(client, sink.run_id, "objective/scores") == [(u, float(u)) for u in range(1, 12)]
    assert client.get_run(sink.run_id).info.status == "FINISHED" and sink.pending == 0


def test_buffer_is_bounded_during_a_long_outage(tracking_env: MlflowServer, mlflow_proxy: FaultProxy) -> None:
    sink = _sink(tracking_uri=mlflow_proxy.url, experiment=_experiment(), max_buffered_metrics=20)
    sink.log_metrics({"m": 0.0}, 0)
    assert sink.flush(60)
    mlflow_proxy.set_fault("refuse")
    mlflow_proxy.cut()
    for step in range(1, 51):
        sink.log_metrics({"m": float(step)}, step)
    # the oldest go (at once, or when a batch in flight comes back failed): memory stays bounded
    wait_for(lambda: sink.dropped_metrics == 30, "the buffer dropped down to its bound")
    mlflow_proxy.clear()
    sink.finish("FINISHED")
    steps = [s for s, _ in _history(MlflowClient(tracking_env.uri), sink.run_id, "m")]
    assert steps == [0, *range(31, 51)]  # what was sent before the outage, then the newest 20


def test_server_down_at_finish_gives_up_after_the_flush_timeout(
    tracking_env: MlflowServer, mlflow_proxy: FaultProxy, caplog: pytest.LogCaptureFixture
) -> None:
    sink = _sink(tracking_uri=mlflow_proxy.url, experiment=_experiment(), flush_timeout=2.0)
    sink.log_metrics({"m": 0.0}, 0)
    assert sink.flush(60)
    mlflow_proxy.set_fault("refuse")
    mlflow_proxy.cut()
    sink.log_metrics({"m": 1.0}, 1)
    sink.finish("FAILED")  # returns (no exception, no hang) with a warning that says what was lost
    assert (
        "unreachable" in caplog.text and "gave up after 2s" in caplog.text and "metrics.jsonl" in caplog.text
    )


def test_unreachable_or_wrong_server_at_start_is_a_one_line_error(
    tracking_env: MlflowServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", dead)
    with pytest.raises(UserError) as e:
        MetricsLogger(total_updates=1, show_progress=False)  # the trainer's default sinks check up front
    msg = str(e.value)
    assert "\n" not in msg and dead in msg and "unreachable" in msg and "MLFLOW_TRACKING_URI" in msg
    s3 = tracking_env.s3.endpoint  # an HTTP server, but not MLflow
    with pytest.raises(UserError, match="does not answer like an MLflow tracking server") as e:
        check_tracking_server(s3)
    assert s3 in str(e.value) and SECRET_KEY not in str(e.value)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://admin:{SECRET_KEY}@127.0.0.1:{free_port()}")
    with pytest.raises(UserError) as e:
        sinks_from_env()
    assert SECRET_KEY not in str(e.value) and "***@127.0.0.1" in str(e.value)
    check_tracking_server(tracking_env.uri)  # the real one passes


def test_embedded_sqlite_store_needs_no_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("KFP_RUN_ID", raising=False)
    out = tmp_path / "out"
    logger = MetricsLogger(total_updates=2, show_progress=False, sinks=sinks_from_env("mlflow"))
    logger.log_params({"seed": 1})
    logger.log({"update": 1, "objective/kl": 0.5})
    assert not out.exists()
    logger.open(out)
    logger.close("FINISHED")
    client = MlflowClient(f"sqlite:///{out}/mlruns/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("rloo").experiment_id])
    assert run.info.status == "FINISHED" and run.data.params["seed"] == "1"
    assert run.data.metrics["objective/kl"] == 0.5
    assert (
        out / "mlruns" / "artifacts" / run.info.run_id / "artifacts" / "plots" / "training_curves.png"
    ).is_file()


def test_nothing_reaches_mlflow_when_the_run_never_opened(tracking_env: MlflowServer) -> None:
    exp = _experiment()
    logger = MetricsLogger(total_updates=2, show_progress=False, sinks=[_sink(experiment=exp)])
    logger.log_params({"lr": 1})
    logger.log({"update": 1, "x": 1.0})
    logger.close("FAILED")  # bad input: the first update never succeeded
    assert MlflowClient(tracking_env.uri).get_experiment_by_name(exp) is None


_CRASHING_STAGE = textwrap.dedent(
    """
    import os, signal, sys
    from rloo.tracking import MlflowSink, exit_on_sigterm
    from rloo.training.metrics import MetricsLogger

    exit_on_sigterm()
    sink = MlflowSink(experiment=sys.argv[1], system_metrics_interval=None, retry_initial=0.2)
    logger = MetricsLogger(total_updates=3, show_progress=False, sinks=[sink])
    logger.open(sys.argv[2])
    logger.log({"update": 1, "objective/kl": 0.1})
    sink.flush(60)
    print(sink.run_id, flush=True)
    if sys.argv[3] == "raise":
        raise RuntimeError("CUDA error: an illegal memory access")  # nobody calls logger.close()
    try:
        os.kill(os.getpid(), signal.SIGTERM)  # pod eviction
    finally:
        logger.close("FAILED")
    """
)


@pytest.mark.parametrize("how", ["raise", "sigterm"])
def test_a_crashing_stage_process_leaves_a_failed_run(
    tracking_env: MlflowServer, tmp_path: Path, how: str
) -> None:
    exp = _experiment()
    proc = subprocess.run(
        [sys.executable, "-c", _CRASHING_STAGE, exp, str(tmp_path), how],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "MLFLOW_TRACKING_URI": tracking_env.uri},
    )
    assert proc.returncode == (1 if how == "raise" else 143), proc.stderr
    run_id = proc.stdout.split()[0]
    assert MlflowClient(tracking_env.uri).get_run(run_id).info.status == "FAILED"


def test_a_pipeline_that_failed_before_any_stage_still_shows_up_failed(
    tracking_env: MlflowServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlflow.tracking import MlflowClient

    exp = _experiment()  # not created yet: validation failed before anything was tracked
    kfp_id = f"kfp-{uuid.uuid4()}"
    client = MlflowClient(tracking_uri=tracking_env.uri)
    assert finish_pipeline_run("FINISHED", pipeline_run_id=kfp_id, experiment=exp) is None  # nothing to close
    assert client.get_experiment_by_name(exp) is None  # and nothing created for it
    run_id = finish_pipeline_run(
        "FAILED",
        pipeline_run_id=kfp_id,
        pipeline_run_name="nightly",
        experiment=exp,
        error="rloo_k must be >= 2",
    )
    run = client.get_run(run_id)
    assert run.info.status == "FAILED" and run.info.run_name == "nightly"
    assert run.data.tags["rloo.error"] == "rloo_k must be >= 2" and run.data.tags["kfp.run_id"] == kfp_id
    # the exit handler of a retried run finds the same parent rather than adding another
    assert finish_pipeline_run("FAILED", pipeline_run_id=kfp_id, experiment=exp) == run_id


@pytest.fixture
def own_mlflow(s3_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[MlflowServer]:
    """A tracking server of this test alone, to stop and restart on the same port and store."""
    server = MlflowServer(tmp_path / "own-mlflow", s3_server)
    server.start()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", server.uri)
    for name in ("KFP_RUN_ID", "KFP_RUN_NAME", "RLOO_REPORT_TO", "MLFLOW_EXPERIMENT_NAME"):
        monkeypatch.delenv(name, raising=False)
    yield server
    server.stop()


def test_server_stopped_and_restarted_mid_stage_gets_everything(
    own_mlflow: MlflowServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("KFP_RUN_ID", f"kfp-{uuid.uuid4()}")
    sink = _sink(experiment=_experiment(), stage="train")
    logger = MetricsLogger(total_updates=8, show_progress=False, sinks=[sink])
    logger.open(tmp_path / "out")
    logger.log({"update": 1, "objective/scores": 1.0})
    assert sink.flush(60)
    own_mlflow.stop()  # the real server process goes away ...
    for u in range(2, 8):
        logger.log({"update": u, "objective/scores": float(u)})
    wait_for(lambda: sink.last_error is not None, "the worker noticed the outage")
    own_mlflow.start()  # ... and comes back on the same port and store before the stage ends
    logger.close("FINISHED")
    client = MlflowClient(own_mlflow.uri)
    assert client.get_run(sink.run_id).info.status == "FINISHED"
    assert _history(client, sink.run_id, "objective/scores") == [(u, float(u)) for u in range(1, 8)]
    assert not (tmp_path / "out" / "mlflow_unclosed.json").exists()


def test_server_gone_at_stage_end_bounded_wait_then_the_next_stage_closes_the_run(
    own_mlflow: MlflowServer,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    from rloo.tracking.lifecycle import finish_pipeline_run, start_stage_run

    exp = _experiment()
    monkeypatch.setenv("KFP_RUN_ID", f"kfp-{uuid.uuid4()}")
    train = _sink(experiment=exp, stage="train", outage_flush_timeout=3.0)
    logger = MetricsLogger(total_updates=5, show_progress=False, sinks=[train])
    logger.open(tmp_path / "train")
    logger.log({"update": 1, "objective/scores": 1.0})
    assert train.flush(60)
    own_mlflow.stop()
    for u in range(2, 5):
        logger.log({"update": u, "objective/scores": float(u)})
    wait_for(lambda: train.last_error is not None, "the worker noticed the outage")
    started = time.monotonic()
    logger.close("FINISHED")  # training succeeded; MLflow is still down
    assert time.monotonic() - started < 10  # bounded: not the minute of flush_timeout
    (line,) = [r.getMessage() for r in caplog.records if "gave up after" in r.getMessage()]
    assert "\n" not in line and "unreachable" in line and " metrics and " in line
    assert f"run {train.run_id} will be closed FINISHED by the next stage" in line
    assert json.loads((tmp_path / "train" / "mlflow_unclosed.json").read_text())["status"] == "FINISHED"

    own_mlflow.start()
    client = MlflowClient(own_mlflow.uri)
    assert client.get_run(train.run_id).info.status == "RUNNING"  # nobody could tell it otherwise
    # the next stage of the same pipeline run reaches the server: KFP ran it, so train succeeded
    evaluate = start_stage_run("evaluate", experiment=exp)
    run = client.get_run(train.run_id)
    assert run.info.status == "FINISHED" and run.info.end_time
    assert run.data.tags["rloo.closed_by"] == evaluate.run_id
    # a stage whose pod ends during an outage and whose pipeline then fails: the exit handler closes it FAILED
    client_side = MlflowClient(own_mlflow.uri)
    assert client_side.get_run(evaluate.run_id).info.status == "RUNNING"
    assert finish_pipeline_run("FAILED", experiment=exp) == evaluate.parent_run_id
    assert client.get_run(evaluate.run_id).info.status == "FAILED"
    assert client.get_run(evaluate.parent_run_id).info.status == "FAILED"


def test_outside_a_pipeline_the_next_run_on_the_output_dir_applies_the_recorded_status(
    tracking_env: MlflowServer, mlflow_proxy: FaultProxy, tmp_path: Path
) -> None:
    exp, out = _experiment(), tmp_path / "out"
    first = _sink(tracking_uri=mlflow_proxy.url, experiment=exp, outage_flush_timeout=1.0)
    first.open(out)
    first.log_metrics({"m": 0.0}, 0)
    assert first.flush(60)
    mlflow_proxy.set_fault("refuse")
    mlflow_proxy.cut()
    first.log_metrics({"m": 1.0}, 1)
    wait_for(lambda: first.last_error is not None, "the worker noticed the outage")
    first.finish("FINISHED")
    assert (out / "mlflow_unclosed.json").is_file()
    second = _sink(experiment=exp)  # e.g. 'rloo train' again on the same output_dir, server reachable
    second.open(out)
    second.log_metrics({"m": 2.0}, 2)
    second.finish("FINISHED")
    client = MlflowClient(tracking_env.uri)
    assert client.get_run(first.run_id).info.status == "FINISHED"  # what it recorded, not FAILED
    assert client.get_run(second.run_id).data.tags["rloo.resumed_from"] == first.run_id
    assert not (out / "mlflow_unclosed.json").exists()
