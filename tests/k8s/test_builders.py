"""The multi-node job manifests (TrainJob and PyTorchJob) field by field and against the real CRDs: the
command is the caller's, everything else the pods need is the builders'."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from rloo.errors import UserError
from rloo.k8s import builders
from rloo.k8s.builders import (
    OwnerPod,
    SecretEnv,
    TrainJobSpec,
    build_job,
    build_pytorchjob,
    build_trainjob,
    job_name,
    nproc_per_node,
    owner_from_env,
)
from tests.helm.helpers import policy_violations

# What the caller runs on every node: the builders pass it through as it is.
COMMAND = ["python", "-m", "some.node", "--nproc_per_node", "8", "--config", '{"lr": 3e-06}']
GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}


def _spec(**kw: object) -> TrainJobSpec:
    base: dict[str, object] = dict(
        name="rloo-train-abc",
        namespace="team-a",
        image="reg/rloo-train:1",
        command=list(COMMAND),
        num_nodes=3,
        gpus_per_node=8,
        env={"KFP_RUN_ID": "abc", "A": "1"},
        secret_env=[
            SecretEnv("AWS_ACCESS_KEY_ID", "s3", "AWS_ACCESS_KEY_ID"),
            SecretEnv("HF_TOKEN", "hf", "t", True),
        ],
        tolerations=[dict(GPU_TOLERATION)],
        node_selector={"nvidia.com/gpu.product": "H100"},
        active_deadline_seconds=3600,
    )
    base.update(kw)
    return TrainJobSpec(**base)  # type: ignore[arg-type]


def test_manifest_fields() -> None:
    m = build_pytorchjob(_spec())
    assert m["apiVersion"] == "kubeflow.org/v1" and m["kind"] == "PyTorchJob"
    assert m["metadata"]["name"] == "rloo-train-abc" and m["metadata"]["namespace"] == "team-a"
    spec = m["spec"]
    assert spec["nprocPerNode"] == "8"
    assert spec["runPolicy"] == {
        "backoffLimit": 3,
        "cleanPodPolicy": "Running",
        "activeDeadlineSeconds": 3600,
    }
    replicas = spec["pytorchReplicaSpecs"]
    assert set(replicas) == {"Master", "Worker"}
    assert replicas["Master"]["replicas"] == 1 and replicas["Worker"]["replicas"] == 2
    for r in replicas.values():
        assert r["restartPolicy"] == "OnFailure"
        pod = r["template"]["spec"]
        (c,) = pod["containers"]
        assert c["name"] == "pytorch" and c["image"] == "reg/rloo-train:1"
        assert c["command"] == COMMAND  # the caller's, as it is
        res = c["resources"]
        assert res["requests"] == res["limits"] == {"cpu": "8", "memory": "64Gi", "nvidia.com/gpu": "8"}
        assert c["env"][:2] == [{"name": "A", "value": "1"}, {"name": "KFP_RUN_ID", "value": "abc"}]
        assert c["env"][2] == {
            "name": "AWS_ACCESS_KEY_ID",
            "valueFrom": {"secretKeyRef": {"name": "s3", "key": "AWS_ACCESS_KEY_ID", "optional": False}},
        }
        assert c["env"][3]["valueFrom"]["secretKeyRef"] == {"name": "hf", "key": "t", "optional": True}
        # the node stages the models in its work dir under /tmp: an emptyDir on the node's disk
        assert c["volumeMounts"] == [
            {"name": "dshm", "mountPath": "/dev/shm"},
            {"name": "scratch", "mountPath": "/tmp"},
        ]
        assert pod["volumes"] == [
            {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}},
            {"name": "scratch", "emptyDir": {"sizeLimit": "500Gi"}},  # on the node's disk, not in memory
        ]
        assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
        assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "H100"}


def test_no_secret_values_and_cpu_only_pods() -> None:
    m = build_pytorchjob(_spec(gpus_per_node=0, active_deadline_seconds=None))
    c = m["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in c["resources"]["limits"]
    assert m["spec"]["nprocPerNode"] == "1" and "activeDeadlineSeconds" not in m["spec"]["runPolicy"]
    assert build_trainjob(_spec(gpus_per_node=0))["spec"]["trainer"]["numProcPerNode"] == 1
    # secrets are references only: no entry carries a literal value for a secret variable
    assert all("value" not in e for e in c["env"] if e["name"] in ("AWS_ACCESS_KEY_ID", "HF_TOKEN"))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_nodes": 1}, "num_nodes >= 2"),
        ({"gpus_per_node": -1}, "gpu_count must be >= 0"),
        ({"name": "Bad_Name"}, "not a valid Kubernetes name"),
    ],
)
def test_bad_specs(change: dict[str, object], message: str) -> None:
    with pytest.raises(UserError, match=message):
        build_pytorchjob(_spec(**change))


def test_processes_per_node_are_one_per_gpu_and_one_without() -> None:
    """What a caller that runs torchrun passes it: the number the job declares."""
    assert [nproc_per_node(n) for n in (0, 1, 8)] == [1, 1, 8]
    m = build_trainjob(_spec(gpus_per_node=4))
    assert m["spec"]["trainer"]["numProcPerNode"] == nproc_per_node(4) == 4
    assert build_pytorchjob(_spec(gpus_per_node=4))["spec"]["nprocPerNode"] == "4"


def test_the_spec_knows_nothing_of_what_the_command_does() -> None:
    """A command that writes to a pod-local path, or takes any flag, is the caller's to check."""
    cmd = ["rloo", "train", "--output_dir", "/tmp/out", "--checkpoint_uri", "/tmp/ck"]
    assert build_job(_spec(command=cmd))["spec"]["trainer"]["command"] == cmd


def test_job_name_is_valid_and_deterministic() -> None:
    name = job_name("Run_ID/With Stuff" + "x" * 80)
    assert name == job_name("Run_ID/With Stuff" + "x" * 80)
    assert len(name) <= 63 and name.startswith("rloo-train-run-id-with-stuff")
    build_pytorchjob(_spec(name=name))  # accepted by the validation


# Restricted pods, resources, and the manifest against the operator's CRD ---------------------------------

CRD_SCHEMA = Path(__file__).resolve().parents[1] / "fixtures" / "crds" / "pytorchjob.v1.9.4.schema.json"
# Where the verbatim CRDs live when at hand (the vendored schema is checked against them then).
CRD_DIR = Path(os.environ.get("RLOO_CRD_DIR", "/work/shared/reference/crds"))
KUBE_VERSIONS = ["1.27", kubernetes_validate.latest_version()]


def _pods(manifest: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {k: r["template"] for k, r in manifest["spec"]["pytorchReplicaSpecs"].items()}


def test_pods_are_restricted_and_sized() -> None:
    m = build_pytorchjob(_spec(cpu="12", memory="96Gi", service_account="rloo-train"))
    for template in _pods(m).values():
        pod = template["spec"]
        assert pod["serviceAccountName"] == "rloo-train"
        assert pod["automountServiceAccountToken"] is False
        assert pod["securityContext"] == {
            "runAsNonRoot": True,
            "runAsUser": 1000,
            "runAsGroup": 1000,
            "seccompProfile": {"type": "RuntimeDefault"},
        }
        (c,) = pod["containers"]
        assert c["securityContext"] == {
            "allowPrivilegeEscalation": False,
            "runAsNonRoot": True,
            "capabilities": {"drop": ["ALL"]},
        }
        assert (
            c["resources"]["requests"]
            == c["resources"]["limits"]
            == {
                "cpu": "12",
                "memory": "96Gi",
                "nvidia.com/gpu": "8",
            }
        )
        # the chart's own pod policies (restricted PSS, requests and limits, secrets by reference); the
        # training container writes its work directory and caches, so its root filesystem stays writable
        as_pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "train"}, "spec": pod}
        problems = [p for p in policy_violations(as_pod) if "readOnlyRootFilesystem" not in p]
        assert problems == []


def _strict(node: Any) -> Any:
    """The CRD schema as the API server's pruning would apply it, made an error: unknown fields are refused
    (additionalProperties: false wherever properties are listed and unknown fields are not preserved)."""
    if isinstance(node, dict):
        out = {k: _strict(v) for k, v in node.items()}
        preserved = out.get("x-kubernetes-preserve-unknown-fields")
        if "properties" in out and "additionalProperties" not in out and not preserved:
            out["additionalProperties"] = False
        return out
    if isinstance(node, list):
        return [_strict(v) for v in node]
    return node


def _validate(manifest: dict[str, Any]) -> None:
    """The job against the training operator's CRD schema (strict), each pod template against the Kubernetes
    API's PodTemplate schema with kubernetes-validate --strict."""
    schema = _strict(json.loads(CRD_SCHEMA.read_text()))
    jsonschema.validate(manifest, schema)
    for replica, template in _pods(manifest).items():
        doc = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": replica.lower()}}
        for version in KUBE_VERSIONS:
            kubernetes_validate.validate({**doc, "template": template}, version, strict=True)


@pytest.mark.parametrize(
    "change",
    [{}, {"gpus_per_node": 0, "active_deadline_seconds": None}, {"num_nodes": 2, "service_account": "a.b-c"}],
)
def test_manifest_validates_against_the_crd_and_the_pod_schema(change: dict[str, object]) -> None:
    _validate(build_pytorchjob(_spec(**change)))


def test_validation_catches_bad_manifests() -> None:
    m = build_pytorchjob(_spec())
    bad = json.loads(json.dumps(m))
    bad["spec"]["runPolicy"]["backoffLimit"] = "three"
    with pytest.raises(jsonschema.ValidationError):
        _validate(bad)
    bad = json.loads(json.dumps(m))
    bad["spec"]["runPolicy"]["backofLimit"] = 3  # pruned silently by the API server; an error here
    with pytest.raises(jsonschema.ValidationError):
        _validate(bad)
    bad = json.loads(json.dumps(m))
    bad["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["automountServiceAccountTokens"] = False
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate(bad)


@pytest.mark.skipif(not (CRD_DIR / "kubeflow.org_pytorchjobs.v1.9.4.yaml").is_file(), reason="no CRD at hand")
def test_vendored_schema_is_the_crds() -> None:
    crd = yaml.safe_load((CRD_DIR / "kubeflow.org_pytorchjobs.v1.9.4.yaml").read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    want = version["schema"]["openAPIV3Schema"]
    got = json.loads(CRD_SCHEMA.read_text())
    got.pop("$comment")
    replica = want["properties"]["spec"]["properties"]["pytorchReplicaSpecs"]["additionalProperties"]
    assert "containers" in json.dumps(replica["properties"].pop("template"))
    got["properties"]["spec"]["properties"]["pytorchReplicaSpecs"]["additionalProperties"]["properties"].pop(
        "template"
    )
    assert got == want


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"cpu": "8 cores"}, r"^train_cpu must be a CPU quantity such as 8 or 500m \(got '8 cores'\)\.$"),
        ({"memory": "64GB"}, r"^train_memory must be a memory quantity"),
        ({"memory": "16Gi"}, r"^train_memory must be more than the 16Gi of /dev/shm"),
        (
            {"service_account": "Pipeline_Runner"},
            r"^train_service_account must be a Kubernetes service account",
        ),
        ({"run_as_user": 0}, "must not run as root"),
    ],
)
def test_bad_pod_settings(change: dict[str, object], message: str) -> None:
    with pytest.raises(UserError, match=message):
        build_pytorchjob(_spec(**change))


# TrainJob (Kubeflow Trainer v2) ---------------------------------------------------------------------------

TRAINJOB_SCHEMA = Path(__file__).resolve().parents[1] / "fixtures" / "crds" / "trainjob.v2.3.0.schema.json"
TORCH_RUNTIME = (
    Path(__file__).resolve().parents[1] / "fixtures" / "crds" / "runtime.torch_distributed.v2.3.0.yaml"
)


def _trainjob_pod(manifest: dict[str, Any]) -> dict[str, Any]:
    """The pod template Trainer gives a node of this TrainJob on the default runtime: the runtime's template,
    the job's trainer fields and its runtime patch merged the way Trainer merges them (patched containers by
    name, lists appended, pod fields set). Enough to check what the pods end up with, not Trainer itself."""
    runtime = yaml.safe_load(TORCH_RUNTIME.read_text())
    (rjob,) = runtime["spec"]["template"]["spec"]["replicatedJobs"]
    template = json.loads(json.dumps(rjob["template"]["spec"]["template"]))
    pod = template["spec"]
    (container,) = [c for c in pod["containers"] if c["name"] == builders.TRAINJOB_NODE]
    t = manifest["spec"]["trainer"]
    container.update(image=t["image"], command=t["command"], env=t["env"], resources=t["resourcesPerNode"])
    (patch,) = manifest["spec"]["runtimePatches"]
    (job_patch,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    assert job_patch["name"] == rjob["name"]  # the patch names a job the runtime has
    pod_patch = job_patch["template"]["spec"]["template"]
    template.setdefault("metadata", {}).setdefault("labels", {}).update(pod_patch["metadata"]["labels"])
    if "annotations" in pod_patch["metadata"]:
        template["metadata"].setdefault("annotations", {}).update(pod_patch["metadata"]["annotations"])
    for key, value in pod_patch["spec"].items():
        if key == "containers":
            for cp in value:
                (target,) = [c for c in pod["containers"] if c["name"] == cp["name"]]
                target.setdefault("volumeMounts", []).extend(cp.get("volumeMounts", []))
                target.setdefault("env", []).extend(cp.get("env", []))
                if "securityContext" in cp:
                    target["securityContext"] = cp["securityContext"]
        elif isinstance(value, list):
            pod.setdefault(key, []).extend(value)
        else:
            pod[key] = value
    return template


def _validate_trainjob(manifest: dict[str, Any]) -> None:
    """The TrainJob against Trainer's CRD schema (strict) and its CEL rule on the name; the pod it gives,
    against the Kubernetes API's PodTemplate schema with kubernetes-validate --strict."""
    jsonschema.validate(manifest, _strict(json.loads(TRAINJOB_SCHEMA.read_text())))
    name = manifest["metadata"]["name"]  # x-kubernetes-validations of the CRD (jsonschema skips CEL)
    assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name) and len(name) <= 63, name
    doc = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "node"}}
    for version in KUBE_VERSIONS:
        kubernetes_validate.validate({**doc, "template": _trainjob_pod(manifest)}, version, strict=True)


def test_trainjob_fields() -> None:
    m = build_trainjob(_spec())
    assert m["apiVersion"] == "trainer.kubeflow.org/v1alpha1" and m["kind"] == "TrainJob"
    assert m["metadata"] == {
        "name": "rloo-train-abc",
        "namespace": "team-a",
        "labels": {"app.kubernetes.io/name": "rloo-train"},
    }
    spec = m["spec"]
    assert spec["runtimeRef"] == {
        "apiGroup": "trainer.kubeflow.org",
        "kind": "ClusterTrainingRuntime",
        "name": "torch-distributed",
    }
    assert spec["activeDeadlineSeconds"] == 3600
    t = spec["trainer"]
    assert t["image"] == "reg/rloo-train:1" and t["numNodes"] == 3 and t["numProcPerNode"] == 8
    pytorchjob_pod = build_pytorchjob(_spec())["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    (pc,) = pytorchjob_pod["containers"]
    # the same command, environment (secrets by reference) and resources as the PyTorchJob path
    assert (
        t["command"] == pc["command"] and t["env"] == pc["env"] and t["resourcesPerNode"] == pc["resources"]
    )
    template = _trainjob_pod(m)
    pod = template["spec"]
    assert template["metadata"]["labels"]["app.kubernetes.io/name"] == "rloo-train"
    for key in ("serviceAccountName", "securityContext", "tolerations", "nodeSelector"):
        assert pod[key] == pytorchjob_pod[key], key
    assert _spec().active_deadline_seconds == 3600
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}} in pod["volumes"]
    (c,) = pod["containers"]
    assert c["name"] == "node" and c["securityContext"] == pc["securityContext"]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    # no API token in the training container: its path is taken by an empty mount (see builders' docstring)
    assert {"name": "no-api-token", "mountPath": builders.SA_TOKEN_PATH, "readOnly": True} in c[
        "volumeMounts"
    ]


def test_trainjob_pods_are_restricted() -> None:
    pod = _trainjob_pod(build_trainjob(_spec(service_account="rloo-train")))
    as_pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "train"}, "spec": pod["spec"]}
    # a TrainJob cannot set automountServiceAccountToken (the CRD refuses it, see below): the token's path is
    # taken by an empty mount in the only container instead (test_trainjob_fields)
    allowed = ("readOnlyRootFilesystem", "automountServiceAccountToken")
    problems = [p for p in policy_violations(as_pod) if not any(a in p for a in allowed)]
    assert problems == []
    (c,) = pod["spec"]["containers"]
    assert builders.SA_TOKEN_PATH in {m["mountPath"] for m in c["volumeMounts"]}


@pytest.mark.parametrize(
    ("change", "runtime"),
    [
        ({}, "torch-distributed"),
        ({"gpus_per_node": 0, "active_deadline_seconds": None}, "TrainingRuntime/team-torch"),
        ({"num_nodes": 2, "service_account": "a.b-c", "namespace": ""}, "torch-distributed"),
    ],
)
def test_trainjob_validates_against_the_crd_and_the_pod_schema(
    change: dict[str, object], runtime: str
) -> None:
    m = build_trainjob(_spec(**change), runtime)
    _validate_trainjob(m)
    assert m["spec"]["runtimeRef"]["name"] == runtime.rpartition("/")[2]


def test_trainjob_validation_catches_bad_manifests() -> None:
    m = build_trainjob(_spec())
    bad = json.loads(json.dumps(m))
    bad["spec"]["trainer"]["numNodes"] = "3"
    with pytest.raises(jsonschema.ValidationError):
        _validate_trainjob(bad)
    bad = json.loads(json.dumps(m))
    bad["spec"]["trainer"]["nprocPerNode"] = 8  # a PyTorchJob field: pruned silently by the API server
    with pytest.raises(jsonschema.ValidationError):
        _validate_trainjob(bad)
    bad = json.loads(json.dumps(m))
    patch = bad["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]
    patch["template"]["spec"]["template"]["spec"]["automountServiceAccountToken"] = False  # not patchable
    with pytest.raises(jsonschema.ValidationError):
        _validate_trainjob(bad)


@pytest.mark.skipif(
    not (CRD_DIR / "trainer.kubeflow.org_trainjobs.v2.3.0.yaml").is_file(), reason="no CRD at hand"
)
def test_vendored_trainjob_schema_and_runtime_are_trainers() -> None:
    def strip(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: strip(v) for k, v in node.items() if k != "description"}
        return [strip(v) for v in node] if isinstance(node, list) else node

    crd = yaml.safe_load((CRD_DIR / "trainer.kubeflow.org_trainjobs.v2.3.0.yaml").read_text())
    (version,) = crd["spec"]["versions"]
    got = json.loads(TRAINJOB_SCHEMA.read_text())
    got.pop("$comment")
    assert got == strip(version["schema"]["openAPIV3Schema"])
    ours = TORCH_RUNTIME.read_text().split("\n", 2)[2]  # the two lines that say where it comes from
    assert ours == (CRD_DIR / "runtime.torch_distributed.v2.3.0.yaml").read_text()


@pytest.mark.parametrize(
    ("backend", "runtime", "message"),
    [
        (
            "jobset",
            "torch-distributed",
            r"^multinode_backend must be one of trainjob, pytorchjob \(got 'jobset'\)\.$",
        ),
        ("trainjob", "Torch_Distributed", "training_runtime 'Torch_Distributed' is not a runtime name"),
        ("trainjob", "Runtime/x", "training_runtime 'Runtime/x' is not a runtime name"),
        # Trainer's MPI runtimes: a launcher and sshd nodes, which the job's patch and image do not provide
        (
            "trainjob",
            "deepspeed-distributed",
            r"^training_runtime 'deepspeed-distributed' is an MPI runtime .* use a torch runtime such as "
            r"torch-distributed .* DeepSpeed is an accelerate setting of 'rloo train' here",
        ),
        (
            "trainjob",
            "TrainingRuntime/mpi-team",
            "training_runtime 'TrainingRuntime/mpi-team' is an MPI runtime",
        ),
    ],
)
def test_bad_backend_or_runtime(backend: str, runtime: str, message: str) -> None:
    with pytest.raises(UserError, match=message):
        build_job(_spec(), backend, runtime)


def test_refused_runtimes_say_it_in_one_line() -> None:
    with pytest.raises(UserError) as info:
        build_job(_spec(), "trainjob", "deepspeed-distributed")
    assert "\n" not in str(info.value)
    build_job(_spec(), "trainjob", "TrainingRuntime/deepspeedish")  # only the deepspeed-/mpi- prefixes


def test_build_job_picks_the_backend() -> None:
    assert build_job(_spec())["kind"] == "TrainJob"
    assert build_job(_spec(), "pytorchjob")["kind"] == "PyTorchJob"


# Owner, Kueue, Istio ---------------------------------------------------------------------------------------

POD_ENV = {
    "RLOO_POD_NAME": "run-abc-train-launcher",
    "RLOO_POD_UID": "1f0c-uid",
    "RLOO_POD_NAMESPACE": "team-a",
}
OWNER_REF = {
    "apiVersion": "v1",
    "kind": "Pod",
    "name": "run-abc-train-launcher",
    "uid": "1f0c-uid",
    "blockOwnerDeletion": False,
    "controller": False,
}


def _validate_metadata(manifest: dict[str, Any]) -> None:
    """The job's metadata against the Kubernetes API's ObjectMeta (the CRD schemas leave it to the API
    server), by way of an object that has nothing else."""
    doc = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": manifest["metadata"]}
    for version in KUBE_VERSIONS:
        kubernetes_validate.validate(doc, version, strict=True)


@pytest.mark.parametrize("kind", ["trainjob", "pytorchjob"])
def test_the_launcher_pod_owns_the_job(kind: str) -> None:
    owner = owner_from_env(POD_ENV)
    assert owner == OwnerPod("run-abc-train-launcher", "1f0c-uid", "team-a")
    m = build_job(_spec(owner=owner), kind)
    assert m["metadata"]["ownerReferences"] == [OWNER_REF]
    _validate_metadata(m)
    _validate_trainjob(m) if kind == "trainjob" else _validate(m)
    # an owner is looked for in the dependent's namespace only: one elsewhere would get the job deleted at once
    elsewhere = build_job(_spec(owner=owner, namespace="team-b"), kind)
    assert "ownerReferences" not in elsewhere["metadata"]
    assert "ownerReferences" not in build_job(_spec(), kind)["metadata"]


@pytest.mark.parametrize("missing", sorted(POD_ENV))
def test_no_owner_without_the_whole_downward_api(missing: str) -> None:
    assert owner_from_env({k: v for k, v in POD_ENV.items() if k != missing}) is None
    assert owner_from_env({**POD_ENV, missing: " "}) is None


def test_trainjob_kueue_and_istio() -> None:
    m = build_trainjob(_spec(queue_name="gpu-queue", priority_class="high-priority"))
    assert m["metadata"]["labels"] == {
        "app.kubernetes.io/name": "rloo-train",
        "kueue.x-k8s.io/queue-name": "gpu-queue",
        "kueue.x-k8s.io/priority-class": "high-priority",  # a Kueue WorkloadPriorityClass
    }
    assert m["spec"]["suspend"] is True  # Kueue unsuspends it once admitted
    template = _trainjob_pod(m)
    assert template["metadata"]["annotations"] == {"sidecar.istio.io/inject": "false"}
    assert "kueue.x-k8s.io/queue-name" not in template["metadata"]["labels"]
    assert "priorityClassName" not in template["spec"]  # the pod patch has no such field
    _validate_trainjob(m)
    _validate_metadata(m)
    plain = build_trainjob(_spec(istio_sidecar=True))
    assert "suspend" not in plain["spec"] and "annotations" not in _trainjob_pod(plain)["metadata"]
    assert set(plain["metadata"]["labels"]) == {"app.kubernetes.io/name"}
    _validate_trainjob(plain)


def test_pytorchjob_kueue_priority_and_istio() -> None:
    m = build_pytorchjob(_spec(queue_name="gpu-queue", priority_class="high.priority"))
    assert m["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "gpu-queue"
    assert "kueue.x-k8s.io/priority-class" not in m["metadata"]["labels"]
    run_policy = m["spec"]["runPolicy"]
    assert run_policy["suspend"] is True
    assert run_policy["schedulingPolicy"] == {"priorityClass": "high.priority"}
    for template in _pods(m).values():
        assert template["spec"]["priorityClassName"] == "high.priority"
        assert template["metadata"]["annotations"] == {"sidecar.istio.io/inject": "false"}
    _validate(m)
    _validate_metadata(m)
    plain = build_pytorchjob(_spec(istio_sidecar=True))
    assert (
        "suspend" not in plain["spec"]["runPolicy"] and "schedulingPolicy" not in plain["spec"]["runPolicy"]
    )
    for template in _pods(plain).values():
        assert "annotations" not in template["metadata"] and "priorityClassName" not in template["spec"]


@pytest.mark.parametrize(
    ("change", "kind", "message"),
    [
        (
            {"queue_name": "GPU_Queue"},
            "pytorchjob",
            r"^queue_name 'GPU_Queue' is not a Kueue LocalQueue name",
        ),
        ({"queue_name": "q" * 64}, "trainjob", "is not a Kueue LocalQueue name"),
        (
            {"priority_class": "High Priority"},
            "pytorchjob",
            r"^priority_class 'High Priority' is not a priority",
        ),
        ({"priority_class": "high"}, "trainjob", r"^priority_class needs queue_name for a TrainJob: .*"),
        ({"owner": OwnerPod("", "uid")}, "trainjob", "the job's owner pod needs a name and a uid"),
    ],
)
def test_bad_scheduling_settings(change: dict[str, object], kind: str, message: str) -> None:
    with pytest.raises(UserError, match=message) as info:
        build_job(_spec(**change), kind)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("platform", "refused"),
    [
        ({}, True),  # no word from the platform: Kueue's default config
        ({"kueue": {"pytorchJobIntegration": False}}, True),
        ({"kueue": {"pytorchJobIntegration": True}}, False),
    ],
)
def test_a_queued_pytorchjob_needs_kueues_pytorchjob_integration(
    platform: dict[str, Any], refused: bool
) -> None:
    """kubernetes-sigs/kueue config/components/manager/controller_manager_config.yaml (0.19): kubeflow.org/pytorchjob
    is commented out of integrations.frameworks, so Kueue never admits (never unsuspends) a PyTorchJob. The
    validate step refuses queue_name with that backend unless the platform (RLOO_PLATFORM) says it is on."""
    from rloo.stages import validate
    from tests.stages.test_validate import good

    params = good(
        num_nodes=2, output_uri="s3://runs/rloo", queue_name="team-q", multinode_backend="pytorchjob"
    )
    env = {"RLOO_PLATFORM": json.dumps(platform)} if platform else {}
    if refused:
        with pytest.raises(UserError) as info:
            validate.run(params, env)
        assert str(info.value) == (
            "queue_name 'team-q' with multinode_backend=pytorchjob: Kueue ships its kubeflow.org/pytorchjob "
            "integration disabled, and a PyTorchJob it does not manage stays suspended for ever; enable it "
            "(Kueue's configuration, integrations.frameworks: - kubeflow.org/pytorchjob) and set the platform's "
            'kueue: {"pytorchJobIntegration": true}, or use multinode_backend=trainjob.'
        )
    from rloo.k8s.platform import from_env

    checked = from_env(env)
    if not refused:
        builders.check_queue_backend(params, checked)
    # a TrainJob (Kueue's trainer.kubeflow.org/trainjob integration is on by default), no queue, or one node
    for change in ({"multinode_backend": "trainjob"}, {"queue_name": ""}, {"num_nodes": 1}):
        builders.check_queue_backend({**params, **change}, checked)
