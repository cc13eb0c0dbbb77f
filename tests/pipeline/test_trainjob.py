"""The multi-node PyTorchJob manifest, field by field."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from rloo.errors import UserError
from rloo.pipeline import constants
from rloo.pipeline.trainjob import SecretEnv, TrainJobSpec, build_pytorchjob, job_name
from tests.helm.helpers import policy_violations


def _spec(**kw: object) -> TrainJobSpec:
    base: dict[str, object] = dict(
        name="rloo-train-abc",
        namespace="team-a",
        image="reg/rloo-train:1",
        train_args=["--dataset_name", "d", "--rloo_k", "4"],
        sft_uri="s3://b/run/sft",
        model_uri="s3://b/run/model",
        checkpoint_uri="s3://b/run/checkpoints",
        num_nodes=3,
        gpus_per_node=8,
        env={"KFP_RUN_ID": "abc", "A": "1"},
        secret_env=[
            SecretEnv("AWS_ACCESS_KEY_ID", "s3", "AWS_ACCESS_KEY_ID"),
            SecretEnv("HF_TOKEN", "hf", "t", True),
        ],
        tolerations=[dict(constants.GPU_TOLERATION)],
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
        cmd = c["command"]
        assert cmd[:3] == ["python", "-m", "rloo.pipeline.node"]
        after = cmd[cmd.index("--") + 1 :]
        assert after == ["--dataset_name", "d", "--rloo_k", "4"]
        assert cmd[cmd.index("--checkpoint_uri") + 1] == "s3://b/run/checkpoints"
        assert cmd[cmd.index("--sft_uri") + 1] == "s3://b/run/sft"
        assert cmd[cmd.index("--model_uri") + 1] == "s3://b/run/model"
        assert cmd[cmd.index("--num_nodes") + 1] == "3" and cmd[cmd.index("--nproc_per_node") + 1] == "8"
        res = c["resources"]
        assert res["requests"] == res["limits"] == {"cpu": "8", "memory": "64Gi", "nvidia.com/gpu": "8"}
        assert c["env"][:2] == [{"name": "A", "value": "1"}, {"name": "KFP_RUN_ID", "value": "abc"}]
        assert c["env"][2] == {
            "name": "AWS_ACCESS_KEY_ID",
            "valueFrom": {"secretKeyRef": {"name": "s3", "key": "AWS_ACCESS_KEY_ID", "optional": False}},
        }
        assert c["env"][3]["valueFrom"]["secretKeyRef"] == {"name": "hf", "key": "t", "optional": True}
        assert c["volumeMounts"] == [{"name": "dshm", "mountPath": "/dev/shm"}]
        assert pod["volumes"] == [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}}]
        assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
        assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "H100"}


def test_no_secret_values_and_cpu_only_pods() -> None:
    m = build_pytorchjob(_spec(gpus_per_node=0, active_deadline_seconds=None))
    c = m["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in c["resources"]["limits"]
    assert m["spec"]["nprocPerNode"] == "1" and "activeDeadlineSeconds" not in m["spec"]["runPolicy"]
    # secrets are references only: no entry carries a literal value for a secret variable
    assert all("value" not in e for e in c["env"] if e["name"] in ("AWS_ACCESS_KEY_ID", "HF_TOKEN"))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_nodes": 1}, "num_nodes >= 2"),
        ({"gpus_per_node": -1}, "gpu_count must be >= 0"),
        ({"checkpoint_uri": "/tmp/ck"}, "checkpoint_uri must be s3://"),
        ({"name": "Bad_Name"}, "not a valid Kubernetes name"),
        ({"train_args": ["--output_dir", "x"]}, "--output_dir is set by the job"),
    ],
)
def test_bad_specs(change: dict[str, object], message: str) -> None:
    with pytest.raises(UserError, match=message):
        build_pytorchjob(_spec(**change))


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
