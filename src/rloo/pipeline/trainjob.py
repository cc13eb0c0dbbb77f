"""The multi-node training job as a Kubeflow training-operator ``PyTorchJob`` manifest (a pure function).

Why ``PyTorchJob`` (``kubeflow.org/v1``) rather than Trainer v2's ``TrainJob``: a ``TrainJob`` only runs
against a ``ClusterTrainingRuntime`` that a cluster admin installs separately, and its API is still
``v1alpha1``; ``PyTorchJob`` is self-contained (every field the pods need is in the manifest, so it is
reviewable and testable here) and is what the training operator shipped with Kubeflow 1.x platforms runs.
The operator sets ``PET_NNODES``/``PET_NODE_RANK``/``PET_MASTER_ADDR``/... on every pod, which ``torchrun``
reads, so the command (:mod:`rloo.pipeline.node`) is the same on every node.

The pods run restricted: as the images' non-root uid, no privilege escalation, no capabilities, the runtime's
seccomp profile, and no service-account token (they talk to object storage and MLflow, never to the
Kubernetes API), under a named service account (``train_service_account``).

A preempted pod restarts (``restartPolicy: OnFailure``) and ``rloo train`` resumes from the newest complete
checkpoint under ``--checkpoint_uri``, which therefore must be object storage, not a pod-local path.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from rloo.errors import UserError
from rloo.pipeline.resources import check_pod_memory, check_service_account, cpu_millis

API_VERSION = "kubeflow.org/v1"
KIND = "PyTorchJob"
CONTAINER_NAME = "pytorch"  # the training operator finds the training container by this name
_DNS1123 = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


@dataclass(frozen=True)
class SecretEnv:
    """Environment variable ``env`` read from key ``key`` of Kubernetes secret ``secret``."""

    env: str
    secret: str
    key: str
    optional: bool = False


@dataclass(frozen=True)
class TrainJobSpec:
    """Typed inputs of :func:`build_pytorchjob`."""

    name: str
    namespace: str
    image: str
    train_args: list[str]
    sft_uri: str
    model_uri: str
    checkpoint_uri: str
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

    def validate(self) -> None:
        if not _DNS1123.match(self.name) or len(self.name) > 63:
            raise UserError(
                f"training job name {self.name!r} is not a valid Kubernetes name (a-z, 0-9, '-')."
            )
        if self.num_nodes < 2:
            raise UserError(
                f"a PyTorchJob is for num_nodes >= 2 (got {self.num_nodes}); 1 node runs in the step."
            )
        if self.gpus_per_node < 0:
            raise UserError(f"gpu_count must be >= 0 (got {self.gpus_per_node}).")
        if not self.checkpoint_uri.startswith("s3://"):
            raise UserError(
                f"checkpoint_uri must be s3://... for multi-node training (got {self.checkpoint_uri!r}): restarted "
                "pods resume from it."
            )
        cpu_millis("train_cpu", self.cpu)
        check_pod_memory("train_memory", self.memory, self.shm_size)
        check_service_account("train_service_account", self.service_account)
        if self.run_as_user < 1:
            raise UserError(f"the training pods must not run as root (run_as_user={self.run_as_user}).")
        for flag in ("--checkpoint_uri", "--model_name_or_path", "--output_dir"):
            if flag in self.train_args:
                raise UserError(f"{flag} is set by the job itself; remove it from the training arguments.")


def build_pytorchjob(spec: TrainJobSpec) -> dict[str, Any]:
    """The ``PyTorchJob`` manifest: one Master and ``num_nodes - 1`` Workers, identical pods, each running
    ``torchrun`` with ``gpus_per_node`` processes (1 on CPU-only pods)."""
    spec.validate()
    nproc = max(spec.gpus_per_node, 1)
    # rloo.pipeline.node: download the SFT model, torchrun 'rloo train', upload the result from node 0
    command = [
        "python",
        "-m",
        "rloo.pipeline.node",
        "--sft_uri",
        spec.sft_uri,
        "--model_uri",
        spec.model_uri,
        "--checkpoint_uri",
        spec.checkpoint_uri,
        "--nproc_per_node",
        str(nproc),
        "--num_nodes",
        str(spec.num_nodes),
        "--",
        *spec.train_args,
    ]
    env: list[dict[str, Any]] = [{"name": k, "value": v} for k, v in sorted(spec.env.items())]
    env += [
        {
            "name": s.env,
            "valueFrom": {"secretKeyRef": {"name": s.secret, "key": s.key, "optional": s.optional}},
        }
        for s in spec.secret_env
    ]
    resources: dict[str, str] = {"cpu": spec.cpu, "memory": spec.memory}
    if spec.gpus_per_node > 0:
        resources[spec.gpu_resource] = str(spec.gpus_per_node)
    container = {
        "name": CONTAINER_NAME,
        "image": spec.image,
        "command": command,
        "env": env,
        # requests == limits: GPUs cannot be overcommitted, and equal CPU/memory gives Guaranteed QoS (the
        # last pods evicted under node pressure).
        "resources": {"requests": dict(resources), "limits": dict(resources)},
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],
        # the "restricted" Pod Security Standard
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "runAsNonRoot": True,
            "capabilities": {"drop": ["ALL"]},
        },
    }
    pod_spec: dict[str, Any] = {
        "serviceAccountName": spec.service_account,
        # nothing in the pod calls the Kubernetes API: no token to steal from it
        "automountServiceAccountToken": False,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": spec.run_as_user,
            "runAsGroup": spec.run_as_group,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [container],
        # NCCL and DataLoader workers use /dev/shm; the container runtime default is 64 MiB.
        "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": spec.shm_size}}],
        "tolerations": [dict(t) for t in spec.tolerations],
        "nodeSelector": dict(spec.node_selector),
    }
    labels = {"app.kubernetes.io/name": "rloo-train", **spec.labels}

    def replica(n: int) -> dict[str, Any]:
        return {
            "replicas": n,
            "restartPolicy": "OnFailure",
            "template": {"metadata": {"labels": dict(labels)}, "spec": pod_spec},
        }

    run_policy: dict[str, Any] = {"backoffLimit": spec.backoff_limit, "cleanPodPolicy": "Running"}
    if spec.active_deadline_seconds is not None:
        run_policy["activeDeadlineSeconds"] = spec.active_deadline_seconds
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": spec.name, "namespace": spec.namespace, "labels": dict(labels)},
        "spec": {
            "nprocPerNode": str(nproc),
            "runPolicy": run_policy,
            "pytorchReplicaSpecs": {"Master": replica(1), "Worker": replica(spec.num_nodes - 1)},
        },
    }


def job_name(run_id: str) -> str:
    """A valid, deterministic PyTorchJob name for a pipeline run (a retried step finds its own job)."""
    slug = re.sub(r"[^a-z0-9-]+", "-", run_id.lower()).strip("-")
    return ("rloo-train-" + slug)[:63].rstrip("-") or "rloo-train"
