"""Pipeline-wide constants: secret keys, GPU scheduling, timeouts and retry policies (one place)."""

from __future__ import annotations

from rloo.pipeline.resources import StepResources
from rloo.pipeline.trainjob import SecretEnv

PIPELINE_NAME = "rloo-rlhf"

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
# I/O steps (object storage, Hub, registry) retry transient failures with exponential backoff.
IO_RETRIES = 3
IO_BACKOFF = "60s"
IO_BACKOFF_FACTOR = 2.0
IO_BACKOFF_MAX = "600s"


def secret_env(*, s3_secret: str, mlflow_secret: str, hf_secret: str) -> list[SecretEnv]:
    """The secrets of a training pod as env entries (MLflow and HF optional: a run may use neither)."""
    out = [SecretEnv(env, s3_secret, key) for key, env in S3_SECRET_KEYS.items()]
    out += [SecretEnv(env, mlflow_secret, key, optional=True) for key, env in MLFLOW_SECRET_KEYS.items()]
    out += [SecretEnv(env, hf_secret, key, optional=True) for key, env in HF_SECRET_KEYS.items()]
    return out
