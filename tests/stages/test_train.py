"""The train step's multi-node job: what the plan and the platform give its pods, and what it refuses."""

from __future__ import annotations

import json
import uuid
from dataclasses import replace
from typing import Any

import pytest

from rloo.errors import UserError
from rloo.k8s.builders import POD_NAME_ENV, POD_NAMESPACE_ENV, POD_UID_ENV, OwnerPod, job_name
from rloo.k8s.platform import CA_DIR, CA_ENV, CABundle, Platform
from rloo.stages.context import step
from rloo.stages.layout import RunLayout
from rloo.stages.plan import PipelinePlan
from rloo.stages.retry import recorded_failure
from rloo.stages.train import job_manifest, multinode_spec
from rloo.stages.validate import build_plan
from tests.fixtures.kube_api import FakeKubeAPI, install_fake_api
from tests.fixtures.servers import S3Server, use_s3
from tests.stages.test_validate import good

MULTI = {"num_nodes": 2, "gpu_count": 4, "output_uri": "s3://runs/rloo", "mlflow_experiment": "exp"}


def _plan(**change: object) -> PipelinePlan:
    return build_plan(good(**{**MULTI, **change}), check_paths=False)


def _spec(plan: PipelinePlan, platform: Platform | None = None, **kw: object) -> object:
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


@pytest.mark.parametrize("backend", ["trainjob", "pytorchjob"])
def test_the_jobs_pods_tolerate_the_plans_gpu_taints(backend: str) -> None:
    """A pool tainted otherwise than nvidia.com/gpu (AKS sku=gpu): the pods must tolerate what gpu_tolerations
    says, besides nvidia.com/gpu as the single-node steps do, or they stay Pending
    (kubernetes/kubernetes pkg/scheduler/framework/plugins/tainttoleration)."""
    from rloo.stages.constants import GPU_TOLERATION

    aks = [{"key": "sku", "operator": "Equal", "value": "gpu", "effect": "NoSchedule"}]
    plan = _plan(gpu_tolerations=aks, multinode_backend=backend)
    job = job_manifest(plan, _spec(plan))
    if backend == "trainjob":
        (patch,) = job["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"][
            "replicatedJobs"
        ]
        pods = [patch["template"]["spec"]["template"]["spec"]]
    else:
        pods = [r["template"]["spec"] for r in job["spec"]["pytorchReplicaSpecs"].values()]
    assert [p["tolerations"] for p in pods] == [[GPU_TOLERATION, *aks]] * len(pods)
    assert job_manifest(_plan(gpu_tolerations=[]), _spec(_plan(gpu_tolerations=[])))["kind"] == "TrainJob"
    none = _plan(gpu_tolerations=[], multinode_backend="pytorchjob")
    master = job_manifest(none, _spec(none))["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    assert master["tolerations"] == [GPU_TOLERATION]


@pytest.fixture
def kube(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The Kubernetes API boundary in place of the client's APIs (tests.k8s.test_jobs' fixture)."""

    def install(**kw: Any) -> FakeKubeAPI:
        return install_fake_api(monkeypatch, **kw)

    for name in (POD_NAME_ENV, POD_UID_ENV, POD_NAMESPACE_ENV):
        monkeypatch.delenv(name, raising=False)
    return install


@pytest.mark.parametrize(
    ("message", "code"),
    [
        (
            "couldn't assign flavors to pod set node: insufficient unused quota for nvidia.com/gpu in flavor h100",
            75,
        ),
        ("LocalQueue team-q doesn't exist", 2),
    ],
)
def test_the_train_step_bounds_the_wait_for_kueue(
    message: str,
    code: int,
    kube: Any,
    s3_server: S3Server,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The step's admission_timeout_s reaches the wait (kubernetes-sigs/kueue pkg/scheduler: a Workload without
    quota stays QuotaReserved=False): no quota in time exits 75 (KFP's retry may find room), a queue that does
    not exist exits 2 and is recorded, so that a retried step stops at once (rloo.stages.retry)."""
    from rloo.stages import train

    use_s3(s3_server, monkeypatch)
    monkeypatch.delenv("KFP_RUN_ID", raising=False)  # the step context sets it; restored after the test
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    plan = _plan(
        output_uri=f"s3://{s3_server.bucket}/kueue",
        queue_name="team-q",
        namespace="team-a",
        admission_timeout_s=1,
    )
    fake = kube(outcome=None)
    name = job_name(run_id)
    fake.workloads = [
        {
            "metadata": {
                "name": f"trainjob-{name}-1a2b3",
                "labels": {"kueue.x-k8s.io/job-uid": f"uid-{name}"},
            },
            "spec": {"queueName": "team-q", "active": True},
            "status": {
                "conditions": [
                    {"type": "QuotaReserved", "status": "False", "reason": "Pending", "message": message}
                ]
            },
        }
    ]
    with pytest.raises(SystemExit) as info, step("train-multinode", run_id, plan=plan.to_json()) as s:
        train.train_on_cluster(
            s.plan, run_id, "my run", sft={"uri": "s3://x/sft"}, image="reg/rloo-train:1", scratch_size=""
        )
    assert info.value.code == code
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("[rloo] Kueue ") and "'team-q'" in last and message in last
    assert fake.deleted == [name]
    recorded = recorded_failure(RunLayout(plan.run.output_uri, run_id).root, "train-multinode")
    assert (recorded is not None) == (code == 2)


def test_the_jobs_pods_mount_s3_keys_optionally_under_a_workload_identity() -> None:
    """With IRSA (the platform's ``s3WorkloadIdentity``) the S3 key Secret may not exist: a key mounted with
    optional: false would keep every job pod in CreateContainerConfigError (kubelet
    ``pkg/kubelet/kubelet_pods.go``, ``makeEnvironmentVariables``). The other Secrets keep their own rule."""
    plan = _plan()
    keyed = {e.env: e.optional for e in _spec(plan).secret_env}  # type: ignore[attr-defined]
    irsa = {e.env: e.optional for e in _spec(plan, Platform(s3_workload_identity=True)).secret_env}  # type: ignore[attr-defined]
    s3 = {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "S3_ENDPOINT_URL"}
    assert not any(keyed[k] for k in s3) and all(irsa[k] for k in s3)
    assert {k: v for k, v in keyed.items() if k not in s3} == {k: v for k, v in irsa.items() if k not in s3}


def test_the_jobs_pods_get_the_judge_key_optionally() -> None:
    """A judge reward (--judge_reward_coef in extra_train_args) asks the judge from every rank, so the job's
    pods read the judge Secret's key as the single-node step does; optionally (kubelet
    ``pkg/kubelet/kubelet_pods.go``, ``makeEnvironmentVariables``: an optional missing key leaves the variable
    unset), since a run without a judge reward never reads it."""
    plan = _plan()
    judge = [e for e in _spec(plan).secret_env if e.env == "OPENAI_API_KEY"]  # type: ignore[attr-defined]
    assert [(e.secret, e.key, e.optional) for e in judge] == [
        (plan.cluster.judge_secret, "OPENAI_API_KEY", True)
    ]
