"""Pipeline-wide constants: secret keys, GPU scheduling, timeouts and retry policies (one place)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from rloo.k8s.builders import (
    POD_NAME_ENV,
    POD_NAMESPACE_ENV,
    POD_UID_ENV,
    SCRATCH_PATH,  # noqa: F401 - re-exported: the pipeline reads C.SCRATCH_PATH
    SCRATCH_VOLUME,  # noqa: F401 - re-exported
    SecretEnv,
)
from rloo.k8s.resources import StepResources, memory_bytes

# Keys each Kubernetes secret must hold, and the environment variable each becomes.
S3_SECRET_KEYS = {
    "AWS_ACCESS_KEY_ID": "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY": "AWS_SECRET_ACCESS_KEY",
    "S3_ENDPOINT_URL": "S3_ENDPOINT_URL",
}
# USERNAME/PASSWORD: a tracking server behind MLflow's basic-auth app (the chart's mlflow.auth); credentials
# never go in the URI (MLflow prints it). Every use of this secret is optional, key by key.
MLFLOW_SECRET_KEYS = {
    "MLFLOW_TRACKING_URI": "MLFLOW_TRACKING_URI",
    "MLFLOW_TRACKING_USERNAME": "MLFLOW_TRACKING_USERNAME",
    "MLFLOW_TRACKING_PASSWORD": "MLFLOW_TRACKING_PASSWORD",
}
HF_SECRET_KEYS = {"HF_TOKEN": "HF_TOKEN"}
JUDGE_SECRET_KEYS = {"OPENAI_API_KEY": "OPENAI_API_KEY"}
# Every Secret a step mounts, by the pipeline parameter that names it: its keys, and whether a step mounts them
# with optional: false (a missing Secret or key is then CreateContainerConfigError, which Argo does not handle:
# the pod, GPUs scheduled, waits for its deadline). The validate step mounts them all optionally and refuses
# the run in one line when a needed one is missing (rloo.stages.validate.check_secrets).
STEP_SECRETS: dict[str, tuple[dict[str, str], bool]] = {
    "s3_secret": (S3_SECRET_KEYS, True),
    "judge_secret": (JUDGE_SECRET_KEYS, True),
    "mlflow_secret": (MLFLOW_SECRET_KEYS, False),
    "hf_secret": (HF_SECRET_KEYS, False),
}

# Tolerate the taint GPU node pools commonly carry (GKE, EKS and the NVIDIA GPU operator use this key).
GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
SHM_VOLUME = "dshm"
# /dev/shm of the GPU pods (NCCL, DataLoader workers; the runtime default is 64 MiB). A constant, not a pipeline
# parameter: KFP's emptyDir mount takes no runtime value. It is memory: the pods' memory limits (train_memory,
# eval_memory) must exceed it, which the validate step checks.
SHM_SIZE = "16Gi"
# The uid and gid of the project's images (images/*/Dockerfile: USER 1000): every pod runs as them.
RUN_AS_USER = 1000
RUN_AS_GROUP = 1000

# CPU and memory of the CPU-only steps: fixed, they do not grow with the model (the GPU steps' are pipeline
# parameters). validate imports transformers and the trainer config; fetch and push stream files to and from
# object storage through a temporary directory on disk; the multi-node launcher and finish only talk to APIs.
VALIDATE_RESOURCES = StepResources("500m", "2", "1Gi", "4Gi")
FETCH_RESOURCES = StepResources("1", "2", "2Gi", "8Gi")
PUSH_RESOURCES = StepResources("1", "2", "2Gi", "16Gi")
LAUNCHER_RESOURCES = StepResources("250m", "1", "512Mi", "2Gi")
FINISH_RESOURCES = StepResources("250m", "1", "512Mi", "2Gi")

TRAIN_TIMEOUT_S = 48 * 3600
EVAL_TIMEOUT_S = 6 * 3600
IO_TIMEOUT_S = 2 * 3600
VALIDATE_TIMEOUT_S = 600
# Time an attempt may spend before its deadline starts counting: Argo starts a retry's clock when the node is
# created, the pod's activeDeadlineSeconds when the kubelet starts it, so a pod waiting for a node (a GPU node
# pool scaling up from zero, an image of tens of GB being pulled) uses the retry window but not its own deadline.
GPU_SCHEDULING_S = 3600
CPU_SCHEDULING_S = 600


@dataclass(frozen=True)
class RetryPolicy:
    """How Argo retries a step (KFP's ``set_retry``) and the deadline of each attempt (``set_timeout``).

    Argo measures ``retryStrategy.backoff.maxDuration`` from the first attempt's start: past it the node fails
    ("Max duration limit exceeded"), a retry whose backoff would end past it is not started, and a running retry
    gets that moment as its deadline (Argo's ``executionDeadline``: the wait container kills the step). So the
    window is derived, never set: every attempt at its full deadline plus its scheduling time, plus every
    backoff (``duration * factor**n`` before retry n+1). Argo reads the factor as an integer (``intstr.Int32``):
    a fractional one fails the node."""

    retries: int
    backoff_s: int
    factor: int
    timeout_s: int  # each attempt's own deadline: the pod's activeDeadlineSeconds
    scheduling_s: int  # what an attempt may wait for a node before that deadline starts counting

    def backoffs_s(self) -> list[int]:
        """The wait before each retry, in order."""
        return [self.backoff_s * self.factor**n for n in range(self.retries)]

    @property
    def max_duration_s(self) -> int:
        """Argo's ``backoff.maxDuration``: every attempt, whole, and every backoff."""
        return (self.retries + 1) * (self.timeout_s + self.scheduling_s) + sum(self.backoffs_s())


# I/O steps (object storage, Hub, registry) retry transient failures with exponential backoff: 1, 2, 4 min.
IO_RETRIES = 3
IO_BACKOFF_S = 60


def io_retry(timeout_s: int = IO_TIMEOUT_S) -> RetryPolicy:
    """The retry policy of an I/O step whose attempts each get ``timeout_s``."""
    return RetryPolicy(IO_RETRIES, IO_BACKOFF_S, 2, timeout_s, CPU_SCHEDULING_S)


# The GPU steps and the multi-node launcher: a retried train step resumes from the run's checkpoints, a
# retried launcher adopts its still-running job, a retried evaluation starts over. Fewer tries, longer waits:
# each one holds GPUs. A failure that no retry heals (exit 2: a bad value, a full disk, a non-finite loss) is
# recorded and every later attempt stops at once (rloo.stages.retry).
GPU_RETRIES = 2
GPU_BACKOFF_S = 120
TRAIN_RETRY = RetryPolicy(GPU_RETRIES, GPU_BACKOFF_S, 2, TRAIN_TIMEOUT_S, GPU_SCHEDULING_S)
EVAL_RETRY = RetryPolicy(GPU_RETRIES, GPU_BACKOFF_S, 2, EVAL_TIMEOUT_S, GPU_SCHEDULING_S)
# The launcher is a CPU pod, but it waits for the job's GPUs within its own deadline.
LAUNCHER_RETRY = RetryPolicy(GPU_RETRIES, GPU_BACKOFF_S, 2, TRAIN_TIMEOUT_S, CPU_SCHEDULING_S)

# The launcher pod, from the downward API: the multi-node job's owner (rloo.k8s.builders.OwnerPod).
POD_FIELD_ENV = {
    POD_NAME_ENV: "metadata.name",
    POD_UID_ENV: "metadata.uid",
    POD_NAMESPACE_ENV: "metadata.namespace",
}

# Scratch space of the steps that stage models on disk: /tmp (where every temporary directory of the steps,
# and KFP's own launcher files, go) is an emptyDir on the node's disk with a size limit, instead of the
# container's writable layer. /tmp rather than another path with TMPDIR pointing at it: kfp.local (rloo pipeline
# run --local) sets a task's environment but mounts no volume. The size is fixed when the pipeline is compiled:
# KFP 2.17's driver reads an emptyDir sizeLimit as a literal (k8s resource.MustParse: a pipeline parameter's
# placeholder would crash it) and the SDK has no ephemeral-storage request. Override one with
# RLOO_SCRATCH_<STEP>=<quantity> when compiling (e.g. RLOO_SCRATCH_TRAIN=1Ti rloo pipeline compile); "train"
# sizes the multi-node job's pods' too.
# SCRATCH_VOLUME and SCRATCH_PATH (rloo.k8s.builders): the same in the multi-node job's pods.
# train: the SFT model, the trained model and the newest local checkpoint (optimizer state: ~3x the weights);
# eval: the trained and the SFT model; fetch and push: one model.
DEFAULT_SCRATCH = {"fetch": "200Gi", "train": "500Gi", "eval": "300Gi", "push": "200Gi"}


def scratch_size(step: str) -> str:
    """The scratch size of ``step`` (a key of DEFAULT_SCRATCH), RLOO_SCRATCH_<STEP> applied and checked."""
    name = f"RLOO_SCRATCH_{step.upper()}"
    size = os.environ.get(name) or DEFAULT_SCRATCH[step]
    memory_bytes(name, size)  # a Kubernetes quantity, or a one-line error at compile time
    return size


def secret_env(
    *, s3_secret: str, mlflow_secret: str, hf_secret: str, judge_secret: str, s3_optional: bool = False
) -> list[SecretEnv]:
    """The secrets of a training pod as env entries (MLflow, HF and the judge's optional: a run may use none of
    them, the judge's key being read only by a run with a judge reward, --judge_reward_coef in
    extra_train_args; S3's with ``s3_optional``, where the pods' service account carries a workload identity
    the S3 client uses)."""
    out = [SecretEnv(env, s3_secret, key, optional=s3_optional) for key, env in S3_SECRET_KEYS.items()]
    out += [SecretEnv(env, mlflow_secret, key, optional=True) for key, env in MLFLOW_SECRET_KEYS.items()]
    out += [SecretEnv(env, hf_secret, key, optional=True) for key, env in HF_SECRET_KEYS.items()]
    out += [SecretEnv(env, judge_secret, key, optional=True) for key, env in JUDGE_SECRET_KEYS.items()]
    return out
