"""The multi-node PyTorchJob manifest, field by field."""

from __future__ import annotations

import pytest

from rloo.errors import UserError
from rloo.pipeline import constants
from rloo.pipeline.trainjob import SecretEnv, TrainJobSpec, build_pytorchjob, job_name


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
