"""The multi-node training job, as a pure function: a Kubeflow Trainer v2 ``TrainJob`` (the default) or a
training-operator v1 ``PyTorchJob`` (``multinode_backend=pytorchjob``, for clusters that still run it).

``TrainJob`` (``trainer.kubeflow.org/v1alpha1``) is what new Kubeflow clusters install; the Training Operator v1
(``kubeflow.org/v1``) is the legacy line. A ``TrainJob`` runs against a (Cluster)TrainingRuntime a cluster admin
installs (default ``torch-distributed``, which Trainer installs with itself): ``spec.trainer`` carries the image,
command, environment, node count and per-node resources, and a ``runtimePatches`` entry the rest of what the
pods need (``/dev/shm``, node selector, tolerations, service account, security contexts, labels). Both
operators set ``PET_NNODES``/``PET_NODE_RANK``/``PET_MASTER_ADDR``/... on every pod, which ``torchrun`` reads,
so one command runs on every node and on both backends.

The command is the caller's (:attr:`TrainJobSpec.command`): this module knows how to run a container on
``num_nodes`` nodes with ``gpus_per_node`` GPUs each, not what the container does. A caller that starts
``torchrun`` itself gives it :func:`nproc_per_node` processes per node, the number the job declares.

The pods run restricted: as the images' non-root uid, no privilege escalation, no capabilities, the runtime's
seccomp profile, and no service-account token (they talk to object storage and MLflow, never to the
Kubernetes API), under a named service account (``train_service_account``). A ``TrainJob``'s pod patch cannot
set ``automountServiceAccountToken`` (Trainer v2.3.0's ``PodSpecPatch`` has no such field), so the training
container mounts an empty directory at the token's path instead: the ServiceAccount admission controller
mounts the token into no container that already has a mount there.

A preempted pod is restarted (the ``PyTorchJob``'s ``restartPolicy: OnFailure``; a ``TrainJob``'s Job
template comes from its runtime, whose Kubernetes Job retries the pod) with the same command: resuming from
where it was is the command's business, from storage that outlives the pod (the pods' disk is an emptyDir).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rloo.errors import UserError
from rloo.k8s.names import is_dns1123_label
from rloo.k8s.resources import check_pod_memory, check_scheduling, check_service_account, cpu_millis

API_VERSION = "kubeflow.org/v1"
KIND = "PyTorchJob"
CONTAINER_NAME = "pytorch"  # the training operator finds the training container by this name

TRAINJOB_API_VERSION = "trainer.kubeflow.org/v1alpha1"
TRAINJOB_KIND = "TrainJob"
# The replicated job and container of Trainer's torch runtimes that run the training (Trainer's "node"): a
# runtime patch must name ones the runtime has.
TRAINJOB_NODE = "node"
DEFAULT_RUNTIME = "torch-distributed"
RUNTIME_PATCH_MANAGER = "rloo-kfp.github.io/train"
BACKENDS = ("trainjob", "pytorchjob")
DEFAULT_BACKEND = "trainjob"
# Where the ServiceAccount admission controller mounts the API token (see the module docstring).
SA_TOKEN_PATH = "/var/run/secrets/kubernetes.io/serviceaccount"
# Scratch space of the training pods, on the node's disk: /tmp, where the command stages what it downloads and
# writes (models, the newest local checkpoint: far more than a container's writable layer should hold), is an
# emptyDir instead of that layer. The pipeline's own steps mount the same.
SCRATCH_VOLUME = "scratch"
SCRATCH_PATH = "/tmp"
# Kueue's labels: the LocalQueue a job is submitted to, and its WorkloadPriorityClass.
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"
ISTIO_INJECT = "sidecar.istio.io/inject"
# The launcher step's pod, from the downward API (fieldRef metadata.name / metadata.uid / metadata.namespace).
POD_NAME_ENV = "RLOO_POD_NAME"
POD_UID_ENV = "RLOO_POD_UID"
POD_NAMESPACE_ENV = "RLOO_POD_NAMESPACE"

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SecretEnv:
    """Environment variable ``env`` read from key ``key`` of Kubernetes secret ``secret``."""

    env: str
    secret: str
    key: str
    optional: bool = False


@dataclass(frozen=True)
class OwnerPod:
    """The train step's pod, which launches the job: the job's owner, so that Kubernetes' garbage collector
    deletes the job once that pod is deleted. The step deletes the job itself when it fails or is terminated;
    the owner covers what it cannot see: its pod killed without notice (node lost, SIGKILL) and then deleted.

    ``namespace`` is the pod's; empty means the job's own (the caller vouches for it).
    """

    name: str
    uid: str
    namespace: str = ""


def owner_from_env(env: Mapping[str, str]) -> OwnerPod | None:
    """The launcher pod from ``RLOO_POD_NAME``/``RLOO_POD_UID``/``RLOO_POD_NAMESPACE`` (the downward API),
    ``None`` unless all three are set: without its namespace the owner could not be checked to be the job's,
    and an owner in another namespace would get the job deleted at once."""
    name, uid, namespace = (env.get(k, "").strip() for k in (POD_NAME_ENV, POD_UID_ENV, POD_NAMESPACE_ENV))
    if not (name and uid and namespace):
        log.info(
            "%s, %s and %s are not all set: the job gets no owner (the step deletes it on failure)",
            POD_NAME_ENV,
            POD_UID_ENV,
            POD_NAMESPACE_ENV,
        )
        return None
    return OwnerPod(name=name, uid=uid, namespace=namespace)


@dataclass(frozen=True)
class TrainJobSpec:
    """Typed inputs of :func:`build_trainjob` and :func:`build_pytorchjob`."""

    name: str
    namespace: str
    image: str
    command: list[str]  # the training container's, the same on every node (the caller builds it)
    num_nodes: int
    gpus_per_node: int
    gpu_resource: str = "nvidia.com/gpu"
    cpu: str = "8"
    memory: str = "64Gi"
    shm_size: str = "16Gi"
    env: dict[str, str] = field(default_factory=dict)
    secret_env: list[SecretEnv] = field(default_factory=list)
    tolerations: list[dict[str, Any]] = field(default_factory=list)
    node_selector: dict[str, str] = field(default_factory=dict)
    backoff_limit: int = 3
    active_deadline_seconds: int | None = None
    labels: dict[str, str] = field(default_factory=dict)
    service_account: str = "default"
    run_as_user: int = 1000  # the project's images (images/*/Dockerfile: USER 1000)
    run_as_group: int = 1000
    owner: OwnerPod | None = None  # the launcher step's pod (see OwnerPod)
    scratch_size: str = "500Gi"  # the emptyDir at SCRATCH_PATH
    # Kueue: the LocalQueue to submit to (the job is created suspended; Kueue starts it once admitted)
    queue_name: str = ""
    # a TrainJob: a Kueue WorkloadPriorityClass (needs queue_name); a PyTorchJob: a Kubernetes PriorityClass
    priority_class: str = ""
    # Kubeflow profiles inject Istio sidecars, which break the nodes' rendezvous and keep a finished pod's Job
    # from completing (the sidecar never exits): off unless asked for
    istio_sidecar: bool = False
    # the platform's (rloo.k8s.platform): pull secrets of a private registry, extra volumes (a CA bundle)
    # and where the training container mounts them
    image_pull_secrets: tuple[str, ...] = ()
    extra_volumes: list[dict[str, Any]] = field(default_factory=list)
    extra_mounts: list[dict[str, Any]] = field(default_factory=list)

    def validate(self) -> None:
        if not is_dns1123_label(self.name):
            raise UserError(
                f"training job name {self.name!r} is not a valid Kubernetes name (a-z, 0-9, '-')."
            )
        if self.num_nodes < 2:
            raise UserError(
                f"a multi-node job is for num_nodes >= 2 (got {self.num_nodes}); 1 node runs in the step."
            )
        if self.gpus_per_node < 0:
            raise UserError(f"gpu_count must be >= 0 (got {self.gpus_per_node}).")
        cpu_millis("train_cpu", self.cpu)
        check_pod_memory("train_memory", self.memory, self.shm_size)
        check_service_account("train_service_account", self.service_account)
        if self.run_as_user < 1:
            raise UserError(f"the training pods must not run as root (run_as_user={self.run_as_user}).")
        check_scheduling(self.queue_name, self.priority_class)
        if self.owner is not None and not (self.owner.name and self.owner.uid):
            raise UserError("the job's owner pod needs a name and a uid.")


def nproc_per_node(gpus_per_node: int) -> int:
    """The processes per node the job declares (``nprocPerNode``, ``numProcPerNode``): one per GPU, and one on
    a CPU-only pod. A command that starts ``torchrun`` itself passes the same number."""
    return max(gpus_per_node, 1)


def _env(spec: TrainJobSpec) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [{"name": k, "value": v} for k, v in sorted(spec.env.items())]
    return env + [
        {
            "name": s.env,
            "valueFrom": {"secretKeyRef": {"name": s.secret, "key": s.key, "optional": s.optional}},
        }
        for s in spec.secret_env
    ]


def _resources(spec: TrainJobSpec) -> dict[str, dict[str, str]]:
    resources: dict[str, str] = {"cpu": spec.cpu, "memory": spec.memory}
    if spec.gpus_per_node > 0:
        resources[spec.gpu_resource] = str(spec.gpus_per_node)
    # requests == limits: GPUs cannot be overcommitted, and equal CPU/memory gives Guaranteed QoS (the last
    # pods evicted under node pressure).
    return {"requests": dict(resources), "limits": dict(resources)}


# the "restricted" Pod Security Standard, container and pod level
_CONTAINER_SECURITY = {
    "allowPrivilegeEscalation": False,
    "runAsNonRoot": True,
    "capabilities": {"drop": ["ALL"]},
}


def _pod_security(spec: TrainJobSpec) -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "runAsUser": spec.run_as_user,
        "runAsGroup": spec.run_as_group,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _shm_volume(spec: TrainJobSpec) -> dict[str, Any]:
    # NCCL and DataLoader workers use /dev/shm; the container runtime default is 64 MiB.
    return {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": spec.shm_size}}


def _scratch_volume(spec: TrainJobSpec) -> dict[str, Any]:
    return {"name": SCRATCH_VOLUME, "emptyDir": {"sizeLimit": spec.scratch_size}}


_SCRATCH_MOUNT = {"name": SCRATCH_VOLUME, "mountPath": SCRATCH_PATH}


def _labels(spec: TrainJobSpec) -> dict[str, str]:
    # the chart's NetworkPolicies admit the training pods to MLflow and SeaweedFS by this label
    return {"app.kubernetes.io/name": "rloo-train", **spec.labels}


def _metadata(spec: TrainJobSpec, labels: dict[str, str]) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": spec.name}
    if spec.namespace:  # empty: 'kubectl apply -n' decides (rloo pipeline manifest)
        meta["namespace"] = spec.namespace
    if spec.queue_name:
        labels = {**labels, QUEUE_LABEL: spec.queue_name}
    meta["labels"] = labels
    owners = _owner_references(spec)
    if owners:
        meta["ownerReferences"] = owners
    return meta


def _owner_references(spec: TrainJobSpec) -> list[dict[str, Any]]:
    owner = spec.owner
    if owner is None:
        return []
    if owner.namespace and owner.namespace != spec.namespace:
        # the garbage collector looks for a namespaced owner in the dependent's namespace only: finding none
        # there, it would delete the job at once
        log.warning(
            "the job runs in namespace %r, the train step in %r: no owner reference, the step deletes the job "
            "itself when it fails or is terminated",
            spec.namespace,
            owner.namespace,
        )
        return []
    # not a controller and not blocking: the pod only decides the job's lifetime, and deleting the pod must
    # not wait for the job's (Foreground) deletion
    ref = {"apiVersion": "v1", "kind": "Pod", "name": owner.name, "uid": owner.uid}
    return [ref | {"blockOwnerDeletion": False, "controller": False}]


def _pod_metadata(spec: TrainJobSpec) -> dict[str, Any]:
    meta: dict[str, Any] = {"labels": _labels(spec)}
    if not spec.istio_sidecar:
        meta["annotations"] = {ISTIO_INJECT: "false"}
    return meta


def build_pytorchjob(spec: TrainJobSpec) -> dict[str, Any]:
    """The ``PyTorchJob`` manifest: one Master and ``num_nodes - 1`` Workers, identical pods, each running
    ``torchrun`` with ``gpus_per_node`` processes (1 on CPU-only pods)."""
    spec.validate()
    container = {
        "name": CONTAINER_NAME,
        "image": spec.image,
        "command": list(spec.command),
        "env": _env(spec),
        "resources": _resources(spec),
        "volumeMounts": [
            {"name": "dshm", "mountPath": "/dev/shm"},
            dict(_SCRATCH_MOUNT),
            *map(dict, spec.extra_mounts),
        ],
        "securityContext": dict(_CONTAINER_SECURITY),
    }
    pod_spec: dict[str, Any] = {
        "serviceAccountName": spec.service_account,
        # nothing in the pod calls the Kubernetes API: no token to steal from it
        "automountServiceAccountToken": False,
        "securityContext": _pod_security(spec),
        "containers": [container],
        "volumes": [_shm_volume(spec), _scratch_volume(spec), *map(dict, spec.extra_volumes)],
        "tolerations": [dict(t) for t in spec.tolerations],
        "nodeSelector": dict(spec.node_selector),
    }
    if spec.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": s} for s in spec.image_pull_secrets]
    if spec.priority_class:
        pod_spec["priorityClassName"] = spec.priority_class

    def replica(n: int) -> dict[str, Any]:
        return {
            "replicas": n,
            "restartPolicy": "OnFailure",
            "template": {"metadata": _pod_metadata(spec), "spec": pod_spec},
        }

    run_policy: dict[str, Any] = {"backoffLimit": spec.backoff_limit, "cleanPodPolicy": "Running"}
    if spec.active_deadline_seconds is not None:
        run_policy["activeDeadlineSeconds"] = spec.active_deadline_seconds
    if spec.queue_name:
        run_policy["suspend"] = True  # Kueue admits a suspended job, then unsuspends it
    if spec.priority_class:
        run_policy["schedulingPolicy"] = {"priorityClass": spec.priority_class}
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": _metadata(spec, _labels(spec)),
        "spec": {
            "nprocPerNode": str(nproc_per_node(spec.gpus_per_node)),
            "runPolicy": run_policy,
            "pytorchReplicaSpecs": {"Master": replica(1), "Worker": replica(spec.num_nodes - 1)},
        },
    }


def runtime_ref(runtime: str) -> dict[str, str]:
    """The ``runtimeRef`` of a TrainJob for the ``training_runtime`` parameter: ``NAME`` is a
    ClusterTrainingRuntime (what Trainer installs, e.g. ``torch-distributed``), ``TrainingRuntime/NAME`` one
    in the job's namespace."""
    kind, _, name = runtime.rpartition("/")
    kind = kind or "ClusterTrainingRuntime"
    if kind not in ("ClusterTrainingRuntime", "TrainingRuntime") or not is_dns1123_label(name):
        raise UserError(
            f"training_runtime {runtime!r} is not a runtime name: give NAME (a ClusterTrainingRuntime such as "
            f"{DEFAULT_RUNTIME}) or TrainingRuntime/NAME (one in the job's namespace)."
        )
    return {"apiGroup": "trainer.kubeflow.org", "kind": kind, "name": name}


def check_multinode(backend: str, runtime: str) -> None:
    """``multinode_backend`` and ``training_runtime``: a one-line UserError for a bad value.

    MPI runtimes (Trainer's ``deepspeed-distributed``, ``mpi-*``) are refused here, before any GPU is
    allocated: they run an ``mpirun`` launcher job plus nodes that run ``sshd``, while the job's patch reaches
    only the ``node`` job and the train image has no ``sshd``, so such a job would fail once its pods start.
    Whether the runtime exists is checked at submit."""
    if backend not in BACKENDS:
        raise UserError(f"multinode_backend must be one of {', '.join(BACKENDS)} (got {backend!r}).")
    name = runtime_ref(runtime)["name"]
    if re.match(r"(deepspeed|mpi)(-|$)", name):
        raise UserError(
            f"training_runtime {runtime!r} is an MPI runtime (an mpirun launcher and sshd nodes), which this job "
            f"cannot run: use a torch runtime such as {DEFAULT_RUNTIME} (torchrun on every node); DeepSpeed is "
            "an accelerate setting of 'rloo train' here (configs/accelerate/deepspeed_zero*.yaml), not a runtime."
        )


def check_queue_backend(params: Mapping[str, Any], platform: Any) -> None:
    """``queue_name`` with ``multinode_backend=pytorchjob`` only where the platform says Kueue manages
    PyTorchJobs (``kueue.pytorchJobIntegration``): a one-line UserError otherwise.

    Kueue ships that integration disabled (kubernetes-sigs/kueue
    config/components/manager/controller_manager_config.yaml: ``kubeflow.org/pytorchjob`` is commented out of
    ``integrations.frameworks``), and a PyTorchJob created suspended for a queue that Kueue does not manage is
    never started. ``params``: the pipeline's (one node creates no job, so nothing is queued);
    ``platform``: :class:`rloo.k8s.platform.Platform`."""
    queue = str(params.get("queue_name") or "")
    if (
        not queue
        or params.get("multinode_backend") != "pytorchjob"
        or not _more_than_one(params.get("num_nodes"))
    ):
        return
    if getattr(getattr(platform, "kueue", None), "pytorchjob_integration", False):
        return
    raise UserError(
        f"queue_name {queue!r} with multinode_backend=pytorchjob: Kueue ships its kubeflow.org/pytorchjob "
        "integration disabled, and a PyTorchJob it does not manage stays suspended for ever; enable it (Kueue's "
        "configuration, integrations.frameworks: - kubeflow.org/pytorchjob) and set the platform's "
        'kueue: {"pytorchJobIntegration": true}, or use multinode_backend=trainjob.'
    )


def _more_than_one(num_nodes: Any) -> bool:
    try:
        return int(num_nodes) > 1
    except (TypeError, ValueError):
        return False  # the plan's own check names a bad num_nodes


def build_trainjob(spec: TrainJobSpec, runtime: str = DEFAULT_RUNTIME) -> dict[str, Any]:
    """The ``TrainJob`` manifest: ``num_nodes`` identical pods of the runtime's ``node`` job, each running
    ``torchrun`` with ``gpus_per_node`` processes (1 on CPU-only pods).

    ``spec.backoff_limit`` does not apply: a TrainJob cannot patch its Job's retry policy, the runtime's
    decides (Kubernetes' Job default for Trainer's ``torch-distributed``)."""
    spec.validate()
    check_scheduling(spec.queue_name, spec.priority_class, "trainjob")
    container_patch = {
        "name": TRAINJOB_NODE,
        "volumeMounts": [
            {"name": "dshm", "mountPath": "/dev/shm"},
            dict(_SCRATCH_MOUNT),
            # the token is not mounted over an existing mount (see the module docstring)
            {"name": "no-api-token", "mountPath": SA_TOKEN_PATH, "readOnly": True},
            *map(dict, spec.extra_mounts),
        ],
        "securityContext": dict(_CONTAINER_SECURITY),
    }
    pod_patch: dict[str, Any] = {
        "serviceAccountName": spec.service_account,
        "securityContext": _pod_security(spec),
        "containers": [container_patch],
        "volumes": [
            _shm_volume(spec),
            _scratch_volume(spec),
            {"name": "no-api-token", "emptyDir": {"sizeLimit": "1Mi"}},
            *map(dict, spec.extra_volumes),
        ],
        "tolerations": [dict(t) for t in spec.tolerations],
        "nodeSelector": dict(spec.node_selector),
    }
    if spec.image_pull_secrets:
        pod_patch["imagePullSecrets"] = [{"name": s} for s in spec.image_pull_secrets]
    job_patch = {
        "name": TRAINJOB_NODE,
        "template": {"spec": {"template": {"metadata": _pod_metadata(spec), "spec": pod_patch}}},
    }
    job: dict[str, Any] = {
        "runtimeRef": runtime_ref(runtime),
        "trainer": {
            "image": spec.image,
            "command": list(spec.command),
            "env": _env(spec),
            "numNodes": spec.num_nodes,
            "numProcPerNode": nproc_per_node(spec.gpus_per_node),
            "resourcesPerNode": _resources(spec),
        },
        "runtimePatches": [
            {
                "manager": RUNTIME_PATCH_MANAGER,
                "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": [job_patch]}}},
            }
        ],
    }
    if spec.active_deadline_seconds is not None:
        job["activeDeadlineSeconds"] = spec.active_deadline_seconds
    if spec.queue_name:
        job["suspend"] = True  # Kueue admits a suspended job, then unsuspends it
    labels = _labels(spec)
    if spec.priority_class:
        labels[PRIORITY_LABEL] = spec.priority_class
    return {
        "apiVersion": TRAINJOB_API_VERSION,
        "kind": TRAINJOB_KIND,
        "metadata": _metadata(spec, labels),
        "spec": job,
    }


def build_job(
    spec: TrainJobSpec, backend: str = DEFAULT_BACKEND, runtime: str = DEFAULT_RUNTIME
) -> dict[str, Any]:
    """The multi-node job of ``backend`` (``multinode_backend``): what the train step creates."""
    check_multinode(backend, runtime)
    return build_trainjob(spec, runtime) if backend == "trainjob" else build_pytorchjob(spec)


def job_name(run_id: str) -> str:
    """A valid, deterministic job name for a pipeline run (a retried step finds its own job)."""
    slug = re.sub(r"[^a-z0-9-]+", "-", run_id.lower()).strip("-")
    return ("rloo-train-" + slug)[:63].rstrip("-") or "rloo-train"
