"""The rollout server for `rloo train --use_vllm --vllm_mode server`: `rloo vllm-serve` on the train image, inside the
cluster only, reachable from the pipeline's pods only, nothing of it without `rolloutServer.enabled`."""

from __future__ import annotations

import json
from typing import Any

import helm_python as helm
import pytest

from rloo.cli.vllm_serve_cmd import server_argv
from tests.helm.helpers import NAMESPACE, documents, env_of, find, pod_spec, render, variant_values

VALUES = "rollout-values.yaml"
URL = "http://rel-rloo-kfp-rollout.rloo.svc.cluster.local:8000"


def _docs(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    return documents(render(values))


def _spec(docs: list[dict[str, Any]]) -> dict[str, Any]:
    spec = pod_spec(find(docs, "Deployment", "-rollout"))
    assert spec is not None
    return spec


def _server(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (c,) = _spec(docs)["containers"]
    return c


def test_the_rollout_server_is_rloo_vllm_serve_on_the_train_image_and_gpus() -> None:
    """The Deployment runs `rloo vllm-serve` (src/rloo/cli/vllm_serve_cmd.py) on the image the pipeline's training
    step runs (platform.json's `train`), so server and trainer share rloo's weight-sync extension, with vLLM's
    flags as `vllm serve` takes them (vllm/entrypoints/openai/cli_args.py) and one GPU per tensor-parallel rank."""
    docs = _docs(variant_values(VALUES))
    deploy = find(docs, "Deployment", "-rollout")
    assert deploy["metadata"]["name"] == "rel-rloo-kfp-rollout"
    assert deploy["spec"]["strategy"] == {"type": "Recreate"} and deploy["spec"]["replicas"] == 1
    c = _server(docs)
    platform = json.loads(find(docs, "ConfigMap", "-pipeline")["data"]["platform.json"])
    assert c["image"] == platform["images"]["train"]
    assert c["command"] == ["rloo", "vllm-serve"]
    assert c["args"] == [
        "--model=Qwen/Qwen2.5-1.5B",
        "--host=0.0.0.0",
        "--port=8000",
        "--served-model-name=policy",
        "--max-model-len=2048",
        "--gpu-memory-utilization=0.9",
        "--tensor-parallel-size=2",
        "--dtype=bfloat16",
    ]
    # what rloo vllm-serve adds to these: its own defaults only where the chart set none, never a flag twice
    argv = server_argv(c["args"])
    flags = [a.split("=", 1)[0] for a in argv if a.startswith("--")]
    assert len(flags) == len(set(flags)), argv
    assert c["resources"]["requests"]["nvidia.com/gpu"] == c["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert {c["startupProbe"]["httpGet"]["path"], c["readinessProbe"]["httpGet"]["path"]} == {"/health"}
    assert c["startupProbe"]["failureThreshold"] == 180
    env = env_of(c)
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "HF_TOKEN"}
    assert env["HF_HOME"]["value"] == "/models/huggingface" and env["HOME"]["value"] == "/home/rloo"
    assert "VLLM_API_KEY" not in env  # nothing to send: the weight routes take no key anyway
    spec = _spec(docs)
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["model-cache"] == {"name": "model-cache", "persistentVolumeClaim": {"claimName": "models"}}
    assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    assert {"/models", "/home/rloo", "/tmp", "/dev/shm", "/data"} <= mounts
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert spec["runtimeClassName"] == "nvidia" and spec["nodeSelector"] == {"pool": "gpu"}
    assert spec["priorityClassName"] == "training"
    assert not [d for d in docs if d["kind"] == "PersistentVolumeClaim"]


def test_without_a_claim_the_model_cache_is_an_emptydir() -> None:
    docs = _docs({"rolloutServer": {"enabled": True, "model": "Qwen/Qwen2.5-0.5B"}})
    volumes = {v["name"]: v for v in _spec(docs)["volumes"]}
    assert volumes["model-cache"]["emptyDir"] == {"sizeLimit": "100Gi"}
    c = _server(docs)
    assert "--served-model-name=Qwen/Qwen2.5-0.5B" in c["args"] and "--tensor-parallel-size=1" in c["args"]
    assert not [d for d in docs if d["kind"] == "PersistentVolumeClaim"]


def test_the_service_is_cluster_internal() -> None:
    """vLLM mounts /collective_rpc and /reset_prefix_cache when VLLM_SERVER_DEV_MODE is set, which `rloo vllm-serve`
    sets (vllm/entrypoints/serve/__init__.py, register_vllm_dev_api_routers), and its --api-key middleware guards
    only /v1, /v2, /inference and /cohere (vllm/entrypoints/serve/middleware/authenticate.py, GUARDED_PREFIX): the
    Service must not leave the cluster."""
    docs = _docs(variant_values(VALUES))
    service = find(docs, "Service", "-rollout")
    assert service["metadata"]["name"] == "rel-rloo-kfp-rollout"
    assert service["spec"]["type"] == "ClusterIP"
    assert service["spec"]["ports"] == [
        {"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP"}
    ]
    selector = service["spec"]["selector"]
    labels = find(docs, "Deployment", "-rollout")["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= labels.items() and selector["app.kubernetes.io/component"] == "rollout"
    # no other Service or Ingress selects the server
    assert [
        d["metadata"]["name"] for d in docs if d["kind"] == "Service" and "rollout" in str(d["spec"])
    ] == ["rel-rloo-kfp-rollout"]
    assert not [d for d in docs if d["kind"] == "Ingress" and "rollout" in str(d)]
    notes = render(variant_values(VALUES))["rloo-kfp/templates/NOTES.txt"]
    assert f"--param extra_train_args='--use_vllm --vllm_mode server --vllm_server_base_url {URL}'" in notes


def test_the_network_policy_admits_only_the_pipelines_pods() -> None:
    """One NetworkPolicyPeer with both a namespaceSelector and a podSelector selects the pods matching the pod
    selector in the selected namespaces (kubernetes/api networking/v1/types.go, NetworkPolicyPeer): the rollout
    server admits, on its port only, the pipeline's pods (`networkPolicy.pipelinePodLabels` in the pipeline's
    namespace) and the multi-node job's pods, and no `helm test` pod or other component."""
    values = variant_values(VALUES)
    values["networkPolicy"] = {"pipelinePodLabels": {"pipelines.kubeflow.org/v2_component": "true"}}
    values["pipeline"] = {"namespace": "team-a"}
    docs = _docs(values)
    policy = find(docs, "NetworkPolicy", "-rollout")
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    assert policy["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "rollout"
    (rule,) = policy["spec"]["ingress"]
    assert rule["ports"] == [{"port": "http", "protocol": "TCP"}]
    team = {"matchLabels": {"kubernetes.io/metadata.name": "team-a"}}
    assert rule["from"] == [
        {
            "namespaceSelector": team,
            "podSelector": {"matchLabels": {"pipelines.kubeflow.org/v2_component": "true"}},
        },
        {"namespaceSelector": team, "podSelector": {"matchLabels": {"app.kubernetes.io/name": "rloo-train"}}},
    ]
    assert "http" in {p["name"] for p in _server(docs)["ports"]}
    assert not [
        d
        for d in _docs({**variant_values(VALUES), "networkPolicy": {"enabled": False}})
        if d["kind"] == "NetworkPolicy"
    ]


def test_disabled_by_default_renders_nothing() -> None:
    docs = _docs()
    assert not [d for d in docs if "rollout" in d["metadata"]["name"]]
    assert not [d for d in docs if "rollout" in json.dumps(d.get("spec") or {})]
    assert "vllm_server_base_url" not in render()["rloo-kfp/templates/NOTES.txt"]


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"rolloutServer": {"enabled": True, "modle": "x"}}, "additional properties 'modle' not allowed"),
        ({"rolloutServer": {"gpu": {"count": 0}}}, "at '/rolloutServer/gpu/count': minimum"),
        (
            {"rolloutServer": {"enabled": True}},
            "rolloutServer.enabled is true but rolloutServer.model is empty",
        ),
        (
            {"rolloutServer": {"enabled": True, "model": "  "}},
            "rolloutServer.enabled is true but rolloutServer.model is empty",
        ),
        (
            {
                "rolloutServer": {
                    "enabled": True,
                    "model": "m",
                    "podLabels": {"app.kubernetes.io/component": "x"},
                }
            },
            "rolloutServer.podLabels sets app.kubernetes.io/component",
        ),
    ],
    ids=["unknown key", "no GPU", "no model", "blank model", "selector label"],
)
def test_bad_values_are_refused_in_one_line(values: dict[str, Any], message: str) -> None:
    with pytest.raises((helm.HelmValuesError, helm.HelmRenderError)) as err:
        render(values)
    assert message in str(err.value), str(err.value)
    if isinstance(err.value, helm.HelmRenderError):  # rloo-kfp.validate: one line
        assert "\n" not in str(err.value).strip(), str(err.value)


def test_the_namespace_is_the_release_namespace() -> None:
    docs = _docs(variant_values(VALUES))
    assert {d["metadata"]["namespace"] for d in docs if "rollout" in d["metadata"]["name"]} == {NAMESPACE}
