"""The train step's multi-node job: what the plan and the platform give its pods, and what it refuses."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from rloo.errors import UserError
from rloo.k8s.builders import OwnerPod
from rloo.k8s.platform import CA_DIR, CA_ENV, CABundle, Platform
from rloo.stages.plan import StagePlan
from rloo.stages.train import job_manifest, multinode_spec
from rloo.stages.validate import build_plan
from tests.stages.test_validate import good

MULTI = {"num_nodes": 2, "gpu_count": 4, "output_uri": "s3://runs/rloo", "mlflow_experiment": "exp"}


def _plan(**change: object) -> StagePlan:
    return build_plan(good(**MULTI, **change), check_paths=False)


def _spec(plan: StagePlan, platform: Platform | None = None, **kw: object) -> object:
    return multinode_spec(
        plan,
        run_id="run-1",
        run_name="my run",
        sft_uri="s3://runs/rloo/run-1/sft",
        namespace="team",
        image="registry.local/rloo-train:1",
        pod_platform=platform or Platform(),
        **kw,  # type: ignore[arg-type]
    )


def test_every_node_runs_the_node_command_on_the_plans_training_config() -> None:
    plan = _plan(rloo_k=4, extra_train_args="--bf16")
    spec = _spec(plan)
    cmd = spec.command  # type: ignore[attr-defined]
    assert cmd[:3] == ["python", "-m", "rloo.stages.node"]
    args = dict(zip(cmd[3::2], cmd[4::2], strict=True))
    assert json.loads(args["--train_config"]) == plan.train and plan.train["bf16"] is True
    assert args["--model_uri"] == "s3://runs/rloo/run-1/model"
    assert args["--checkpoint_uri"] == "s3://runs/rloo/run-1/checkpoints"  # restarted pods resume from it
    assert (args["--nproc_per_node"], args["--num_nodes"]) == ("4", "2")
    # the run's MLflow identity, as the single-node step sets it in its own process
    assert spec.env == plan.run_env("run-1", "my run")  # type: ignore[attr-defined]
    assert spec.env["MLFLOW_EXPERIMENT_NAME"] == "exp"  # type: ignore[attr-defined]


def test_the_plans_cluster_part_sets_the_pods() -> None:
    plan = _plan(train_cpu="32", train_memory="256Gi", gpu_node_selector={"pool": "h100"}, queue_name="q")
    job = job_manifest(plan, _spec(plan))
    assert job["kind"] == "TrainJob"
    trainer = job["spec"]["trainer"]
    assert trainer["numNodes"] == 2 and trainer["numProcPerNode"] == 4
    assert trainer["resourcesPerNode"]["limits"] == {"cpu": "32", "memory": "256Gi", "nvidia.com/gpu": "4"}
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "q" and job["spec"]["suspend"] is True
    assert (
        job_manifest(
            replace(plan, cluster=replace(plan.cluster, multinode_backend="pytorchjob")), _spec(plan)
        )["kind"]
        == "PyTorchJob"
    )


def test_the_platform_reaches_the_jobs_pods() -> None:
    """Pull secrets, environment and the CA bundle the upload gave the launcher (RLOO_PLATFORM) go to every pod
    of its job, next to the run's own variables."""
    platform = Platform(image_pull_secrets=("regcred",), env={"HTTPS_PROXY": "http://proxy:3128"})
    platform = replace(platform, ca_bundle=CABundle("corp-ca"))
    spec = _spec(_plan(), platform, owner=OwnerPod("launcher", "uid-1"))
    assert spec.image_pull_secrets == ("regcred",)  # type: ignore[attr-defined]
    env = spec.env  # type: ignore[attr-defined]
    assert env["HTTPS_PROXY"] == "http://proxy:3128" and env["KFP_RUN_ID"] == "run-1"
    assert all(env[name] == f"{CA_DIR}/ca.crt" for name in CA_ENV)
    assert [v["configMap"]["name"] for v in spec.extra_volumes] == ["corp-ca"]  # type: ignore[attr-defined]
    assert spec.extra_mounts[0]["mountPath"] == CA_DIR  # type: ignore[attr-defined]


def test_pod_locations_and_local_outputs_are_refused() -> None:
    plan = _plan()
    with pytest.raises(UserError, match=r"^--output_dir is set by the pipeline itself"):
        _spec(replace(plan, train={**plan.train, "output_dir": "x"}))
    local = replace(plan, run=replace(plan.run, output_uri="/data/runs"))
    with pytest.raises(UserError, match=r"^multi-node training needs an s3:// output_uri"):
        _spec(local)
