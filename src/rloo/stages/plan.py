"""The plan of one pipeline run: what each step does, built once by the validate step from the pipeline
parameters, checked once, and handed to every later step as one JSON value.

A pipeline parameter is declared once, on the config field it sets (``option(..., pipeline=...)``, see
:class:`rloo.options.Exposed`): :func:`pipeline_fields` reads those declarations from the plan's parts, and the
pipeline's signature, the validate step's checks and ``pipelines/README.md``'s table all come from it.

The parts: ``run`` (the SFT model, where the run writes, its MLflow experiment: :class:`RunConfig`), ``train``
(``rloo train`` config values: :class:`rloo.config.RLOOConfig`), ``eval`` (:class:`rloo.eval.config.EvalConfig`
values), ``push`` (:class:`rloo.push.config.PushConfig` values) and ``cluster`` (pods, GPUs, the multi-node
job, secrets: :class:`ClusterConfig`). Each step reads only its own parts. ``train``/``eval``/``push`` hold
values, not configs: the pod-local fields (model directories, output directories) are only known in the step.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import typing
from dataclasses import dataclass
from typing import Any

from rloo.errors import UserError
from rloo.options import PIPELINE, Exposed, option
from rloo.stages.constants import SHM_SIZE


@dataclass(frozen=True)
class RunConfig:
    """What the run starts from and where it goes."""

    model: str = option(
        "",
        "SFT checkpoint: Hub id, s3://bucket/prefix (written by any tool; an rloo upload's manifest is "
        "checked) or a directory.",
        pipeline=Exposed("model", required=True),
    )
    model_revision: str = option(
        "",
        "Hub branch, tag or commit of a Hub id model (empty: main); the fetch resolves it to a commit and "
        "records it.",
        pipeline="model_revision",
    )
    output_uri: str = option(
        "",
        "s3://bucket/prefix; this run writes under <output_uri>/<run id>/ (sft, model, checkpoints, eval).",
        pipeline=Exposed("output_uri", required=True),
    )
    mlflow_experiment: str = option(
        "rloo",
        "MLflow experiment of the pipeline (parent) run and the stage runs.",
        pipeline="mlflow_experiment",
    )
    extra_train_args: str = option(
        "",
        "Any other 'rloo train' flags, shell-quoted (e.g. \"--bf16 --gradient_checkpointing\").",
        pipeline="extra_train_args",
    )
    judge_check: bool = option(
        True,
        "Ask the judge in the validate step, before any GPU is requested (it answers, takes judge_secret's key, "
        "serves judge_model, its context fits); false for a judge started after the run is submitted.",
        pipeline="judge_check",
    )

    def __post_init__(self) -> None:
        from rloo.storage.location import source_kind

        if self.model_revision and source_kind(self.model) != "hub":
            raise UserError(
                f"model_revision {self.model_revision!r} only applies to a Hugging Face Hub id, and model "
                f"{self.model!r} is not one: drop model_revision (an s3:// upload is already pinned by its "
                "manifest)."
            )
        if self.model_revision and self.model_revision.split() != [
            self.model_revision
        ]:  # no git ref has spaces
            raise UserError(
                f"model_revision {self.model_revision!r} is not a branch, tag or commit: drop the spaces (or "
                "leave it empty for main)."
            )
        if not self.mlflow_experiment.strip():
            raise UserError("mlflow_experiment must not be empty: it names the MLflow experiment of the run.")


@dataclass(frozen=True)
class ClusterConfig:
    """The pods: GPUs, CPU and memory, the multi-node job, the secrets they read. Checked here because KFP
    and the API server would refuse a bad value only when that step's pod is created, possibly after hours
    of training."""

    gpu_resource: str = option(
        "nvidia.com/gpu", "Kubernetes resource name of the GPUs.", pipeline="gpu_resource"
    )
    gpu_count: int = option(1, "GPUs per training node (>= 0); evaluation uses one.", pipeline="gpu_count")
    num_nodes: int = option(
        1, "Training nodes; more than one runs a multi-node job (multinode_backend).", pipeline="num_nodes"
    )
    multinode_backend: str = option(
        "trainjob",
        "The multi-node job: trainjob (Kubeflow Trainer v2 TrainJob) or pytorchjob (Training Operator v1 "
        "PyTorchJob, for older clusters).",
        pipeline="multinode_backend",
    )
    training_runtime: str = option(
        "torch-distributed",
        "Runtime a TrainJob references: NAME of a ClusterTrainingRuntime (Trainer installs torch-distributed) "
        "or TrainingRuntime/NAME in the job's namespace.",
        pipeline="training_runtime",
    )
    queue_name: str = option(
        "",
        "Kueue LocalQueue of the multi-node job (empty: not queued); the job is created suspended and Kueue "
        "starts it once admitted.",
        pipeline="queue_name",
    )
    priority_class: str = option(
        "",
        "Priority of the multi-node job: a Kueue WorkloadPriorityClass for a TrainJob (needs queue_name), a "
        "PriorityClass for a PyTorchJob.",
        pipeline="priority_class",
    )
    admission_timeout_s: int = option(
        1800,
        "Seconds the multi-node job may wait for Kueue to admit it (queue_name) before the step fails naming "
        "the queue and Kueue's reason.",
        pipeline="admission_timeout_s",
    )
    istio_sidecar: bool = option(
        False,
        "Let Istio inject its sidecar into the multi-node job's pods (Kubeflow profiles do by default; it "
        "breaks rendezvous and keeps Jobs from completing).",
        pipeline="istio_sidecar",
    )
    gpu_node_selector: dict[str, str] = option(
        {},
        'Node labels GPU pods must match, e.g. {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}.',
        pipeline="gpu_node_selector",
    )
    gpu_tolerations: list[dict[str, Any]] = option(
        [],
        "Tolerations the GPU pods (train, evaluate, the multi-node job's) get besides nvidia.com/gpu:NoSchedule "
        '(always there), e.g. [{"key": "sku", "operator": "Equal", "value": "gpu", "effect": "NoSchedule"}] '
        "for an AKS pool tainted sku=gpu.",
        pipeline="gpu_tolerations",
    )
    train_cpu: str = option(
        "16", 'CPU request and limit of each training pod (e.g. "16", "500m").', pipeline="train_cpu"
    )
    train_memory: str = option(
        "128Gi",
        'Memory request and limit of each training pod (e.g. "128Gi"); more than the 16Gi in-memory /dev/shm, '
        "which counts against it.",
        pipeline="train_memory",
    )
    eval_cpu: str = option("8", "CPU request and limit of the evaluation pod.", pipeline="eval_cpu")
    eval_memory: str = option(
        "64Gi",
        "Memory request and limit of the evaluation pod; more than the 16Gi in-memory /dev/shm.",
        pipeline="eval_memory",
    )
    train_service_account: str = option(
        "default",
        "Service account of the multi-node job's pods (they get no API token); create a dedicated one without "
        "permissions.",
        pipeline="train_service_account",
    )
    namespace: str = option(
        "", "Namespace of the multi-node job (default: the pipeline's own).", pipeline="namespace"
    )
    s3_secret: str = option(
        "rloo-s3",
        "Kubernetes secret with AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, S3_ENDPOINT_URL.",
        pipeline="s3_secret",
    )
    mlflow_secret: str = option(
        "rloo-mlflow", "Kubernetes secret with MLFLOW_TRACKING_URI (optional).", pipeline="mlflow_secret"
    )
    hf_secret: str = option("rloo-hf", "Kubernetes secret with HF_TOKEN (optional).", pipeline="hf_secret")
    judge_secret: str = option(
        "rloo-judge", "Kubernetes secret with OPENAI_API_KEY, the judge's API key.", pipeline="judge_secret"
    )

    def __post_init__(self) -> None:
        from rloo.k8s import builders, resources

        if self.gpu_count < 0:
            raise UserError(f"gpu_count must be >= 0 (got {self.gpu_count}).")
        if self.num_nodes < 1:
            raise UserError(f"num_nodes must be >= 1 (got {self.num_nodes}).")
        if self.num_nodes > 1 and self.gpu_count < 1:
            raise UserError("num_nodes > 1 needs gpu_count >= 1 per node.")
        for name in ("train_cpu", "eval_cpu"):
            resources.cpu_millis(name, getattr(self, name))
        for name in ("train_memory", "eval_memory"):
            resources.check_pod_memory(name, getattr(self, name), SHM_SIZE)
        resources.check_service_account("train_service_account", self.train_service_account)
        for name in ("s3_secret", "mlflow_secret", "hf_secret", "judge_secret"):
            resources.check_secret_name(name, getattr(self, name))
        resources.check_resource_name("gpu_resource", self.gpu_resource)
        resources.check_node_selector("gpu_node_selector", self.gpu_node_selector)
        resources.check_tolerations("gpu_tolerations", self.gpu_tolerations)
        if self.admission_timeout_s < 1:
            raise UserError(f"admission_timeout_s must be >= 1 (got {self.admission_timeout_s}).")
        resources.check_namespace("namespace", self.namespace)
        # one node creates no job: nothing to queue
        resources.check_scheduling(
            self.queue_name, self.priority_class, self.multinode_backend if self.multinode else None
        )
        builders.check_multinode(self.multinode_backend, self.training_runtime)

    @property
    def multinode(self) -> bool:
        return self.num_nodes > 1


# The plan's parts, in the order the pipeline lists their parameters (required ones first).
def part_configs() -> dict[str, type]:
    from rloo.config import RLOOConfig
    from rloo.eval.config import EvalConfig
    from rloo.push.config import PushConfig

    return {
        "run": RunConfig,
        "train": RLOOConfig,
        "eval": EvalConfig,
        "push": PushConfig,
        "cluster": ClusterConfig,
    }


# KFP has no None: an optional field the pipeline exposes without a default of its own gets its type's empty
# value, which means unset
_EMPTY: dict[type, Any] = {str: "", int: 0, float: 0.0}


@dataclass(frozen=True)
class PipelineField:
    """One pipeline parameter and the config field it sets."""

    part: str  # the plan part (a key of part_configs())
    field: str  # the config field
    name: str  # the pipeline parameter
    type: type  # str, int, float, bool or dict: the KFP type
    default: Any  # None when required
    required: bool
    help: str
    optional: bool  # the field takes None: the parameter's empty value (default) means None

    def field_value(self, value: Any) -> Any:
        """The config field's value for the parameter's ``value``."""
        if self.optional and value == self.default and self.default == _EMPTY.get(self.type, ...):
            return None
        return value


def _base_type(hint: Any) -> tuple[type, bool]:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    optional = len(args) < len(typing.get_args(hint))
    base = args[0] if optional else hint
    return typing.get_origin(base) or base, optional


@functools.cache  # the declarations are fixed; the validate step reads them part by part
def pipeline_fields() -> tuple[PipelineField, ...]:
    """Every pipeline parameter, from the config fields that declare one: required ones first, then by part
    and field order."""
    out = []
    for part, cls in part_configs().items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            exposed = f.metadata.get(PIPELINE)
            if exposed is None:
                continue
            kind, optional = _base_type(hints[f.name])
            if exposed.has_default:
                default = exposed.default
            elif f.default_factory is not dataclasses.MISSING:
                default = f.default_factory()
            else:
                default = _EMPTY[kind] if f.default is None else f.default
            out.append(
                PipelineField(
                    part=part,
                    field=f.name,
                    name=exposed.name,
                    type=kind,
                    default=None if exposed.required else default,
                    required=exposed.required,
                    help=exposed.help or str(f.metadata["help"]),
                    optional=optional,
                )
            )
    return tuple(sorted(out, key=lambda p: not p.required))  # stable: part and field order within each group


def config_values(part: str, params: dict[str, Any]) -> dict[str, Any]:
    """The field values of ``part`` that the pipeline parameters ``params`` give (by parameter name; those
    absent are left out), unset optional fields as None."""
    return {
        p.field: p.field_value(params[p.name])
        for p in pipeline_fields()
        if p.part == part and p.name in params
    }


def parameter_names(part: str) -> dict[str, str]:
    """``{field: pipeline parameter}`` of ``part``: how a message about a field names it to a pipeline user."""
    return {p.field: p.name for p in pipeline_fields() if p.part == part}


@dataclass(frozen=True)
class PipelinePlan:
    """What every step of one run does (see the module docstring): the validate step's output."""

    run: RunConfig
    cluster: ClusterConfig
    train: dict[str, Any]  # 'rloo train' config values, without the pod-local locations
    eval: dict[str, Any]  # EvalConfig values, without the models and the output directory
    push: dict[str, Any]  # PushConfig values, without the model and the run's locations

    def run_env(self, run_id: str, run_name: str) -> dict[str, str]:
        """The environment every step's (and training pod's) MLflow tracking reads: the KFP run it belongs to
        and the experiment."""
        return {
            "KFP_RUN_ID": run_id,
            "KFP_RUN_NAME": run_name,
            "MLFLOW_EXPERIMENT_NAME": self.run.mlflow_experiment,
        }

    def to_json(self) -> str:
        return json.dumps(
            {
                "run": dataclasses.asdict(self.run),
                "cluster": dataclasses.asdict(self.cluster),
                "train": self.train,
                "eval": self.eval,
                "push": self.push,
            },
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, text: str) -> PipelinePlan:
        data = json.loads(text)
        return cls(
            run=RunConfig(**data["run"]),
            cluster=ClusterConfig(**data["cluster"]),
            train=dict(data["train"]),
            eval=dict(data["eval"]),
            push=dict(data["push"]),
        )
