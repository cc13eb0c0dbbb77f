"""The train step: ``rloo train`` on the plan's training config, on this pod's GPUs (one node) or as a
multi-node job (a Kubeflow Trainer ``TrainJob`` or a training-operator ``PyTorchJob``) that this step launches
from a CPU pod and follows.

Every node runs the same command, :mod:`rloo.stages.node`: download the SFT model, launch ``rloo train`` with
the plan's config plus the pod-local locations, upload the result from node 0. A retried attempt resumes from
the run's checkpoints; one after a failure no retry heals stops at once (:mod:`rloo.stages.retry`).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rloo.errors import UserError
from rloo.k8s.builders import SA_TOKEN_PATH
from rloo.stages import constants
from rloo.stages.context import StepResult
from rloo.stages.layout import RunLayout
from rloo.stages.node import POD_LOCAL_FIELDS
from rloo.stages.plan import PipelinePlan

if TYPE_CHECKING:
    from rloo.k8s.builders import OwnerPod, TrainJobSpec
    from rloo.k8s.platform import Platform

# The namespace of the pod this runs in (the multi-node job goes there unless the plan names another), next to
# the service-account token Kubernetes mounts
SA_NAMESPACE_FILE = f"{SA_TOKEN_PATH}/namespace"


def node_args(
    plan: PipelinePlan, layout: RunLayout, *, sft_uri: str, nproc_per_node: int, num_nodes: int
) -> list[str]:
    """The arguments of :mod:`rloo.stages.node` for this run: the same on every node and both backends."""
    for name in sorted(POD_LOCAL_FIELDS & plan.train.keys()):
        raise UserError(f"--{name} is set by the pipeline itself; remove it from the training configuration.")
    return [
        "--sft_uri", sft_uri,
        "--model_uri", layout.model,
        "--checkpoint_uri", layout.checkpoints,
        "--nproc_per_node", str(nproc_per_node),
        "--num_nodes", str(num_nodes),
        "--train_config", json.dumps(plan.train, sort_keys=True),
    ]  # fmt: skip


def granted_gpus(gpu_limit: str, gpu_resource: str, cpu: str, memory: str) -> int:
    """The GPUs this pod trains on (:func:`rloo.k8s.resources.gpus_granted`); fewer than it asked for exits 1,
    which KFP retries: the retried pod may land on a node that grants them."""
    import torch

    from rloo.k8s.resources import gpus_granted

    try:
        gpu_count = gpus_granted(gpu_limit, gpu_resource, torch.cuda.device_count())
    except UserError as e:
        print(f"[rloo] {e}", file=sys.stderr)
        raise SystemExit(1) from None
    print(f"[rloo] pod: {gpu_count} x {gpu_resource}, cpu {cpu}, memory {memory}", flush=True)
    return gpu_count


@contextmanager
def work_dir() -> Iterator[str]:
    """The single-node step's local work directory: ``RLOO_WORK_DIR``, kept after the step (local runs), else a
    temporary one, removed after."""
    kept = os.environ.get("RLOO_WORK_DIR")
    work = kept or tempfile.mkdtemp(prefix="rloo-train-")
    try:
        yield work
    finally:
        if not kept:
            shutil.rmtree(work, ignore_errors=True)


def run_single_node(
    plan: PipelinePlan, run_id: str, *, sft: dict[str, Any], gpu_count: int, work: str
) -> StepResult:
    """Train on this pod's ``gpu_count`` GPUs from the SFT model ``sft`` (the fetch step's record) with
    ``work`` as the local work directory; the result's output is the trained model's URI, its model the
    trained Model artifact's metadata, its record the training's output directory (``<work>/output``)."""
    from rloo.stages import node

    layout = RunLayout(plan.run.output_uri, run_id)
    argv = node_args(plan, layout, sft_uri=sft["uri"], nproc_per_node=gpu_count, num_nodes=1)
    rc = node.main([*argv, "--work_dir", work])
    if rc != 0:
        raise SystemExit(rc)
    model = {"uri": layout.model, "sft_manifest_digest": sft.get("manifest_digest", "")}
    return StepResult(output=layout.model, model=model, record=Path(work) / "output")


def multinode_spec(
    plan: PipelinePlan,
    *,
    run_id: str,
    run_name: str,
    sft_uri: str,
    namespace: str,
    image: str,
    owner: OwnerPod | None = None,
    scratch_size: str = "",
    pod_platform: Platform | None = None,
) -> TrainJobSpec:
    """The multi-node job's :class:`rloo.k8s.builders.TrainJobSpec` for the plan: the train step and
    ``rloo pipeline manifest`` both build it here, so the printed job is the one the step creates. ``owner``:
    the launcher pod, when known; ``scratch_size``: the pods' scratch emptyDir (default: the train step's,
    ``RLOO_SCRATCH_TRAIN`` where this runs); ``pod_platform``: the cluster's pull secrets, environment and CA
    bundle (default: the ones the upload gave this step, ``RLOO_PLATFORM``)."""
    from rloo.k8s import builders, platform

    cluster = plan.cluster
    layout = RunLayout(plan.run.output_uri, run_id)
    if not layout.checkpoints.startswith("s3://"):
        raise UserError(
            f"multi-node training needs an s3:// output_uri (got {plan.run.output_uri!r}): restarted pods "
            "resume from the run's checkpoints there."
        )
    if pod_platform is None:
        pod_platform = platform.from_env(os.environ)
    volumes, mounts = platform.job_volumes(pod_platform)
    nproc = builders.nproc_per_node(cluster.gpu_count)
    command = ["python", "-m", "rloo.stages.node"]
    command += node_args(plan, layout, sft_uri=sft_uri, nproc_per_node=nproc, num_nodes=cluster.num_nodes)
    return builders.TrainJobSpec(
        name=builders.job_name(run_id),
        namespace=namespace,
        image=image,
        command=command,
        num_nodes=cluster.num_nodes,
        gpus_per_node=cluster.gpu_count,
        gpu_resource=cluster.gpu_resource,
        cpu=cluster.train_cpu,
        memory=cluster.train_memory,
        shm_size=constants.SHM_SIZE,
        service_account=cluster.train_service_account,
        env={**pod_platform.all_env(), **plan.run_env(run_id, run_name)},
        secret_env=constants.secret_env(
            s3_secret=cluster.s3_secret,
            mlflow_secret=cluster.mlflow_secret,
            hf_secret=cluster.hf_secret,
            judge_secret=cluster.judge_secret,
            s3_optional=pod_platform.s3_workload_identity,
        ),
        # the GPU taint every pool of the common providers carries, then the pools' own (gpu_tolerations): the
        # single-node steps get the same two (pipelines/rloo_pipeline.py)
        tolerations=[dict(constants.GPU_TOLERATION), *(dict(t) for t in cluster.gpu_tolerations)],
        node_selector={str(k): str(v) for k, v in cluster.gpu_node_selector.items()},
        active_deadline_seconds=constants.TRAIN_TIMEOUT_S,
        queue_name=cluster.queue_name,
        priority_class=cluster.priority_class,
        istio_sidecar=cluster.istio_sidecar,
        owner=owner,
        scratch_size=scratch_size or constants.scratch_size("train"),  # the launcher's: fixed at compile time
        image_pull_secrets=pod_platform.image_pull_secrets,
        extra_volumes=volumes,
        extra_mounts=mounts,
    )


def job_manifest(plan: PipelinePlan, spec: TrainJobSpec) -> dict[str, Any]:
    """The job of the plan's backend (``multinode_backend``) for ``spec``."""
    from rloo.k8s.builders import build_job

    return build_job(spec, plan.cluster.multinode_backend, plan.cluster.training_runtime)


def train_on_cluster(
    plan: PipelinePlan, run_id: str, run_name: str, *, sft: dict[str, Any], image: str, scratch_size: str
) -> StepResult:
    """Create (or adopt) the run's multi-node job, owned by this pod (the downward API gives its name and
    uid, so deleting the pod deletes the job), follow it to the end; the result's output is the trained
    model's URI. A retried launcher adopts the job if it still runs. A job Kueue does not admit within
    ``admission_timeout_s`` fails the step (exit 75; 2 when the queue cannot admit it at all: see
    :mod:`rloo.k8s.jobs`)."""
    from rloo.k8s.builders import owner_from_env
    from rloo.k8s.jobs import run_multi_node

    layout = RunLayout(plan.run.output_uri, run_id)
    spec = multinode_spec(
        plan,
        run_id=run_id,
        run_name=run_name,
        sft_uri=sft["uri"],
        namespace=plan.cluster.namespace or Path(SA_NAMESPACE_FILE).read_text().strip(),
        image=image,  # the compile-time train image: the same one the single-node step uses
        owner=owner_from_env(os.environ),
        scratch_size=scratch_size,
    )
    run_multi_node(
        job_manifest(plan, spec),
        timeout_s=constants.TRAIN_TIMEOUT_S,
        admission_timeout_s=plan.cluster.admission_timeout_s,  # a job Kueue never admits fails in time
    )
    return StepResult(output=layout.model, model={"uri": layout.model, "num_nodes": plan.cluster.num_nodes})
