"""The chart against what the cluster's other parts do with what it renders: KFP's driver replaces the steps'
proxy variables with its own, Kueue queues only labelled pods and PyTorchJobs it was told to manage, IRSA gives
credentials no Secret holds, Helm hands a subchart the parent's globals, the kubelet cannot pull an image nobody
published, and an air-gapped judge cannot reach the Hub."""

from __future__ import annotations

import json
import re
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from rloo.errors import UserError
from rloo.k8s.platform import from_env
from rloo.pipeline import platform_overlay
from rloo.pipeline.images import DEFAULT_REGISTRY
from rloo.stages.constants import S3_SECRET_KEYS
from tests.helm.helpers import (
    CHART,
    NAMESPACE,
    RELEASE,
    documents,
    env_of,
    find,
    pod_spec,
    render,
    variant_values,
    with_test_values,
)

PASSWORD = "s3cr3t-Pa55"
# KFP's NO_PROXY when its API server has a proxy and no NO_PROXY (kubeflow/pipelines
# backend/src/apiserver/config/proxy/config.go, getDefaultNoProxyValue, cluster domain cluster.local).
KFP_DEFAULT_NO_PROXY = (
    "localhost,127.0.0.1,.svc.cluster.local,kubernetes.default.svc,minio-service.kubeflow,"
    "metadata-grpc-service,metadata-grpc-service.kubeflow,ml-pipeline.kubeflow"
)
SUBMIT = re.compile(r"--param judge_base_url=(\S+)")
SECRET_LITERAL = re.compile(r"--from-literal=(MLFLOW_TRACKING_URI|S3_ENDPOINT_URL)='([^']*)'")


def _docs(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    return documents(render(values))


def _notes(values: dict[str, Any] | None = None) -> str:
    return render(values)["rloo-kfp/templates/NOTES.txt"]


def _platform_json(values: dict[str, Any] | None = None) -> dict[str, Any]:
    return json.loads(find(_docs(values), "ConfigMap", "-pipeline")["data"]["platform.json"])


def _container(doc: dict[str, Any], name: str) -> dict[str, Any]:
    spec = pod_spec(doc)
    assert spec is not None
    (c,) = [c for c in spec["containers"] if c["name"] == name]
    return c


def _bypassed(no_proxy: str, host: str) -> bool:
    """Whether a client reading ``no_proxy`` calls ``host`` directly (Python's suffix rule, as Go's and curl's)."""
    return bool(urllib.request.proxy_bypass_environment(host, proxies={"no": no_proxy}))


# KFP's proxy settings win inside the steps ---------------------------------------------------------------


def _step_urls(notes: str) -> dict[str, str]:
    """The in-cluster URLs NOTES hands the steps: the rloo-mlflow and rloo-s3 Secrets' values, judge_base_url."""
    urls = {key: value for key, value in SECRET_LITERAL.findall(notes)}
    judge = SUBMIT.search(notes)
    assert judge
    urls["judge_base_url"] = judge.group(1)
    return urls


def test_the_steps_get_service_names_kfps_default_no_proxy_bypasses() -> None:
    """KFP's driver appends the API server's proxy variables after the step's own env (kubeflow/pipelines
    backend/src/v2/driver/driver.go: ``append(userEnvVar, proxy.GetConfig().GetEnvVars()...)``), so the chart's
    completed NO_PROXY never reaches a step on a KFP with a proxy; KFP's default NO_PROXY
    (backend/src/apiserver/config/proxy/config.go) bypasses ``.svc.<cluster domain>`` only. Every URL the chart
    hands the steps must match it: ``<svc>.<ns>.svc.cluster.local``."""
    notes = _notes({"seaweedfs": {"enabled": True}, "judge": {"enabled": True}})
    urls = _step_urls(notes)
    assert set(urls) == {"MLFLOW_TRACKING_URI", "S3_ENDPOINT_URL", "judge_base_url"}
    for what, url in urls.items():
        host = urllib.parse.urlsplit(url).hostname or ""
        assert host.endswith(f".{NAMESPACE}.svc.cluster.local"), (what, url)
        assert _bypassed(KFP_DEFAULT_NO_PROXY, host), (what, url)
        assert _bypassed(KFP_DEFAULT_NO_PROXY, f"{host}:{urllib.parse.urlsplit(url).port}"), (what, url)
    # a short name, as before, would go to KFP's proxy
    assert not _bypassed(KFP_DEFAULT_NO_PROXY, f"{RELEASE}-rloo-kfp-mlflow.{NAMESPACE}.svc")


def test_the_cluster_domain_is_a_value() -> None:
    """KFP builds its default NO_PROXY from CLUSTER_DOMAIN (backend/src/apiserver/common/config.go,
    GetClusterDomain): a cluster on another domain gets names in that domain, and NO_PROXY completed with it."""
    values = {
        "clusterDomain": "cluster.test",
        "seaweedfs": {"enabled": True},
        "judge": {"enabled": True},
        "extraEnv": {"HTTPS_PROXY": "http://proxy:3128"},
    }
    kfp_no_proxy = KFP_DEFAULT_NO_PROXY.replace(".svc.cluster.local", ".svc.cluster.test")
    for what, url in _step_urls(_notes(values)).items():
        host = urllib.parse.urlsplit(url).hostname or ""
        assert host.endswith(".svc.cluster.test") and _bypassed(kfp_no_proxy, host), (what, url)
    docs = _docs(values)
    assert ".cluster.test" in _platform_json(values)["env"]["NO_PROXY"].split(",")
    mlflow = env_of(_container(find(docs, "Deployment", "-mlflow"), "mlflow"))
    assert mlflow["MLFLOW_S3_ENDPOINT_URL"]["value"].endswith(".svc.cluster.test:8333")
    with pytest.raises(helm.HelmValuesError):
        render({"clusterDomain": "Cluster_Local"})


# Proxy credentials --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "where"),
    [
        ({"extraEnv": {"HTTPS_PROXY": f"http://alice:{PASSWORD}@proxy:3128"}}, "extraEnv.HTTPS_PROXY"),
        ({"extraEnv": {"http_proxy": f"alice:{PASSWORD}@proxy:3128"}}, "extraEnv.http_proxy"),
        (
            {"pipeline": {"extraEnv": {"HF_ENDPOINT": f"https://bot:{PASSWORD}@hf"}}},
            "pipeline.extraEnv.HF_ENDPOINT",
        ),
        (
            {
                "mlflow": {
                    "extraEnv": [{"name": "HTTPS_PROXY", "value": f"http://alice:{PASSWORD}@proxy:3128"}]
                }
            },
            "mlflow.extraEnv.HTTPS_PROXY",
        ),
        (
            {"judge": {"extraEnv": [{"name": "ALL_PROXY", "value": f"socks5://{PASSWORD}@proxy:1080"}]}},
            "judge.extraEnv.ALL_PROXY",
        ),
    ],
)
def test_a_proxy_url_with_credentials_is_refused_in_one_line(values: dict[str, Any], where: str) -> None:
    """The chart would write the value into the ConfigMap and every pod spec, and the upload into the pipeline
    spec that KFP's UI shows (kubeflow/pipelines backend/src/v2/driver/driver.go puts the container's env into the
    pod as literal values). Refused at render, naming the value, never printing it."""
    with pytest.raises(helm.HelmRenderError) as err:
        render(values)
    text = str(err.value).strip()
    assert f"{where} has credentials in its URL (user:password@)" in text, text
    assert "\n" not in text and PASSWORD not in text and "alice" not in text
    assert "Proxy credentials" in text


def test_a_proxy_from_a_secret_or_without_credentials_renders() -> None:
    values = {
        "extraEnv": {"HTTPS_PROXY": "http://proxy.corp:3128", "HF_ENDPOINT": "https://hf.corp/a@b"},
        "mlflow": {
            "extraEnv": [
                {"name": "ALL_PROXY", "valueFrom": {"secretKeyRef": {"name": "corp-proxy", "key": "url"}}}
            ]
        },
    }
    mlflow = env_of(_container(find(_docs(values), "Deployment", "-mlflow"), "mlflow"))
    assert mlflow["ALL_PROXY"]["valueFrom"]["secretKeyRef"]["name"] == "corp-proxy"
    assert "@" not in mlflow["HTTPS_PROXY"]["value"]


def test_the_readme_says_how_to_pass_proxy_credentials() -> None:
    readme = (CHART / "README.md").read_text()
    section = readme.split("### Proxy credentials", 1)[1].split("\n### ", 1)[0]
    assert "source addresses" in section and "forwarding proxy" in section and "secretKeyRef" in section


# S3 credentials from a workload identity ----------------------------------------------------------------

IRSA = {"serviceAccount": {"annotations": {"eks.amazonaws.com/role-arn": "arn:aws:iam::123456789012:role/r"}}}


def _s3_refs(doc: dict[str, Any]) -> list[dict[str, Any]]:
    env = env_of(_container(doc, "mlflow"))
    return [env[name]["valueFrom"]["secretKeyRef"] for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")]


@pytest.mark.parametrize(
    ("case", "values"),
    [("IRSA annotation", IRSA), ("explicit", {"s3": {"workloadIdentity": True}})],
)
def test_a_workload_identity_makes_the_s3_keys_optional(case: str, values: dict[str, Any]) -> None:
    """Kubernetes starts a container whose ``secretKeyRef`` is ``optional: true`` without the Secret or key
    (kubernetes/kubernetes pkg/kubelet/kubelet_pods.go, makeEnvironmentVariables); boto3 then reads the web
    identity token EKS's pod identity webhook mounts. The render is valid Kubernetes, and what the upload does
    with ``s3WorkloadIdentity`` makes every step's S3 Secret optional in the compiled pipeline (KFP's driver:
    kubeflow/pipelines backend/src/v2/driver/k8s.go copies ``secretAsEnv.optional``)."""
    docs = _docs(values)
    mlflow = find(docs, "Deployment", "-mlflow")
    assert all(ref["optional"] is True for ref in _s3_refs(mlflow)), case
    kubernetes_validate.validate(mlflow, "1.32", strict=True)
    settings = json.loads(find(docs, "ConfigMap", "-pipeline")["data"]["platform.json"])
    assert settings["s3WorkloadIdentity"] is True
    package = find(docs, "ConfigMap", "-pipeline")["data"]["rloo_pipeline.yaml"]
    applied = list(
        yaml.safe_load_all(platform_overlay.apply(package, platform_overlay.parse(settings, "platform.json")))
    )
    s3_env = set(S3_SECRET_KEYS.values())
    seen = 0
    for name, config in applied[1]["platforms"]["kubernetes"]["deploymentSpec"]["executors"].items():
        for entry in config.get("secretAsEnv") or []:
            if {k["envVar"] for k in entry["keyToEnv"]} == s3_env:
                assert entry["optional"] is True, name
                seen += 1
    assert seen >= 6  # validate, fetch, train (single and multi-node), evaluate, push
    notes = render(values)["rloo-kfp/templates/NOTES.txt"]
    assert "workload identity" in notes and "AWS_SECRET_ACCESS_KEY" not in notes


def test_without_an_identity_the_keys_stay_required() -> None:
    for values in ({}, variant_values("platform-values.yaml")):  # SeaweedFS's only identity is the keys
        docs = _docs(values)
        assert all("optional" not in ref for ref in _s3_refs(find(docs, "Deployment", "-mlflow")))
        assert (
            json.loads(find(docs, "ConfigMap", "-pipeline")["data"]["platform.json"])["s3WorkloadIdentity"]
            is False
        )
    assert (
        "eks.amazonaws.com/role-arn"
        in variant_values("platform-values.yaml")["serviceAccount"]["annotations"]
    )
    with pytest.raises(helm.HelmRenderError) as err:
        render({"s3": {"workloadIdentity": True}, "seaweedfs": {"enabled": True}})
    assert "s3.workloadIdentity is true with seaweedfs.enabled" in str(err.value)


# Kueue ------------------------------------------------------------------------------------------------------


def test_kueue_values_reach_the_gpu_steps_and_the_validate_step() -> None:
    """``pipeline.kueue.queueName``: the train and evaluate pods get Kueue's queue label (kubernetes-sigs/kueue
    pkg/controller/jobs/pod/pod_webhook.go suspends a pod with ``kueue.x-k8s.io/queue-name``), as
    kfp.kubernetes' ``add_pod_label`` writes it; ``pytorchJobIntegration`` reaches the validate step in
    RLOO_PLATFORM (Kueue ships ``kubeflow.org/pytorchjob`` disabled: config/components/manager/
    controller_manager_config.yaml)."""
    values = {"pipeline": {"kueue": {"queueName": "gpu-queue", "pytorchJobIntegration": True}}}
    docs = _docs(values)
    settings = json.loads(find(docs, "ConfigMap", "-pipeline")["data"]["platform.json"])
    assert settings["kueue"] == {"queueName": "gpu-queue", "pytorchJobIntegration": True}
    package = find(docs, "ConfigMap", "-pipeline")["data"]["rloo_pipeline.yaml"]
    applied = list(
        yaml.safe_load_all(platform_overlay.apply(package, platform_overlay.parse(settings, "platform.json")))
    )
    k8s = applied[1]["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    labelled = {n for n, c in k8s.items() if (c.get("podMetadata") or {}).get("labels")}
    assert labelled == {"exec-train-rloo", "exec-evaluate"}
    assert all(
        k8s[n]["podMetadata"]["labels"] == {"kueue.x-k8s.io/queue-name": "gpu-queue"} for n in labelled
    )
    validate = applied[0]["deploymentSpec"]["executors"]["exec-validate-params"]["container"]
    assert from_env({e["name"]: e["value"] for e in validate["env"]}).kueue.pytorchjob_integration
    with pytest.raises(helm.HelmValuesError):
        render({"pipeline": {"kueue": {"queueName": "GPU_Queue"}}})


def test_the_readme_says_how_to_enable_kueues_integrations() -> None:
    readme = (CHART / "README.md").read_text()
    section = readme.split("### Kueue", 1)[1].split("\n### ", 1)[0]
    for needed in (
        '"kubeflow.org/pytorchjob"',
        '"pod"',
        "manageJobsWithoutQueueName",
        "managedJobsNamespaceSelector",
    ):
        assert needed in section, needed


# Images nobody published -----------------------------------------------------------------------------------


def test_images_at_the_unpublished_default_registry_fail_the_render() -> None:
    """Helm's ``fail`` stops the render (helm/helm pkg/engine/engine.go), so ``helm install`` applies nothing,
    instead of an upload Job in ImagePullBackOff until its deadline. One line: which image, and the command that
    builds and pushes them."""
    refused = {"images": {"allowDefaultRegistry": False}}
    with pytest.raises(helm.HelmRenderError) as err:
        render(refused)
    text = str(err.value).strip()
    assert f"images.slim is {DEFAULT_REGISTRY}/rloo-slim:" in text and "\n" not in text
    assert "make push-images RLOO_IMAGE_REGISTRY=" in text
    # one image left at the default is enough to fail
    partly = {
        "images": {"allowDefaultRegistry": False, "slim": {"repository": "registry.example.com/ml/slim"}}
    }
    with pytest.raises(helm.HelmRenderError, match=r"images\.train is"):
        render(partly)
    mine = {"images": {"allowDefaultRegistry": False, "registry": "registry.example.com/ml"}}
    assert "registry.example.com/ml/rloo-slim" in json.dumps(_platform_json(mine))
    # the chart's own CI values render without the override where they name a registry of their own
    platform_team = variant_values("platform-values.yaml")
    platform_team["images"]["allowDefaultRegistry"] = False
    render(platform_team)


def test_the_readme_builds_and_pushes_the_images_first() -> None:
    readme = (CHART / "README.md").read_text()
    install = readme.split("## Install", 1)[1].split("\n## ", 1)[0]
    first = install.split("\n2. ", 1)[0]
    assert "1. **Build and push the images**" in first
    assert "make push-images RLOO_IMAGE_REGISTRY=registry.example.com/ml" in first
    assert "--set images.registry=registry.example.com/ml" in install
    makefile = (CHART.parent / "Makefile").read_text()
    assert re.search(r"^push-images:", makefile, flags=re.M)
    assert "RLOO_IMAGE_REGISTRY" in (CHART.parent / "src" / "rloo" / "pipeline" / "images.py").read_text()


# A subchart: Helm's globals ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def umbrella(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An umbrella chart with this chart as its dependency, in charts/ as ``helm dependency update`` puts it."""
    root = tmp_path_factory.mktemp("umbrella") / "platform"
    (root / "charts").mkdir(parents=True)
    with helm.Chart.load(CHART) as c:
        c.save_dir(root / "charts")
        version = c.version
    (root / "Chart.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v2",
                "name": "platform",
                "version": "1.0.0",
                "dependencies": [
                    {"name": "rloo-kfp", "version": version, "repository": "file://../rloo-kfp"}
                ],
            }
        )
    )
    (root / "values.yaml").write_text(yaml.safe_dump({"global": {"imageRegistry": "registry.example.com"}}))
    return root


@pytest.mark.parametrize(
    "globals_", [{"imageRegistry": "registry.example.com", "storageClass": "fast"}, None]
)
def test_the_chart_renders_as_a_subchart(umbrella: Path, globals_: dict[str, Any] | None) -> None:
    """Helm copies the parent's ``global`` into every subchart's values, an empty map at least (helm/helm
    pkg/chart/common/util/coalesce.go, coalesceGlobals: ``dest[GlobalKey] = dg``), and validates them against the
    subchart's schema (pkg/chart/common/util/jsonschema.go, ValidateAgainstSchema): a closed schema without
    ``global`` refuses every umbrella chart and Argo CD app-of-apps."""
    values: dict[str, Any] = {"rloo-kfp": {"images": {"registry": "registry.example.com/ml"}}}
    if globals_ is not None:
        values["global"] = globals_
    with helm.Chart.load(umbrella) as parent:
        rendered = parent.render(values, name=RELEASE, namespace=NAMESPACE)
    docs = documents(rendered)
    cm = find(docs, "ConfigMap", "-pipeline")
    assert json.loads(cm["data"]["platform.json"])["images"]["slim"].startswith("registry.example.com/ml/")
    assert any(path.startswith("platform/charts/rloo-kfp/templates/") for path in rendered)


def test_global_values_are_accepted_by_the_chart_itself() -> None:
    """An Argo CD application that passes a parent's values to the chart directly includes ``global``."""
    docs = _docs({"global": {"imageRegistry": "registry.example.com", "labels": {"a": "b"}}})
    assert find(docs, "Deployment", "-mlflow")
    with pytest.raises(helm.HelmValuesError):
        render({"global": "not a map"})


# An air-gapped judge ------------------------------------------------------------------------------------------


def test_an_offline_judge_never_calls_the_hub_and_reads_the_seeded_volume() -> None:
    """huggingface_hub reads ``HF_HUB_OFFLINE`` (huggingface/huggingface_hub src/huggingface_hub/constants.py) and
    then resolves files from the cache only. The README's seeding steps name the mount path, the claim and the
    cache directory the judge's template really uses."""
    docs = _docs({"judge": {"enabled": True, "offline": True, "model": "/models/Qwen2.5-7B-Instruct"}})
    deploy = find(docs, "Deployment", "-judge")
    c = _container(deploy, "vllm")
    env = env_of(c)
    assert env["HF_HUB_OFFLINE"]["value"] == "1"
    assert c["args"][0] == "/models/Qwen2.5-7B-Instruct"
    mount = next(m["mountPath"] for m in c["volumeMounts"] if m["name"] == "model-cache")
    claim = find(docs, "PersistentVolumeClaim", "-judge-model-cache")["metadata"]["name"]
    assert "HF_HUB_OFFLINE" not in env_of(
        _container(find(_docs({"judge": {"enabled": True}}), "Deployment", "-judge"), "vllm")
    )
    readme = (CHART / "README.md").read_text()
    section = readme.split("### Air-gapped judge", 1)[1].split("\n### ", 1)[0]
    assert f"at `{mount}`" in section and f"HF_HOME={env['HF_HOME']['value']}" in section
    assert claim == f"{RELEASE}-rloo-kfp-judge-model-cache" and "<fullname>-judge-model-cache" in section
    assert "judge.offline=true" in section and "judge.modelCache.existingClaim" in section
    assert f"{env['HF_HOME']['value']}/hub" in section


# What platform.json's reader refuses, the chart refuses first -----------------------------------------------


def test_the_chart_and_platform_json_refuse_the_same_credentials(tmp_path: Path) -> None:
    """Without the chart's checks, the platform.json it renders would be refused by the upload (after the
    install applied everything else)."""
    with helm.Chart.load(CHART) as c:
        c.save_dir(tmp_path)
    (tmp_path / "rloo-kfp" / "templates" / "validate.yaml").unlink()
    values = {"extraEnv": {"HTTPS_PROXY": f"http://alice:{PASSWORD}@proxy:3128"}}
    with helm.Chart.load(tmp_path / "rloo-kfp") as unchecked:
        docs = documents(unchecked.render(with_test_values(values), name=RELEASE, namespace=NAMESPACE))
    data = json.loads(find(docs, "ConfigMap", "-pipeline")["data"]["platform.json"])
    with pytest.raises(UserError) as err:
        platform_overlay.parse(data, "platform.json")
    assert PASSWORD not in str(err.value)
