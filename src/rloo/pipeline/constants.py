"""Pipeline-wide constants: secret keys, GPU scheduling, timeouts and retry policies (one place)."""

from __future__ import annotations

from rloo.pipeline.trainjob import SecretEnv

PIPELINE_NAME = "rloo-rlhf"

# Keys each Kubernetes secret must hold, and the environment variable each becomes.
S3_SECRET_KEYS = {
    "AWS_ACCESS_KEY_ID": "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY": "AWS_SECRET_ACCESS_KEY",
    "S3_ENDPOINT_URL": "S3_ENDPOINT_URL",
}
MLFLOW_SECRET_KEYS = {"MLFLOW_TRACKING_URI": "MLFLOW_TRACKING_URI"}
HF_SECRET_KEYS = {"HF_TOKEN": "HF_TOKEN"}
JUDGE_SECRET_KEYS = {"OPENAI_API_KEY": "OPENAI_API_KEY"}

# Tolerate the taint GPU node pools commonly carry (GKE, EKS and the NVIDIA GPU operator use this key).
GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
SHM_VOLUME = "dshm"
SHM_SIZE = "16Gi"

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
