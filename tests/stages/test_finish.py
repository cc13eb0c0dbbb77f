"""The exit handler as the cluster runs it: the real ``finish_run`` component, handed the executor input KFP's
launcher hands it, closing a real MLflow run; and deleting the multi-node job a terminated run left behind,
against the Kubernetes API boundary (tests/fixtures/kube_api.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from components.finish_run.component import finish_run
from rloo.k8s.builders import POD_NAMESPACE_ENV, build_job, job_name
from tests.fixtures.kube_api import FakeKubeAPI
from tests.k8s.test_builders import _spec

ROOT = Path(__file__).resolve().parents[2]
RUN = "abc"  # the KFP run id: its job is rloo-train-abc (tests.k8s.test_builders._spec)
JOB = job_name(RUN)
PLURAL = {"trainjob": "trainjobs", "pytorchjob": "pytorchjobs"}


def _final_status(state: str, error: dict[str, Any] | None = None) -> dict[str, Any]:
    """``PipelineTaskFinalStatus`` as KFP's driver resolves it (backend/src/v2/driver/resolve.go:
    ``protojson.Marshal`` of ``{State: LastKnownState().String(), PipelineTaskName, PipelineJobResourceName,
    Error: &status.Status{}}``: an empty error object, whatever the state)."""
    return {
        "error": error if error is not None else {},
        "pipelineJobResourceName": "rloo-rlhf-8xk2p",
        "pipelineTaskName": "exit-handler-1",
        "state": state,
    }


def _executor_input(
    out: Path, status: dict[str, Any], *, run_id: str, exp: str, namespace: str
) -> dict[str, Any]:
    """The ``{{$}}`` KFP's launcher substitutes into the component's arguments (an ``ExecutorInput``)."""
    out.mkdir(parents=True, exist_ok=True)
    return {
        "inputs": {
            "parameterValues": {
                "status": status,
                "kfp_run_id": run_id,
                "kfp_run_name": "nightly",
                "mlflow_experiment": exp,
                "namespace": namespace,
            }
        },
        "outputs": {
            "parameters": {"Output": {"outputFile": str(out / "Output")}},
            "outputFile": str(out / "executor_output.json"),
        },
    }


def _run_in_process(executor_input: dict[str, Any]) -> str:
    """The component through ``kfp.dsl.executor.Executor``, as ``kfp.dsl.executor_main`` runs it."""
    from kfp.dsl.executor import Executor

    Executor(executor_input=executor_input, function_to_execute=finish_run.python_func).execute()
    return json.loads(Path(executor_input["outputs"]["outputFile"]).read_text())["parameterValues"]["Output"]


def _pythonpath(env: Mapping[str, str]) -> str:
    """This checkout first (tests.fixtures), then what the tests run with."""
    return os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)


def _run_as_launcher(executor_input: dict[str, Any], env: dict[str, str]) -> str:
    """The component's own container command and arguments (``sh -ec`` writing the function to a file, then
    ``python3 -m kfp.dsl.executor_main``), ``{{$}}`` replaced as the launcher does."""
    container = finish_run.component_spec.implementation.container
    args = [json.dumps(executor_input) if a == "{{$}}" else a for a in container.args]
    path = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # python3: this venv's
    proc = subprocess.run(
        [*container.command, *args],
        env={**env, "PATH": path, "PYTHONPATH": _pythonpath(env)},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(Path(executor_input["outputs"]["outputFile"]).read_text())["parameterValues"]["Output"]


@pytest.fixture(scope="module")
def tracking_store(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A real MLflow tracking store (SQLite), created once: its schema migrations take seconds."""
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"
    MlflowClient(uri).search_experiments()
    return uri


@pytest.fixture
def tracking(tracking_store: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """The tracking store in the step's environment, no Kubernetes namespace known."""
    uri = tracking_store
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    for name in ("KFP_RUN_ID", "KFP_RUN_NAME", "MLFLOW_EXPERIMENT_NAME", POD_NAMESPACE_ENV):
        monkeypatch.delenv(name, raising=False)
    return uri


def _parent_run(uri: str) -> tuple[str, str, str]:
    """(experiment, KFP run id, MLflow run id) of a pipeline run whose stages opened its parent run."""
    from mlflow.tracking import MlflowClient

    from rloo.tracking.experiment import get_or_create_experiment
    from rloo.tracking.lifecycle import get_or_create_parent_run

    client = MlflowClient(uri)
    exp, kfp_id = f"exp-{uuid.uuid4().hex[:8]}", f"kfp-{uuid.uuid4()}"
    parent = get_or_create_parent_run(client, get_or_create_experiment(client, exp), kfp_id, "nightly")
    assert client.get_run(parent).info.status == "RUNNING"
    return exp, kfp_id, parent


# (state as the backend spells it, what the MLflow run must be closed as)
STATES = [
    ("COMPLETE", "FINISHED"),  # KFP 2.x's driver: MLMD Execution.State of the exit-handler DAG
    ("CACHED", "FINISHED"),  # MLMD: every task a cache hit
    ("SUCCEEDED", "FINISHED"),  # PipelineStateEnum.PipelineTaskState (Vertex AI, kfp.local)
    ("SKIPPED", "FINISHED"),  # PipelineTaskState: skipped on a cache hit
    ("FAILED", "FAILED"),
    ("CANCELED", "FAILED"),  # MLMD
    ("CANCELLED", "FAILED"),  # PipelineTaskState
    ("RUNNING", "FAILED"),  # MLMD: a DAG whose task died without reporting never leaves RUNNING
    ("", "FAILED"),
]


@pytest.mark.parametrize(("state", "closed"), STATES)
def test_every_backends_success_closes_the_run_finished(
    state: str, closed: str, tracking: str, tmp_path: Path
) -> None:
    """kubeflow/pipelines backend/src/v2/driver/resolve.go builds ``state`` from MLMD's
    ``LastKnownState().String()`` (``COMPLETE``), api/v2alpha1/pipeline_spec.proto's PipelineTaskState and
    backend/api/v2beta1/run.proto's RuntimeState say ``SUCCEEDED`` / ``SKIPPED``, and
    sdk/python/kfp/dsl/executor.py hands the component ``state`` and ``error.message`` (None: the driver's
    error is empty). Only a success spelling may close the run FINISHED."""
    from mlflow.tracking import MlflowClient

    exp, kfp_id, parent = _parent_run(tracking)
    executor_input = _executor_input(
        tmp_path / "out", _final_status(state), run_id=kfp_id, exp=exp, namespace=""
    )
    assert _run_in_process(executor_input) == closed
    run = MlflowClient(tracking).get_run(parent)
    assert run.info.status == closed
    if closed == "FAILED":  # the driver gives no error message: the state itself is recorded
        assert run.data.tags["rloo.error"] == f"the pipeline run ended {state or 'in an unknown state'}"


def test_the_launchers_command_closes_a_complete_run_finished(tracking: str, tmp_path: Path) -> None:
    """The component's compiled command, as KFP's launcher runs it (kubeflow/pipelines
    backend/src/v2/component/launcher_v2.go executes the container's command; sdk/python/kfp/dsl/executor_main.py
    loads the function), with the driver's final status of a successful run (backend/src/v2/driver/resolve.go:
    ``COMPLETE`` and an empty error)."""
    from mlflow.tracking import MlflowClient

    exp, kfp_id, parent = _parent_run(tracking)
    executor_input = _executor_input(
        tmp_path / "out", _final_status("COMPLETE"), run_id=kfp_id, exp=exp, namespace=""
    )
    assert _run_as_launcher(executor_input, dict(os.environ)) == "FINISHED"
    assert MlflowClient(tracking).get_run(parent).info.status == "FINISHED"


def test_a_failure_keeps_the_backends_error_message(tracking: str, tmp_path: Path) -> None:
    """A backend that fills ``error`` (kfp.local: sdk/python/kfp/local/orchestrator/orchestrator_utils.py) has its
    message recorded; it never decides the outcome."""
    from mlflow.tracking import MlflowClient

    exp, kfp_id, parent = _parent_run(tracking)
    status = _final_status("FAILED", {"code": 1, "message": "Task train-rloo failed."})
    assert (
        _run_in_process(_executor_input(tmp_path / "o", status, run_id=kfp_id, exp=exp, namespace=""))
        == "FAILED"
    )
    assert MlflowClient(tracking).get_run(parent).data.tags["rloo.error"] == "Task train-rloo failed."
    # an error object on a success (a backend that sets code 0) does not fail the run
    exp, kfp_id, parent = _parent_run(tracking)
    status = _final_status("SUCCEEDED", {"code": 0, "message": ""})
    assert (
        _run_in_process(_executor_input(tmp_path / "p", status, run_id=kfp_id, exp=exp, namespace=""))
        == "FINISHED"
    )


# The job a terminated run leaves behind ---------------------------------------------------------------------


@pytest.fixture
def kube(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Install a FakeKubeAPI (made by the returned function) in place of the Kubernetes client's APIs; no
    tracking server (the exit handler's MLflow part is the tests above)."""
    import kubernetes

    for name in ("MLFLOW_TRACKING_URI", POD_NAMESPACE_ENV):
        monkeypatch.delenv(name, raising=False)

    def install(**kw: Any) -> FakeKubeAPI:
        fake = FakeKubeAPI(**kw)
        monkeypatch.setattr(kubernetes.client, "CustomObjectsApi", lambda *a, **k: fake)
        monkeypatch.setattr(kubernetes.client, "CoreV1Api", lambda *a, **k: fake)
        monkeypatch.setattr(kubernetes.config, "load_incluster_config", lambda *a, **k: None)
        return fake

    return install


# The train step (the launcher's child process), following its job until it is killed.
_LAUNCHED_STEP = """
import sys
from pathlib import Path

import kubernetes

from tests.fixtures.kube_api import FakeKubeAPI

fake = FakeKubeAPI(outcome=None, store=Path(sys.argv[1]))
kubernetes.client.CustomObjectsApi = lambda *a, **k: fake
kubernetes.client.CoreV1Api = lambda *a, **k: fake
kubernetes.config.load_incluster_config = lambda *a, **k: None
kubernetes.config.load_kube_config = lambda *a, **k: None

from rloo.k8s.builders import build_job
from rloo.k8s.jobs import run_multi_node
from tests.k8s.test_builders import _spec

run_multi_node(build_job(_spec(), sys.argv[2]), poll_seconds=0.05, timeout_s=600)
"""


@pytest.mark.parametrize("kind", ["trainjob", "pytorchjob"])
def test_terminating_a_run_leaves_no_job_behind(
    kind: str, kube: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """KFP terminates a run: Argo's emissary forwards SIGTERM to KFP's launcher, which has no signal handling
    (kubeflow/pipelines backend/src/v2/component/launcher_v2.go runs the step with ``exec.Command(...).Run()``)
    and exits, the container with it: the Python step dies with no time to delete its job. The exit handler,
    which Argo runs after the terminated DAG, deletes it."""
    store = tmp_path / "cluster.json"
    step = subprocess.Popen(
        [sys.executable, "-c", _LAUNCHED_STEP, str(store), kind],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": _pythonpath(os.environ)},
        stdout=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120  # (only to end a hung test)
        while not (store.exists() and JOB in store.read_text()):
            assert step.poll() is None, "the train step ended before it created its job"
            assert time.monotonic() < deadline, "the train step never created its job"
            time.sleep(0.05)
        time.sleep(0.3)  # the step follows the job now
    finally:
        step.send_signal(signal.SIGKILL)  # the launcher's exit takes the container's processes with it
        step.wait(timeout=60)
    fake = kube(outcome=None, store=store)
    assert (PLURAL[kind], JOB) in fake.objects  # left behind, holding its nodes
    status = _final_status("RUNNING")  # MLMD: the terminated DAG never completed
    out = _run_in_process(_executor_input(tmp_path / "out", status, run_id=RUN, exp="e", namespace="team-a"))
    assert out == "no tracking server"
    assert fake.deleted == [JOB] and fake.objects == {}
    assert fake.delete_policies == ["Foreground"]  # its pods first
    what = "TrainJob" if kind == "trainjob" else "PyTorchJob"
    assert f"[rloo] deleted {what} team-a/{JOB}" in capsys.readouterr().out


def test_the_job_namespace_defaults_to_the_pods_own(
    kube: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An empty ``namespace`` parameter: the job went to the launcher pod's namespace, which the downward API
    gives the exit handler too (RLOO_POD_NAMESPACE)."""
    fake = kube(outcome=None)
    fake.put("trainjobs", build_job(_spec(), "trainjob"))
    monkeypatch.setenv(POD_NAMESPACE_ENV, "team-a")
    _run_in_process(
        _executor_input(tmp_path / "out", _final_status("FAILED"), run_id=RUN, exp="e", namespace="")
    )
    assert fake.deleted == [JOB]
    assert ("team-a", "trainer.kubeflow.org", "trainjobs", "delete") in fake.calls


def test_a_succeeded_job_is_kept(kube: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A finished job holds nothing, and its status and log stay readable (rloo.k8s.jobs keeps it too)."""
    fake = kube(outcome=None)
    fake.put("pytorchjobs", build_job(_spec(), "pytorchjob"))
    fake.objects[("pytorchjobs", JOB)]["status"] = {
        "conditions": [{"type": "Succeeded", "status": "True", "reason": "PyTorchJobSucceeded"}]
    }
    _run_in_process(
        _executor_input(tmp_path / "o", _final_status("COMPLETE"), run_id=RUN, exp="e", namespace="team-a")
    )
    assert fake.deleted == [] and ("pytorchjobs", JOB) in fake.objects
    assert f"[rloo] PyTorchJob team-a/{JOB} succeeded: kept" in capsys.readouterr().out


def _api_error(status: int) -> Exception:
    from kubernetes.client.rest import ApiException

    error = ApiException(status=status, reason={403: "Forbidden", 503: "Service Unavailable"}[status])
    error.body = json.dumps({"message": "trainjobs is forbidden: User cannot get"}) if status == 403 else None
    return error


def test_no_job_or_no_crd_needs_nothing(
    kube: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A single-node run created no job; a cluster without the Training Operator answers 404 for its kind."""
    fake = kube()
    _run_in_process(
        _executor_input(tmp_path / "o", _final_status("COMPLETE"), run_id=RUN, exp="e", namespace="team-a")
    )
    assert fake.deleted == [] and capsys.readouterr().out == ""
    assert {c[2:] for c in fake.calls} == {("trainjobs", "get"), ("pytorchjobs", "get")}


def test_a_refused_or_failing_api_never_fails_the_exit_handler(
    kube: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """No RBAC for the exit handler's service account: one warning line, and the run is still closed. A
    transient 503 is retried (briefly: this runs in the exit handler's own deadline)."""
    from rloo.k8s import jobs

    monkeypatch.setattr(jobs, "API_BACKOFF_S", 0.01)
    kube(outcome=None, faults={"get": [_api_error(403)] * 10})
    out = _run_in_process(
        _executor_input(tmp_path / "o", _final_status("FAILED"), run_id=RUN, exp="e", namespace="team-a")
    )
    assert out == "no tracking server"
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        f"[rloo] warning: could not read TrainJob team-a/{JOB}: 403 Forbidden: trainjobs is forbidden: User cannot "
        "get (the pipeline's service account needs the Role the Helm chart installs); a job this run left "
        "behind is not deleted"
    ]
    fake = kube(outcome=None, faults={"delete": [_api_error(503)]})
    fake.put("trainjobs", build_job(_spec(), "trainjob"))
    _run_in_process(
        _executor_input(tmp_path / "p", _final_status("FAILED"), run_id=RUN, exp="e", namespace="team-a")
    )
    assert fake.deleted == [JOB] and fake.faults["delete"] == []
    # a refusal of one kind only: the kind this service account may use was read, no warning
    fake = kube(outcome=None, faults={"get": [_api_error(403)]})
    fake.put("pytorchjobs", build_job(_spec(), "pytorchjob"))
    capsys.readouterr()
    _run_in_process(
        _executor_input(tmp_path / "q", _final_status("FAILED"), run_id=RUN, exp="e", namespace="team-a")
    )
    assert fake.deleted == [JOB] and "warning" not in capsys.readouterr().out
