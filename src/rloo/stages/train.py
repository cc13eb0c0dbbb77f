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
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rloo.errors import UserError
from rloo.k8s.builders import SA_TOKEN_PATH
from rloo.stages import constants
from rloo.stages.layout import RunLayout
from rloo.stages.node import POD_LOCAL_FIELDS
from rloo.stages.plan import StagePlan
from rloo.stages.retry import give_up_on_user_errors

if TYPE_CHECKING:
    from rloo.k8s.builders import OwnerPod, TrainJobSpec
    from rloo.k8s.platform import Platform

# The namespace of the pod this runs in (the multi-node job goes there unless the plan names another), next to
# the service-account token Kubernetes mounts
SA_NAMESPACE_FILE = f"{SA_TOKEN_PATH}/namespace"


def node_args(
    plan: StagePlan, layout: RunLayout, *, sft_uri: str, nproc_per_node: int, num_nodes: int
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


def run_single_node(plan: StagePlan, run_id: str, *, sft_uri: str, gpu_count: int, work: str) -> str:
    """Train on this pod's ``gpu_count`` GPUs with ``work`` as the local work directory (the output lands in
    ``<work>/output``); returns the trained model's URI."""
    from rloo.stages import node

    layout = RunLayout(plan.run.output_uri, run_id)
    with give_up_on_user_errors(layout.root, "train"):
        argv = node_args(plan, layout, sft_uri=sft_uri, nproc_per_node=gpu_count, num_nodes=1)
        rc = node.main([*argv, "--work_dir", work])
        if rc != 0:
            raise SystemExit(rc)
    return layout.model


def multinode_spec(
    plan: StagePlan,
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


def job_manifest(plan: StagePlan, spec: TrainJobSpec) -> dict[str, Any]:
    """The job of the plan's backend (``multinode_backend``) for ``spec``."""
    from rloo.k8s.builders import build_job

    return build_job(spec, plan.cluster.multinode_backend, plan.cluster.training_runtime)


def run_multi_node(
    plan: StagePlan, run_id: str, run_name: str, *, sft_uri: str, image: str, scratch_size: str
) -> str:
    """Create (or adopt) the run's multi-node job, owned by this pod (the downward API gives its name and
    uid, so deleting the pod deletes the job), follow it to the end; returns the trained model's URI. A job
    Kueue does not admit within ``admission_timeout_s`` fails the step (exit 75; 2 when the queue cannot admit
    it at all: see :mod:`rloo.k8s.jobs`)."""
    from rloo.k8s.builders import owner_from_env
    from rloo.k8s.jobs import run_multi_node as run_job

    layout = RunLayout(plan.run.output_uri, run_id)
    # a retried launcher adopts the job if it still runs; one after a failure for good stops at once
    with give_up_on_user_errors(layout.root, "train-multinode"):
        spec = multinode_spec(
            plan,
            run_id=run_id,
            run_name=run_name,
            sft_uri=sft_uri,
            namespace=plan.cluster.namespace or Path(SA_NAMESPACE_FILE).read_text().strip(),
            image=image,  # the compile-time train image: the same one the single-node step uses
            owner=owner_from_env(os.environ),
            scratch_size=scratch_size,
        )
        run_job(
            job_manifest(plan, spec),
            timeout_s=constants.TRAIN_TIMEOUT_S,
            admission_timeout_s=plan.cluster.admission_timeout_s,  # a job Kueue never admits fails in time
        )
    return layout.model
