"""The chart on a real platform: the project's images from one source (and platform.json, which the upload applies
to the pipeline's steps and training jobs), proxies, CA bundles and extra environment, pod extras, Istio and
multi-user KFP for the upload, MLflow's scratch space, the db-upgrade hook and the PodDisruptionBudget."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from rloo.pipeline.images import DEFAULT_REGISTRY, DEFAULT_TAG, IMAGE_EXTRAS
from tests.helm.helpers import (
    CHART,
    VARIANTS,
    containers,
    documents,
    env_of,
    find,
    pod_spec,
    render,
    variant_values,
    with_test_values,
)

DIGEST = "sha256:" + "1" * 64
CA_VARIABLES = ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "AWS_CA_BUNDLE", "CURL_CA_BUNDLE")
SELECTOR_KEYS = ("app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/component")


def _docs(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    return documents(render(values))


def _container(doc: dict[str, Any]) -> dict[str, Any]:
    spec = pod_spec(doc)
    assert spec is not None
    return spec["containers"][0]


def _platform(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return json.loads(find(docs, "ConfigMap", "-pipeline")["data"]["platform.json"])


def _pod_metadata(doc: dict[str, Any]) -> dict[str, Any]:
    return doc["metadata"] if doc["kind"] == "Pod" else doc["spec"]["template"]["metadata"]


def _everything() -> dict[str, Any]:
    """Values that render every pod of the chart: in-chart PostgreSQL, SeaweedFS, the judge, upload, tests."""
    return {"seaweedfs": {"enabled": True}, "judge": {"enabled": True}}


# The chart's pods that call other services (extraEnv, the CA bundle), as (kind, name suffix, container).
CLIENTS = [
    ("Deployment", "-mlflow", "mlflow"),
    ("Deployment", "-judge", "vllm"),
    ("Job", "-upload", "upload"),
    ("Job", "-bucket", "create-bucket"),
    ("Job", "-db-upgrade", "db-upgrade"),
    ("Pod", "-test-mlflow", "mlflow"),
    ("Pod", "-test-judge", "judge"),
]
# ... and the ones that do not.
SERVERS = [("StatefulSet", "-postgresql"), ("StatefulSet", "-seaweedfs")]
# The chart's Job and `helm test` pods (jobs.*).
JOB_PODS = [("Job", "-upload"), ("Job", "-bucket"), ("Job", "-db-upgrade"), ("Pod", "-test-mlflow"),
            ("Pod", "-test-judge")]  # fmt: skip
# The pods that run the project's slim image (the db-upgrade Job runs MLflow's).
SLIM_PODS = [p for p in JOB_PODS if p[1] != "-db-upgrade"]


# Images ------------------------------------------------------------------------------------------------


def test_the_project_images_have_one_source() -> None:
    """images.* names the slim image of the chart's own pods and all three images of platform.json; by default
    exactly what `rloo pipeline compile` names (rloo.pipeline.images)."""
    docs = _docs(_everything())
    default = {name: f"{DEFAULT_REGISTRY}/rloo-{name}:{DEFAULT_TAG}" for name in IMAGE_EXTRAS}
    assert _platform(docs)["images"] == default
    for kind, suffix in SLIM_PODS:
        c = _container(find(docs, kind, suffix))
        assert (c["image"], c["imagePullPolicy"]) == (default["slim"], "IfNotPresent"), suffix

    values = {
        **_everything(),
        "images": {
            "registry": "registry.corp:5000/ml",
            "tag": "2.0",
            "pullPolicy": "Always",
            "slim": {"digest": DIGEST},
            "train": {"repository": "mirror.corp/gpu/trainer", "tag": "2.0-cuda"},
            "eval": {"tag": "2.1@" + DIGEST},
        },
    }
    docs = _docs(values)
    assert _platform(docs)["images"] == {
        "slim": f"registry.corp:5000/ml/rloo-slim:2.0@{DIGEST}",
        "train": "mirror.corp/gpu/trainer:2.0-cuda",
        "eval": f"registry.corp:5000/ml/rloo-eval:2.1@{DIGEST}",
    }
    for kind, suffix in SLIM_PODS:
        c = _container(find(docs, kind, suffix))
        assert c["image"] == f"registry.corp:5000/ml/rloo-slim:2.0@{DIGEST}", suffix
        assert c["imagePullPolicy"] == "Always", suffix
    # the other images keep their own values
    assert _container(find(docs, "Deployment", "-mlflow"))["imagePullPolicy"] == "IfNotPresent"


# platform.json -----------------------------------------------------------------------------------------


def test_platform_json_always_has_its_six_keys() -> None:
    docs = _docs()
    cm = find(docs, "ConfigMap", "-pipeline")
    assert set(cm["data"]) == {"rloo_pipeline.yaml", "platform.json"}
    assert _platform(docs) == {
        "images": {
            name: f"{DEFAULT_REGISTRY}/rloo-{name}:{DEFAULT_TAG}" for name in ("slim", "train", "eval")
        },
        "imagePullSecrets": [],
        "env": {},
        "caBundle": None,
        "kueue": {"queueName": "", "pytorchJobIntegration": False},
        "s3WorkloadIdentity": False,
    }
    # helm template shows it as JSON, on one line of its own
    text = render()["rloo-kfp/templates/pipeline-configmap.yaml"]
    assert re.search(r"^  platform\.json: \|-\n    \{.*\}$", text, flags=re.M), text[-500:]


def test_platform_json_carries_pull_secrets_env_and_the_ca() -> None:
    values = {
        "imagePullSecrets": ["corp-registry", "mirror"],
        "extraEnv": {"HTTPS_PROXY": "http://proxy:3128", "NCCL_DEBUG": "WARN", "QUOTE": 'it\'s "x" & <y>'},
        "pipeline": {"extraEnv": {"NCCL_DEBUG": "INFO", "NCCL_SOCKET_IFNAME": "eth0"}},
        "caBundle": {"configMap": "corp-ca", "key": "bundle.pem"},
    }
    assert _platform(_docs(values)) == {
        "images": {
            name: f"{DEFAULT_REGISTRY}/rloo-{name}:{DEFAULT_TAG}" for name in ("slim", "train", "eval")
        },
        "imagePullSecrets": ["corp-registry", "mirror"],
        # pipeline.extraEnv wins over extraEnv; the proxy in both cases, NO_PROXY completed (tests/helm/test_env.py)
        "env": {
            "HTTPS_PROXY": "http://proxy:3128",
            "https_proxy": "http://proxy:3128",
            "NO_PROXY": ".svc,.cluster.local,.kubeflow,.rloo,localhost,127.0.0.1",
            "no_proxy": ".svc,.cluster.local,.kubeflow,.rloo,localhost,127.0.0.1",
            "NCCL_DEBUG": "INFO",
            "NCCL_SOCKET_IFNAME": "eth0",
            "QUOTE": 'it\'s "x" & <y>',
        },
        "caBundle": {"configMap": "corp-ca", "key": "bundle.pem"},
        "kueue": {"queueName": "", "pytorchJobIntegration": False},
        "s3WorkloadIdentity": False,
    }
    # pipeline.extraEnv is for the steps only: not in the chart's own containers
    upload = env_of(_container(find(_docs(values), "Job", "-upload")))
    assert upload["NCCL_DEBUG"]["value"] == "WARN" and "NCCL_SOCKET_IFNAME" not in upload


def test_the_upload_applies_platform_json_and_reruns_when_it_changes() -> None:
    docs = _docs()
    job = find(docs, "Job", "-upload")
    c = _container(job)
    i = c["args"].index("--platform")
    assert c["args"][i + 1] == "/etc/rloo/pipeline/platform.json"
    mount = next(m for m in c["volumeMounts"] if m["name"] == "pipeline")
    volume = next(v for v in pod_spec(job)["volumes"] if v["name"] == "pipeline")
    assert c["args"][i + 1] == f"{mount['mountPath']}/platform.json"
    assert volume["configMap"]["name"] == find(docs, "ConfigMap", "-pipeline")["metadata"]["name"]

    def checksum(values: dict[str, Any]) -> str:
        return find(_docs(values), "Job", "-upload")["metadata"]["annotations"]["rloo-kfp/pipeline-sha256"]

    base = checksum({})
    for changed in (
        {"images": {"train": {"digest": DIGEST}}},
        {"images": {"tag": "0.3.0"}},
        {"imagePullSecrets": ["corp-registry"]},
        {"extraEnv": {"HTTPS_PROXY": "http://proxy:3128"}},
        {"pipeline": {"extraEnv": {"NCCL_DEBUG": "INFO"}}},
        {"caBundle": {"configMap": "corp-ca"}},
        {"upload": {"pipelinePackage": (CHART / "files" / "rloo_pipeline.yaml").read_text() + "\n# v2\n"}},
    ):
        assert checksum(changed) != base, changed
    assert checksum({"mlflow": {"replicas": 3}}) == base  # what the upload does not read


# extraEnv and the CA bundle --------------------------------------------------------------------------


def test_extra_env_and_the_ca_bundle_reach_every_client_container() -> None:
    values = {
        **_everything(),
        "extraEnv": {"HTTPS_PROXY": "http://proxy:3128", "NO_PROXY": ".svc,.cluster.local,10.96.0.0/12"},
        "caBundle": {"configMap": "corp-ca", "key": "bundle.pem"},
    }
    docs = _docs(values)
    for kind, suffix, name in CLIENTS:
        doc = find(docs, kind, suffix)
        spec = pod_spec(doc)
        (c,) = [c for c in spec["containers"] if c["name"] == name]
        env = env_of(c)
        names = [e["name"] for e in c["env"]]
        assert env["HTTPS_PROXY"]["value"] == env["https_proxy"]["value"] == "http://proxy:3128", suffix
        no_proxy = ".svc,.cluster.local,10.96.0.0/12,.kubeflow,.rloo,localhost,127.0.0.1"
        assert env["NO_PROXY"]["value"] == env["no_proxy"]["value"] == no_proxy, suffix
        # extraEnv (completed) before the chart's variables, the CA's after them
        proxy_env = {"HTTPS_PROXY", "https_proxy", "NO_PROXY", "no_proxy"}
        assert set(names[:4]) == proxy_env, (suffix, names)
        for var in CA_VARIABLES:
            assert env[var]["value"] == "/etc/rloo/ca/bundle.pem", (suffix, var)
        assert {"name": "ca-bundle", "mountPath": "/etc/rloo/ca", "readOnly": True} in c["volumeMounts"]
        assert {"name": "ca-bundle", "configMap": {"name": "corp-ca"}} in spec["volumes"], suffix
        assert len(names) == len(set(names)), (suffix, names)
    for kind, suffix in SERVERS:
        for c in containers(pod_spec(find(docs, kind, suffix))):
            assert not set(env_of(c)) & {"HTTPS_PROXY", *CA_VARIABLES}, suffix
    # without them: nothing added
    docs = _docs(_everything())
    for kind, suffix, _ in CLIENTS:
        spec = pod_spec(find(docs, kind, suffix))
        assert "ca-bundle" not in {v["name"] for v in spec["volumes"]}
        for c in spec["containers"]:
            assert not set(env_of(c)) & {"HTTPS_PROXY", *CA_VARIABLES}, suffix


def test_component_env_lists_reach_only_their_containers() -> None:
    secret_env = {"name": "PGSSLROOTCERT", "value": "/etc/pg-ca/ca.crt"}
    from_field = {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}
    judge_env = {"name": "VLLM_LOGGING_LEVEL", "value": "WARNING"}
    docs = _docs({**_everything(), "mlflow": {"extraEnv": [secret_env, from_field]}, "judge": {"enabled": True, "extraEnv": [judge_env]}})  # fmt: skip
    for suffix in ("-mlflow", "-db-upgrade"):  # the db-upgrade Job connects to the same database
        doc = find(docs, "Deployment" if suffix == "-mlflow" else "Job", suffix)
        env = _container(doc)["env"]
        assert env[-2:] == [secret_env, from_field], suffix  # after the chart's own
    assert _container(find(docs, "Deployment", "-judge"))["env"][-1] == judge_env
    for kind, suffix in (("Job", "-upload"), ("Pod", "-test-mlflow"), ("Deployment", "-judge")):
        assert "PGSSLROOTCERT" not in env_of(_container(find(docs, kind, suffix)))
    assert "VLLM_LOGGING_LEVEL" not in env_of(_container(find(docs, "Deployment", "-mlflow")))


# Pod extras --------------------------------------------------------------------------------------------


def _extras(tag: str) -> dict[str, Any]:
    return {
        "podAnnotations": {"example.com/owner": tag},
        "podLabels": {"team": tag},
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {"matchExpressions": [{"key": "pool", "operator": "In", "values": [tag]}]}
                    ]
                }
            }
        },
        "extraVolumes": [{"name": "extra", "secret": {"secretName": f"{tag}-files"}}],
        "extraVolumeMounts": [{"name": "extra", "mountPath": "/etc/extra", "readOnly": True}],
    }


@pytest.mark.parametrize(
    ("component", "kind", "container"),
    [
        ("mlflow", "Deployment", "mlflow"),
        ("postgresql", "StatefulSet", "postgresql"),
        ("seaweedfs", "StatefulSet", "seaweedfs"),
        ("judge", "Deployment", "vllm"),
    ],
)
def test_pod_extras_of_each_component(component: str, kind: str, container: str) -> None:
    values = _everything()
    values[component] = {**values.get(component, {}), **_extras(component)}
    docs = _docs(values)
    doc = find(docs, kind, f"-{component}")
    meta = _pod_metadata(doc)
    assert meta["annotations"]["example.com/owner"] == component
    assert meta["labels"]["team"] == component
    assert doc["spec"]["selector"]["matchLabels"].items() <= meta["labels"].items()
    spec = pod_spec(doc)
    assert spec["affinity"] == _extras(component)["affinity"]
    assert {"name": "extra", "secret": {"secretName": f"{component}-files"}} in spec["volumes"]
    (c,) = [c for c in spec["containers"] if c["name"] == container]
    assert {"name": "extra", "mountPath": "/etc/extra", "readOnly": True} in c["volumeMounts"]
    # nothing of it reaches another component
    for other in ("-mlflow", "-postgresql", "-seaweedfs", "-judge"):
        if other != f"-{component}":
            d = next(
                d
                for d in docs
                if d["kind"] in ("Deployment", "StatefulSet") and d["metadata"]["name"].endswith(other)
            )
            assert "team" not in _pod_metadata(d)["labels"], other
            assert "affinity" not in pod_spec(d), other


def test_pod_labels_never_replace_selector_labels(tmp_path: Path) -> None:
    """The chart refuses a podLabels entry named like a selector label, in one line naming the value (helm
    --skip-schema-validation does not skip it); and without the schema and the chart's checks the selector labels
    still win, with no repeated key."""
    import helm_python as helm

    for component in ("mlflow", "postgresql", "seaweedfs", "judge", "jobs"):
        for key in SELECTOR_KEYS:
            with pytest.raises(helm.HelmRenderError) as err:
                render({component: {"podLabels": {key: "other"}}})
            assert (
                f"{component}.podLabels sets {key}, one of the chart's selector labels (app.kubernetes.io/name, "
                "instance, component): remove it" in str(err.value)
            ), str(err.value)
    with helm.Chart.load(CHART) as c:
        c.save_dir(tmp_path)
    (tmp_path / "rloo-kfp" / "values.schema.json").unlink()
    (tmp_path / "rloo-kfp" / "templates" / "validate.yaml").unlink()
    hostile = {key: "other" for key in SELECTOR_KEYS} | {"team": "a"}
    values = _everything()
    for component in ("mlflow", "postgresql", "seaweedfs", "judge", "jobs"):
        values[component] = {**values.get(component, {}), "podLabels": hostile}
    with helm.Chart.load(tmp_path / "rloo-kfp") as bare:
        rendered = bare.render(with_test_values(values), name="rel", namespace="rloo")
    for text in rendered.values():
        for match in re.finditer(r"^( *)labels:\n((?:\1  .*\n)+)", text, flags=re.M):
            keys = re.findall(r"^ *([^\s:]+):", match.group(2), flags=re.M)
            assert len(keys) == len(set(keys)), keys  # PyYAML would keep the last of a repeated key
    pods = [d for d in documents(rendered) if pod_spec(d) is not None]
    assert len(pods) == 9  # every pod of the chart
    for doc in pods:
        labels = _pod_metadata(doc)["labels"]
        assert labels["team"] == "a" and "other" not in labels.values(), doc["metadata"]["name"]


def test_jobs_extras_reach_every_job_and_test_pod() -> None:
    extras = _extras("jobs")
    jobs = {
        "podAnnotations": extras["podAnnotations"],
        "podLabels": extras["podLabels"],
        "nodeSelector": {"kubernetes.io/os": "linux"},
        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "system", "effect": "NoSchedule"}],
        "affinity": extras["affinity"],
        "podSecurityContext": {"runAsUser": 2000, "runAsGroup": 2000, "fsGroup": 2000},
    }
    docs = _docs({**_everything(), "jobs": jobs})
    for kind, suffix in JOB_PODS:
        doc = find(docs, kind, suffix)
        meta, spec = _pod_metadata(doc), pod_spec(doc)
        assert meta["annotations"]["example.com/owner"] == "jobs", suffix
        assert meta["labels"]["team"] == "jobs", suffix
        assert meta["labels"]["app.kubernetes.io/component"] != "jobs"
        assert spec["nodeSelector"] == jobs["nodeSelector"], suffix
        assert spec["tolerations"] == jobs["tolerations"], suffix
        assert spec["affinity"] == jobs["affinity"], suffix
        # db-upgrade runs MLflow's image as MLflow's user
        expected = 1000 if suffix == "-db-upgrade" else 2000
        assert spec["securityContext"]["runAsUser"] == expected, suffix
    for kind, suffix in (("Deployment", "-mlflow"), ("StatefulSet", "-postgresql")):
        assert "nodeSelector" not in pod_spec(find(docs, kind, suffix))
    # helm's hook annotations stay the chart's
    test_pod = find(
        _docs({"jobs": {"podAnnotations": {"helm.sh/hook": "post-install"}}}), "Pod", "-test-mlflow"
    )
    assert test_pod["metadata"]["annotations"]["helm.sh/hook"] == "test"


# Placement, Service and ServiceAccount annotations, component digests ---------------------------------------

SERVER_PODS = {
    "mlflow": "Deployment",
    "postgresql": "StatefulSet",
    "seaweedfs": "StatefulSet",
    "judge": "Deployment",
}


def _pods(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [d for d in docs if pod_spec(d) is not None]


def _targets(component: str) -> list[tuple[str, str]]:
    return JOB_PODS if component == "jobs" else [(SERVER_PODS[component], f"-{component}")]


@pytest.mark.parametrize("component", [*SERVER_PODS, "jobs"])
def test_priority_class_and_topology_spread_of_each_component(component: str) -> None:
    spread = [
        {
            "maxSkew": 1,
            "topologyKey": "topology.kubernetes.io/zone",
            "whenUnsatisfiable": "ScheduleAnyway",
            "labelSelector": {"matchLabels": {"app.kubernetes.io/component": component}},
        }
    ]
    values = _everything()
    values[component] = {
        **values.get(component, {}),
        "priorityClassName": f"{component}-priority",
        "topologySpreadConstraints": spread,
    }
    docs = _docs(values)
    targets = [find(docs, kind, suffix) for kind, suffix in _targets(component)]
    for doc in _pods(docs):
        spec = pod_spec(doc)
        if any(doc is t for t in targets):
            assert spec["priorityClassName"] == f"{component}-priority", doc["metadata"]["name"]
            assert spec["topologySpreadConstraints"] == spread, doc["metadata"]["name"]
        else:  # nothing of it reaches another component
            assert "priorityClassName" not in spec and "topologySpreadConstraints" not in spec, doc[
                "metadata"
            ]
    for doc in _pods(_docs(_everything())):  # by default: none
        assert not {"priorityClassName", "topologySpreadConstraints", "runtimeClassName"} & set(pod_spec(doc))


def test_the_judge_runtime_class() -> None:
    docs = _docs({**_everything(), "judge": {"enabled": True, "runtimeClassName": "nvidia"}})
    for doc in _pods(docs):
        expected = (
            "nvidia" if doc["metadata"]["name"].endswith("-judge") and doc["kind"] == "Deployment" else None
        )
        assert pod_spec(doc).get("runtimeClassName") == expected, doc["metadata"]["name"]


def test_mlflow_service_and_service_account_annotations() -> None:
    internal = {"service.beta.kubernetes.io/aws-load-balancer-internal": "true"}
    irsa = {"eks.amazonaws.com/role-arn": "arn:aws:iam::123456789012:role/rloo"}
    docs = _docs({**_everything(), "mlflow": {"service": {"annotations": internal}}, "serviceAccount": {"annotations": irsa}})  # fmt: skip
    assert find(docs, "Service", "-mlflow")["metadata"]["annotations"] == internal
    for svc in (d for d in docs if d["kind"] == "Service" and not d["metadata"]["name"].endswith("-mlflow")):
        assert "annotations" not in svc["metadata"], svc["metadata"]["name"]
    (sa,) = [d for d in docs if d["kind"] == "ServiceAccount"]
    assert sa["metadata"]["annotations"] == irsa and sa["automountServiceAccountToken"] is False
    # the pods that run as it
    for doc in _pods(docs):
        if doc["metadata"]["name"].endswith("-db-upgrade"):
            continue  # a pre-upgrade hook: the namespace's default
        assert pod_spec(doc)["serviceAccountName"] == sa["metadata"]["name"], doc["metadata"]["name"]
    defaults = _docs()
    assert "annotations" not in find(defaults, "Service", "-mlflow")["metadata"]
    assert "annotations" not in next(d for d in defaults if d["kind"] == "ServiceAccount")["metadata"]


@pytest.mark.parametrize("component", list(SERVER_PODS))
def test_component_images_take_a_digest(component: str) -> None:
    values = _everything()
    values[component] = {**values.get(component, {}), "image": {"digest": DIGEST}}
    docs = _docs(values)
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())[component]["image"]
    reference = f"{defaults['repository']}:{defaults['tag']}@{DIGEST}"
    spec = pod_spec(find(docs, SERVER_PODS[component], f"-{component}"))
    assert {c["image"] for c in containers(spec)} == {reference}
    if component == "mlflow":  # the db-upgrade Job runs MLflow's image
        assert _container(find(docs, "Job", "-db-upgrade"))["image"] == reference
    # a tag that names its own digest is taken as it is
    values[component]["image"] = {"tag": f"{defaults['tag']}@{DIGEST}"}
    spec = pod_spec(find(_docs(values), SERVER_PODS[component], f"-{component}"))
    assert {c["image"] for c in containers(spec)} == {reference}


def test_jobs_extra_volumes_reach_every_job_and_test_container() -> None:
    volume = {"name": "corp-tools", "configMap": {"name": "corp-tools"}}
    mount = {"name": "corp-tools", "mountPath": "/etc/corp-tools", "readOnly": True}
    mlflow_volume = {"name": "pg-ca", "secret": {"secretName": "pg-ca"}}
    values = {
        **_everything(),
        "jobs": {"extraVolumes": [volume], "extraVolumeMounts": [mount]},
        "mlflow": {"extraVolumes": [mlflow_volume]},
    }
    docs = _docs(values)
    for kind, suffix in JOB_PODS:
        spec = pod_spec(find(docs, kind, suffix))
        assert volume in spec["volumes"], suffix
        for c in containers(spec):
            assert mount in c["volumeMounts"], (suffix, c["name"])
    assert mlflow_volume in pod_spec(find(docs, "Job", "-db-upgrade"))["volumes"]  # beside mlflow's own
    for kind, suffix in (("Deployment", "-mlflow"), ("StatefulSet", "-postgresql"), ("StatefulSet", "-seaweedfs"), ("Deployment", "-judge")):  # fmt: skip
        spec = pod_spec(find(docs, kind, suffix))
        assert volume not in spec["volumes"], suffix


def test_upload_resources_size_the_bucket_job_too() -> None:
    resources = {"requests": {"cpu": "200m", "memory": "300Mi"}, "limits": {"cpu": "2", "memory": "3Gi"}}
    docs = _docs({"seaweedfs": {"enabled": True}, "upload": {"resources": resources}})
    assert _container(find(docs, "Job", "-bucket"))["resources"] == resources
    assert _container(find(docs, "Job", "-upload"))["resources"] == resources
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert "the bucket Job" in schema["properties"]["upload"]["properties"]["resources"]["description"]


# Upload: multi-user KFP and Istio ----------------------------------------------------------------------


def test_upload_into_a_profile_namespace() -> None:
    c = _container(find(_docs({"upload": {"namespace": "kubeflow-user-example-com"}}), "Job", "-upload"))
    i = c["args"].index("--namespace")
    assert c["args"][i + 1] == "kubeflow-user-example-com"
    assert "--namespace" not in _container(find(_docs(), "Job", "-upload"))["args"]


@pytest.mark.parametrize("sidecar", [False, True])
def test_hook_pods_and_the_istio_sidecar(sidecar: bool) -> None:
    docs = _docs({**_everything(), "upload": {"istioSidecar": sidecar}})
    upload = find(docs, "Job", "-upload")
    ann = _pod_metadata(upload).get("annotations") or {}
    args = _container(upload)["args"]
    if sidecar:
        # the upload starts once its sidecar is up and tells it to quit when done
        assert "sidecar.istio.io/inject" not in ann
        assert json.loads(ann["proxy.istio.io/config"]) == {"holdApplicationUntilProxyStarts": True}
        assert "--stop-istio-sidecar" in args
    else:
        assert ann["sidecar.istio.io/inject"] == "false"
        assert "proxy.istio.io/config" not in ann and "--stop-istio-sidecar" not in args
    # the other hook Jobs and the helm test pods never run a sidecar: it would never exit
    for kind, suffix in (
        ("Job", "-bucket"),
        ("Job", "-db-upgrade"),
        ("Pod", "-test-mlflow"),
        ("Pod", "-test-judge"),
    ):
        assert _pod_metadata(find(docs, kind, suffix))["annotations"]["sidecar.istio.io/inject"] == "false"


# MLflow: scratch, db-upgrade, PodDisruptionBudget ------------------------------------------------------


def test_mlflow_scratch_size() -> None:
    def tmp(values: dict[str, Any]) -> dict[str, Any]:
        deploy = find(_docs(values), "Deployment", "-mlflow")
        volume = next(v for v in pod_spec(deploy)["volumes"] if v["name"] == "tmp")
        assert env_of(_container(deploy))["MLFLOW_TMP_DIR"]["value"] == "/tmp"
        assert {"name": "tmp", "mountPath": "/tmp"} in _container(deploy)["volumeMounts"]
        return volume["emptyDir"]

    assert tmp({}) == {"sizeLimit": "4Gi"}
    assert tmp({"mlflow": {"scratchSize": "32Gi"}}) == {"sizeLimit": "32Gi"}


@pytest.mark.parametrize(
    ("values", "hook"),
    [
        ({}, "pre-upgrade"),  # the in-chart PostgreSQL does not exist before the install
        (variant_values("external-db-values.yaml"), "pre-install,pre-upgrade"),
    ],
)
def test_db_upgrade_job_is_a_pre_upgrade_hook(values: dict[str, Any], hook: str) -> None:
    docs = _docs(values)
    job = find(docs, "Job", "-db-upgrade")
    ann = job["metadata"]["annotations"]
    assert ann["helm.sh/hook"] == hook
    assert ann["helm.sh/hook-delete-policy"] == "before-hook-creation,hook-succeeded"
    assert job["spec"]["backoffLimit"] == 2 and job["spec"]["activeDeadlineSeconds"] == 900
    spec = pod_spec(job)
    # before the install the chart's ServiceAccount does not exist: the namespace's default, no token
    assert "serviceAccountName" not in spec and spec["automountServiceAccountToken"] is False
    assert spec["restartPolicy"] == "Never"
    c = _container(job)
    deploy = _container(find(docs, "Deployment", "-mlflow"))
    assert c["image"] == deploy["image"]
    assert c["command"] + c["args"] == ["mlflow", "db", "upgrade", "$(MLFLOW_BACKEND_STORE_URI)"]
    for name in ("MLFLOW_BACKEND_STORE_URI", "PGPASSWORD", "HOME", "USER"):
        assert env_of(c)[name] == env_of(deploy)[name], name
    assert c["resources"] == {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"cpu": "1", "memory": "1Gi"}}  # fmt: skip
    assert not [d for d in _docs({"mlflow": {"dbUpgrade": {"enabled": False}}}) if d["metadata"]["name"].endswith("-db-upgrade")]  # fmt: skip


def _expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' expansion of command and args: $(NAME) of a defined variable is replaced, $$ is a literal $,
    anything else is kept as written."""
    out, i = [], 0
    while i < len(text):
        if text.startswith("$$", i):
            out.append("$")
            i += 2
        elif text.startswith("$(", i) and ")" in text[i:]:
            end = text.index(")", i)
            name = text[i + 2 : end]
            out.append(env[name] if name in env else text[i : end + 1])
            i = end + 1
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def test_kubernetes_expansion_stand_in() -> None:
    assert _expand("a $(X) $$(X) $(Y) $(", {"X": "1"}) == "a 1 $(X) $(Y) $("


def test_db_upgrade_command_runs_twice_against_a_database(tmp_path: Path) -> None:
    """The Job's own command and environment, expanded as Kubernetes does, run with this environment's MLflow
    (the release the chart's image pins) against a sqlite database in place of PostgreSQL: the first run creates
    MLflow's schema, the second finds it current (idempotent), and the schema is the one the server expects."""
    job = find(_docs(variant_values("external-db-values.yaml")), "Job", "-db-upgrade")
    c = _container(job)
    db = tmp_path / "mlflow.db"
    env = {}
    for e in c["env"]:
        if "value" in e:  # literal values; absolute paths move under tmp_path (the pod's volumes)
            value = str(e["value"])
            env[e["name"]] = str(tmp_path / value.lstrip("/")) if value.startswith("/") else value
    assert env["MLFLOW_BACKEND_STORE_URI"].startswith("postgresql+psycopg2://")
    env["MLFLOW_BACKEND_STORE_URI"] = f"sqlite:///{db}"  # the database, here
    for d in ("home/mlflow", "tmp"):
        (tmp_path / d).mkdir(parents=True, exist_ok=True)
    argv = [_expand(a, env) for a in c["command"] + c["args"]]
    assert argv[0] == "mlflow" and argv[-1] == f"sqlite:///{db}", argv
    argv[0] = str(Path(sys.executable).with_name("mlflow"))
    run_env = {"PATH": str(Path(sys.executable).parent) + ":/usr/bin:/bin", **env}
    verify = (
        "import sys; from mlflow.store.db.utils import _verify_schema, create_sqlalchemy_engine;"
        "_verify_schema(create_sqlalchemy_engine(sys.argv[1])); print('schema current')"
    )
    for attempt in (1, 2):
        proc = subprocess.run(argv, env=run_env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
        assert proc.returncode == 0, (attempt, proc.stdout[-2000:], proc.stderr[-2000:])
        check = subprocess.run(
            [sys.executable, "-c", verify, f"sqlite:///{db}"], capture_output=True, text=True, timeout=300
        )
        assert check.returncode == 0 and "schema current" in check.stdout, (attempt, check.stderr[-2000:])


def test_pod_disruption_budget_only_with_replicas() -> None:
    assert not [d for d in _docs() if d["kind"] == "PodDisruptionBudget"]
    docs = _docs({"mlflow": {"replicas": 2}})
    pdb = find(docs, "PodDisruptionBudget", "-mlflow")
    assert pdb["spec"]["maxUnavailable"] == 1 and "minAvailable" not in pdb["spec"]
    assert pdb["spec"]["selector"] == find(docs, "Deployment", "-mlflow")["spec"]["selector"]


# NetworkPolicies: every pod that talks to PostgreSQL or SeaweedFS is admitted ---------------------------


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    return (selector.get("matchLabels") or {}).items() <= labels.items() and not selector.get(
        "matchExpressions"
    )


def _admitted(
    docs: list[dict[str, Any]], target: dict[str, str], client: dict[str, str], port: int | str
) -> bool:
    """Whether a pod labelled ``client`` in the release namespace reaches ``port`` of the pods labelled ``target``
    through some NetworkPolicy of ``docs`` (hooks included: they exist while the hook runs)."""
    for policy in (d for d in docs if d["kind"] == "NetworkPolicy"):
        if not _selects(policy["spec"]["podSelector"], target):
            continue
        for rule in policy["spec"].get("ingress") or []:
            ports = [p["port"] for p in rule.get("ports") or []]
            if ports and port not in ports:
                continue
            for peer in rule.get("from") or []:
                if (
                    "namespaceSelector" not in peer
                    and "podSelector" in peer
                    and _selects(peer["podSelector"], client)
                ):
                    return True
    return False


@pytest.mark.parametrize("variant", VARIANTS)
def test_network_policies_admit_every_database_and_s3_client(variant: str) -> None:
    values = variant_values(variant)
    docs = _docs(values)
    if not [d for d in docs if d["kind"] == "NetworkPolicy"]:
        pytest.skip("networkPolicy.enabled is false")
    pods = [d for d in docs if pod_spec(d) is not None]
    for server, port, uses in (
        ("-postgresql", 5432, lambda env: "PGPASSWORD" in env),
        ("-seaweedfs", "s3", lambda env: "seaweedfs" in str(env)),
    ):
        target = [d for d in docs if d["kind"] == "StatefulSet" and d["metadata"]["name"].endswith(server)]
        if not target:
            continue
        target_labels = target[0]["spec"]["template"]["metadata"]["labels"]
        for pod in pods:
            if pod is target[0] or not any(uses(env_of(c)) for c in pod_spec(pod)["containers"]):
                continue
            labels = _pod_metadata(pod)["labels"]
            assert _admitted(docs, target_labels, labels, port), (variant, server, pod["metadata"]["name"])


def test_the_db_upgrade_policy_is_a_hook_beside_the_job() -> None:
    """The db-upgrade Job runs before the release's own policies change, so its admission to PostgreSQL is a hook
    of its own (created first, deleted with the Job): it holds on the first upgrade from a release without it."""
    docs = _docs()
    policy = find(docs, "NetworkPolicy", "-db-upgrade")
    job = find(docs, "Job", "-db-upgrade")
    ann, job_ann = policy["metadata"]["annotations"], job["metadata"]["annotations"]
    assert ann["helm.sh/hook"] == job_ann["helm.sh/hook"] == "pre-upgrade"
    assert int(ann["helm.sh/hook-weight"]) < int(job_ann["helm.sh/hook-weight"])
    assert ann["helm.sh/hook-delete-policy"] == "before-hook-creation,hook-succeeded"
    main = find(docs, "NetworkPolicy", "-postgresql")
    labels = _pod_metadata(job)["labels"]
    pg = find(docs, "StatefulSet", "-postgresql")["spec"]["template"]["metadata"]["labels"]
    assert not _admitted([main], pg, labels, 5432)  # the release's own policy admits MLflow only
    assert _admitted([policy], pg, labels, 5432)
    assert not _admitted([policy], pg, _pod_metadata(find(docs, "Job", "-upload"))["labels"], 5432)


# README ------------------------------------------------------------------------------------------------


def test_readme_has_a_guide_for_platform_teams() -> None:
    readme = (CHART / "README.md").read_text()
    assert "## For platform teams" in readme
    section = readme[readme.index("## For platform teams") :]
    section = section[: section.index("\n## ", 4)] if "\n## " in section[4:] else section
    for needed in (
        "images.registry",
        "images.slim.digest",
        "build/images.json",
        "make push-images",
        "imagePullSecrets",
        "platform.json",
        "NO_PROXY",
        ".svc,.cluster.local",
        "caBundle.configMap",
        "useDefaultCAs: true",
        "upload.namespace",
        "upload.istioSidecar",
        "pipeline.serviceAccountName=default-editor",
        "mlflow db upgrade",
        "pg_dump",
        "pg_restore",
        "volumeClaimTemplates",
    ):
        assert needed in section, needed
    # every value the README names exists (no stale names such as upload.image)
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    named = set(re.findall(r"`([a-zA-Z]\w*(?:\.\w+)+)`", readme))  # `images.slim.digest`
    named |= set(re.findall(r"--set(?:-string|-file)? '?([a-zA-Z]\w*(?:\.\w+)*)=", readme))  # --set x.y=
    named = {n for n in named if n.split(".")[0] in values}
    assert {"images.slim.digest", "upload.istioSidecar", "caBundle.configMap"} <= named
    for name in named:
        node: Any = values
        for key in name.split("."):
            assert isinstance(node, dict) and key in node, (
                f"helm/README.md names {name}, which is not a value"
            )
            node = node[key]
    assert (
        "upload.image" not in readme and "tests.image" not in readme and "jobPodSecurityContext" not in readme
    )


def _commands(text: str) -> list[str]:
    """Shell commands of the fenced bash blocks of ``text``, continuation lines joined."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        joined = re.sub(r"\\\n\s*", " ", block)
        out += [
            line.strip() for line in joined.splitlines() if line.strip() and not line.strip().startswith("#")
        ]
    return out


def test_readme_helm_install_and_upgrade_commands_wait_long_enough() -> None:
    """The hooks' deadlines are 600 to 900 s and Helm waits 5 minutes by default."""
    readme = (CHART / "README.md").read_text()
    commands = [c for c in _commands(readme) if re.match(r"helm (install|upgrade)\b", c)]
    assert len(commands) >= 8
    for command in commands:
        assert "--timeout 15m" in command, command
    jobs = [d for d in _docs({"seaweedfs": {"enabled": True}}) if d["kind"] == "Job"]
    hooks = [d["spec"]["activeDeadlineSeconds"] for d in jobs]
    assert max(hooks) <= 15 * 60 and max(hooks) > 5 * 60
    assert readme.count("5 minutes by default") == 1  # said once


def test_readme_istio_guide_keeps_the_servers_out_of_the_mesh_from_the_first_install() -> None:
    readme = (CHART / "README.md").read_text()
    section = readme[readme.index("### Multi-user Kubeflow and Istio") : readme.index("### Upgrades")]
    (block,) = re.findall(r"```yaml\n# istio-values.yaml.*?\n(.*?)```", section, flags=re.S)
    istio = yaml.safe_load(block)
    assert set(istio) == {"mlflow", "postgresql", "seaweedfs", "judge"}
    install = [c for c in _commands(section) if c.startswith("helm upgrade --install")]
    assert (
        len(install) == 1
        and "-f istio-values.yaml" in install[0]
        and "upload.istioSidecar=true" in install[0]
    )
    # the file works with the chart: every server pod without a sidecar
    values = {k: {**v, "enabled": True} if k in ("judge", "seaweedfs") else v for k, v in istio.items()}
    docs = _docs(values)
    for component, kind in SERVER_PODS.items():
        meta = _pod_metadata(find(docs, kind, f"-{component}"))
        assert meta["annotations"]["sidecar.istio.io/inject"] == "false", component
    # an existing install: the one upgrade that adds them runs without the db-upgrade hook (it would be denied by
    # the still-sidecar'd PostgreSQL), then the hook is turned on again
    upgrades = [c for c in _commands(section) if c.startswith("helm upgrade rloo")]
    assert "--set mlflow.dbUpgrade.enabled=false" in upgrades[0] and "-f istio-values.yaml" in upgrades[0]
    assert "--set mlflow.dbUpgrade.enabled=true" in upgrades[1]
    assert "podAnnotations.sidecar" not in section  # no --set-string after the install
    assert "FIRST install" in section and "deadlock" in section


def test_readme_images_snippet(tmp_path: Path) -> None:
    """The build/images.json -> values snippet: each pushed image by repository, digest and the pushed tag (a
    train-cpu record under its own name), and a message instead of an empty `images:` when nothing was pushed."""
    readme = (CHART / "README.md").read_text()
    (snippet,) = re.findall(r"python3 - > build/images-values.yaml <<'EOF'\n(.*?)\nEOF\n", readme, flags=re.S)
    assert '--set images.registry="$RLOO_IMAGE_REGISTRY"' in readme
    (tmp_path / "build").mkdir()
    record = tmp_path / "build" / "images.json"
    d1, d2 = "sha256:" + "1" * 64, "sha256:" + "2" * 64
    env = {"PATH": "/usr/bin:/bin", "RLOO_IMAGE_TAG": "0.2.0-corp1"}

    def run() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-c", snippet], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
        )

    record.write_text(
        json.dumps(
            {
                "slim": f"reg.corp/ml/rloo-slim@{d1}",
                "train-cpu": f"reg.corp/ml/rloo-train-cpu@{d2}",
                "eval": "reg.corp/ml/rloo-eval:0.2.0-corp1",  # built, not pushed
            }
        )
    )
    proc = run()
    assert proc.returncode == 0, proc.stderr
    values = yaml.safe_load(proc.stdout)
    assert values == {
        "images": {
            "slim": {"repository": "reg.corp/ml/rloo-slim", "digest": d1, "tag": "0.2.0-corp1"},
            "train": {"repository": "reg.corp/ml/rloo-train-cpu", "digest": d2, "tag": "0.2.0-corp1"},
        }
    }
    values["images"] |= {"registry": "reg.corp/ml", "tag": "0.2.0-corp1"}  # the guide's --set
    assert _platform(_docs(values))["images"] == {
        "slim": f"reg.corp/ml/rloo-slim:0.2.0-corp1@{d1}",
        "train": f"reg.corp/ml/rloo-train-cpu:0.2.0-corp1@{d2}",
        "eval": "reg.corp/ml/rloo-eval:0.2.0-corp1",
    }
    record.write_text(json.dumps({"slim": "reg.corp/ml/rloo-slim:0.2.0-corp1"}))
    proc = run()
    assert proc.returncode != 0 and proc.stdout == "" and "run make push-images" in proc.stderr


def test_docs_say_what_the_chart_does() -> None:
    readme = (CHART / "README.md").read_text()
    values_yaml = (CHART / "values.yaml").read_text()
    for text in (readme, values_yaml):
        # a repeated name is refused now, never kept or overridden
        assert "keeps the chart's value" not in text and "repeated name overrides" not in text
    assert "`images.<name>.tag` (not the shared `images.tag`)" in readme
    upgrades = readme[readme.index("### Upgrades") : readme.index("### Backups")]
    assert "`helm rollback` does not downgrade MLflow's schema" in upgrades
    backups = readme[readme.index("### Backups") : readme.index("## Values")]
    assert "lands on the machine running kubectl" in backups
    proxies = readme[readme.index("### Proxies") : readme.index("### Multi-user")]
    assert "only for clients that call IP addresses" in proxies and ".kubeflow" in proxies
    assert "kubeflow/pipelines#9702" in proxies
    description = yaml.safe_load((CHART / "Chart.yaml").read_text())["description"]
    assert description.index("Kubeflow Trainer v2 (TrainJob)") < description.index("legacy Kubeflow")


# The upload Job as the CLI runs it -------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_upload_job_runs_the_cli_on_what_the_chart_renders(variant: str, tmp_path: Path) -> None:
    """The rendered Job's arguments parse with `rloo pipeline`'s own parser, and platform.json applied to the
    rendered pipeline by rloo.pipeline.platform_overlay (what the Job does) names the images of images.* in every
    step and in the multi-node job: the chart's values are the one source of the images a release runs."""
    from rloo.cli.pipeline_cmd import build_parser
    from rloo.pipeline import platform_overlay

    docs = _docs(variant_values(variant))
    job = next((d for d in docs if d["kind"] == "Job" and d["metadata"]["name"].endswith("-upload")), None)
    if job is None:
        pytest.skip("upload disabled in this variant")
    c = _container(job)
    assert c["command"][:2] == ["rloo", "pipeline"]
    ns = build_parser().parse_args([*c["command"][2:], *c["args"]])
    assert ns.action == "upload" and ns.platform and ns.package
    cm = find(docs, "ConfigMap", "-pipeline")["data"]
    mount = next(m["mountPath"] for m in c["volumeMounts"] if m["name"] == "pipeline")
    files = {f"{mount}/{k}": v for k, v in cm.items()}
    settings = platform_overlay.parse(json.loads(files[ns.platform]), "platform.json")
    spec, k8s = (d for d in yaml.safe_load_all(platform_overlay.apply(files[ns.package], settings)) if d)
    expected = _platform(docs)["images"]
    for name, executor in spec["deploymentSpec"]["executors"].items():
        assert executor["container"]["image"] == expected[platform_overlay.EXECUTOR_IMAGES[name]], name
    assert {v["runtimeValue"]["constant"] for v in platform_overlay._task_inputs(spec, "train_image")} == {
        expected["train"]
    }
    pulls = [
        p["secretName"]
        for p in k8s["platforms"]["kubernetes"]["deploymentSpec"]["executors"]["exec-evaluate"].get(
            "imagePullSecret", []
        )
    ]
    assert pulls == variant_values(variant).get("imagePullSecrets", [])
    assert ns.namespace == ((variant_values(variant).get("upload") or {}).get("namespace") or None)


def test_the_chart_mounts_the_ca_where_the_steps_do() -> None:
    from rloo.k8s import platform

    assert CA_VARIABLES == platform.CA_ENV
    docs = _docs({"caBundle": {"configMap": "corp-ca", "key": "bundle.pem"}})
    c = _container(find(docs, "Job", "-upload"))
    env = env_of(c)
    assert {k: env[k]["value"] for k in platform.CA_ENV} == dict.fromkeys(
        platform.CA_ENV, f"{platform.CA_DIR}/bundle.pem"
    )
    assert any(m["mountPath"] == platform.CA_DIR for m in c["volumeMounts"])
