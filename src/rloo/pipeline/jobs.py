"""The train step's multi-node job on the cluster: create it (or adopt it when a retried step finds it), stream
its rank-0 log, and return or raise with the operator's reason.

The job's manifest comes from :mod:`rloo.pipeline.trainjob`; this module only talks to the Kubernetes API.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

log = logging.getLogger(__name__)


# Labels the training operator puts on a PyTorchJob's pods (kubeflow/training-operator v1).
JOB_NAME_LABEL = "training.kubeflow.org/job-name"
REPLICA_TYPE_LABEL = "training.kubeflow.org/replica-type"
# The terminal conditions: a PyTorchJob's (training operator v1) and a TrainJob's (Trainer v2).
_TERMINAL = {"Succeeded": "succeeded", "Complete": "succeeded", "Failed": "failed"}
# The step of a TrainJob whose log the train step streams: node 0, which the rank-0 processes run on.
TRAINJOB_LOG_STEP = "node-0"


def job_outcome(job: dict[str, Any]) -> tuple[str, str]:
    """``("succeeded" | "failed" | "running", reason)`` from a PyTorchJob's or TrainJob's status conditions.

    The operators append conditions (PyTorchJob: Created, Running, Restarting, Succeeded, Failed; TrainJob:
    Suspended, Complete, Failed, ...); the newest true terminal one decides, and its reason and message are
    what the user needs to see.
    """
    conds = [c for c in (job.get("status") or {}).get("conditions") or [] if c.get("status") == "True"]
    conds.sort(key=lambda c: str(c.get("lastTransitionTime") or c.get("lastUpdateTime") or ""))
    for cond in reversed(conds):
        state = _TERMINAL.get(str(cond.get("type")))
        if state:
            why = ": ".join(x for x in (cond.get("reason"), cond.get("message")) if x) or cond["type"]
            return state, " ".join(str(why).split())
    return "running", ""


def on_existing_job(job: dict[str, Any]) -> str:
    """What a (retried) step does with this run's job that it finds already there: ``wait`` for a running or
    finished one, ``replace`` a failed one (the new job resumes from the checkpoints in object storage)."""
    return "replace" if job_outcome(job)[0] == "failed" else "wait"


def run_multi_node(
    manifest: dict[str, Any], *, poll_seconds: float = 30.0, timeout_s: int | None = None
) -> None:
    """Create the multi-node job (or adopt it when a retried step finds it; replace it when it had failed),
    stream its rank-0 node's log into this step's log, and return when it succeeds; raise with the
    operator's reason when it fails.

    Thin on purpose: the job comes from :func:`rloo.pipeline.trainjob.build_job`, decisions from
    :func:`job_outcome` and :func:`on_existing_job`. A ``TrainJob`` is followed with the Kubeflow SDK; a
    ``PyTorchJob``, which that SDK does not handle, with the Kubernetes client.
    """
    from rloo.pipeline.constants import TRAIN_TIMEOUT_S
    from rloo.pipeline.trainjob import TRAINJOB_KIND

    if manifest["kind"] == TRAINJOB_KIND:
        _run_trainjob(manifest, poll_seconds=poll_seconds, timeout_s=timeout_s or TRAIN_TIMEOUT_S)
    else:
        _run_pytorchjob(manifest, poll_seconds=poll_seconds)


def _trainer_client(namespace: str) -> Any:
    """The Kubeflow SDK's TrainerClient for ``namespace`` (in-cluster credentials in the step's pod)."""
    from kubeflow.common.types import KubernetesBackendConfig
    from kubeflow.trainer import TrainerClient

    # The client first reads Trainer's version ConfigMap in the control plane's namespace, which this step
    # may not (its Role is in the pipeline's namespace), and only warns about it: not worth a warning here.
    sdk_log = logging.getLogger("kubeflow.trainer.backends.kubernetes.backend")
    level = sdk_log.level
    sdk_log.setLevel(logging.ERROR)
    try:
        return TrainerClient(backend_config=KubernetesBackendConfig(namespace=namespace))
    finally:
        sdk_log.setLevel(level)


def _run_trainjob(manifest: dict[str, Any], *, poll_seconds: float, timeout_s: int) -> None:
    """A TrainJob through the Kubeflow SDK: ``wait_for_job_status``, ``get_job``/``get_job_logs`` (node 0's
    log) and ``delete_job``. Two calls are made with the SDK's own API client instead, because the SDK cannot
    express them: creating *this* manifest (``TrainerClient.train`` assembles its own TrainJob from typed
    options, so what ``rloo pipeline manifest`` prints and the tests validate against the CRD would not be
    what is created), and reading a job's conditions (the SDK's ``TrainJob`` keeps the status name, not the
    controller's reason)."""
    import threading

    from kubernetes.client.rest import ApiException

    trainer = _trainer_client(manifest["metadata"]["namespace"])
    api = trainer.backend.custom_api
    group, version = manifest["apiVersion"].split("/")
    ns, name = manifest["metadata"]["namespace"], manifest["metadata"]["name"]
    plural = "trainjobs"
    what = f"TrainJob {ns}/{name}"

    def get() -> dict[str, Any]:
        return api.get_namespaced_custom_object(group, version, ns, plural, name)

    try:
        api.create_namespaced_custom_object(group, version, ns, plural, manifest)
        print(f"[rloo] created {what}", flush=True)
    except ApiException as e:
        if e.status != 409:
            raise
        if on_existing_job(get()) == "replace":
            print(f"[rloo] {what} failed before this retry: replacing it", flush=True)
            trainer.delete_job(name)
            _wait_until_gone(get, poll_seconds)
            api.create_namespaced_custom_object(group, version, ns, plural, manifest)
        else:
            print(f"[rloo] adopting {what} (this step was retried)", flush=True)

    done = threading.Event()

    def follow_node0_log() -> None:
        seen: set[str] = set()  # pod names: a replaced node-0 pod is followed again
        while not done.is_set():
            try:
                step = next((s for s in trainer.get_job(name).steps if s.name == TRAINJOB_LOG_STEP), None)
                if step is not None and step.pod_name not in seen and step.status not in (None, "Pending"):
                    seen.add(step.pod_name)
                    for line in trainer.get_job_logs(name, follow=True, step=TRAINJOB_LOG_STEP):
                        sys.stdout.write(f"[{TRAINJOB_LOG_STEP}] {line}\n")
                        sys.stdout.flush()
            except Exception as e:  # logs are a convenience: the job's status decides the outcome
                log.warning("following %s's log: %s", TRAINJOB_LOG_STEP, e)
            done.wait(min(10.0, poll_seconds))

    threading.Thread(target=follow_node0_log, daemon=True, name="job-log").start()
    try:
        trainer.wait_for_job_status(
            name, status={"Complete"}, timeout=timeout_s, polling_interval=max(1, int(poll_seconds))
        )
    except RuntimeError as e:  # the SDK's "is Failed", or a failed read
        try:
            state, reason = job_outcome(get())
        except ApiException as gone:
            if gone.status == 404:
                raise RuntimeError(f"{what} was deleted while the step waited for it") from None
            raise
        if state == "failed":
            raise RuntimeError(f"{what} failed: {reason}") from None
        raise RuntimeError(f"waiting for {what}: {e}") from e
    finally:
        done.set()


def _wait_until_gone(get: Any, poll_seconds: float) -> None:
    """Return once ``get`` answers 404: a deleted job's name is free only once the job is gone."""
    from kubernetes.client.rest import ApiException

    while True:
        try:
            get()
        except ApiException as gone:
            if gone.status == 404:
                return
            raise
        time.sleep(min(5.0, poll_seconds))


def _run_pytorchjob(manifest: dict[str, Any], *, poll_seconds: float) -> None:
    """A PyTorchJob through the Kubernetes client (the Kubeflow SDK handles Trainer v2 TrainJobs only)."""
    import threading

    from kubernetes import client, config
    from kubernetes.client.rest import ApiException

    config.load_incluster_config()
    api, core = client.CustomObjectsApi(), client.CoreV1Api()
    group, version = manifest["apiVersion"].split("/")
    ns, name = manifest["metadata"]["namespace"], manifest["metadata"]["name"]
    plural = "pytorchjobs"

    def get() -> dict[str, Any]:
        return api.get_namespaced_custom_object(group, version, ns, plural, name)

    try:
        api.create_namespaced_custom_object(group, version, ns, plural, manifest)
        print(f"[rloo] created PyTorchJob {ns}/{name}", flush=True)
    except ApiException as e:
        if e.status != 409:
            raise
        if on_existing_job(get()) == "replace":
            print(f"[rloo] PyTorchJob {ns}/{name} failed before this retry: replacing it", flush=True)
            api.delete_namespaced_custom_object(
                group, version, ns, plural, name, body=client.V1DeleteOptions(propagation_policy="Foreground")
            )
            _wait_until_gone(get, poll_seconds)
            api.create_namespaced_custom_object(group, version, ns, plural, manifest)
        else:
            print(f"[rloo] adopting PyTorchJob {ns}/{name} (this step was retried)", flush=True)

    done = threading.Event()

    def follow_master_log() -> None:
        selector = f"{JOB_NAME_LABEL}={name},{REPLICA_TYPE_LABEL}=master"
        seen: set[tuple[str, str]] = set()  # (pod, uid): a restarted master pod is followed again
        while not done.is_set():
            try:
                for pod in core.list_namespaced_pod(ns, label_selector=selector).items:
                    key = (pod.metadata.name, pod.metadata.uid)
                    if key in seen or pod.status.phase not in ("Running", "Succeeded", "Failed"):
                        continue
                    seen.add(key)
                    stream = core.read_namespaced_pod_log(
                        pod.metadata.name, ns, follow=True, _preload_content=False
                    )
                    for line in stream.stream():
                        sys.stdout.write(f"[master] {line.decode(errors='replace')}")
                        sys.stdout.flush()
            except Exception as e:  # logs are a convenience: status polling decides the outcome
                log.warning("following the master's log: %s", e)
            done.wait(min(10.0, poll_seconds))

    threading.Thread(target=follow_master_log, daemon=True, name="job-log").start()
    try:
        while True:
            try:
                state, reason = job_outcome(get())
            except ApiException as e:
                if e.status == 404:
                    raise RuntimeError(
                        f"PyTorchJob {ns}/{name} was deleted while the step waited for it"
                    ) from None
                raise
            if state == "succeeded":
                return
            if state == "failed":
                raise RuntimeError(f"PyTorchJob {ns}/{name} failed: {reason}")
            time.sleep(poll_seconds)
    finally:
        done.set()
