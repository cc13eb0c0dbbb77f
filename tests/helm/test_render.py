"""The chart lints (strict), renders, parses and validates against the Kubernetes API schemas of the versions it
claims, for the default values and every ci/*-values.yaml variant, and every pod meets the chart's policies."""

from __future__ import annotations

import copy
import re
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from tests.helm.helpers import (
    CHART,
    NAMESPACE,
    VARIANTS,
    documents,
    find,
    pod_spec,
    policy_violations,
    render,
    variant_values,
)

# The lowest release Chart.yaml's kubeVersion admits, one in between, and the newest kubernetes-validate has.
KUBE_VERSIONS = ["1.27", "1.32", kubernetes_validate.latest_version()]
# Custom resources have no schema in kubernetes-validate: none is rendered today; list any added here.
CUSTOM_KINDS: set[str] = set()


@pytest.fixture(scope="module", params=VARIANTS)
def variant(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    return request.param, documents(render(variant_values(request.param)))


def test_ci_variants_cover_the_switches() -> None:
    """The variants exercise both databases, the judge, the rollout server and SeaweedFS each way, and a platform
    team's values."""
    merged = [helm.Chart.load(CHART).merge_values(variant_values(v)) for v in VARIANTS]
    assert {m["postgresql"]["enabled"] for m in merged} == {True, False}
    assert {m["judge"]["enabled"] for m in merged} == {True, False}
    assert {m["seaweedfs"]["enabled"] for m in merged} == {True, False}
    assert {m["rolloutServer"]["enabled"] for m in merged} == {True, False}
    assert {bool(m["externalDatabase"]["host"]) for m in merged} == {True, False}
    # what a platform team sets (ci/platform-values.yaml): every per-variant check runs on it
    assert any(m["images"][n]["digest"] for m in merged for n in ("slim", "train", "eval"))
    assert any("@sha256:" in m["images"][n]["tag"] for m in merged for n in ("slim", "train", "eval"))
    assert any(m["imagePullSecrets"] and m["extraEnv"] and m["pipeline"]["extraEnv"] for m in merged)
    assert any(m["caBundle"]["configMap"] for m in merged)
    assert {m["upload"]["istioSidecar"] for m in merged} == {True, False}
    assert any(m["upload"]["namespace"] for m in merged)
    assert any(m["mlflow"]["replicas"] > 1 and m["externalDatabase"]["host"] for m in merged)
    for component in ("mlflow", "seaweedfs", "judge"):
        assert any(
            m[component]["podAnnotations"]
            and m[component]["podLabels"]
            and m[component]["affinity"]
            and m[component]["extraVolumes"]
            and m[component]["extraVolumeMounts"]
            and (component != "seaweedfs" or m["seaweedfs"]["enabled"])
            and (component != "judge" or m["judge"]["enabled"])
            for m in merged
        ), component
    assert any(m["mlflow"]["extraEnv"] and m["judge"]["extraEnv"] and m["judge"]["enabled"] for m in merged)
    assert any(
        all(m["jobs"][k] for k in ("podAnnotations", "podLabels", "nodeSelector", "tolerations", "affinity"))
        for m in merged
    )
    # placement without forking: validated against the Kubernetes schemas like every other field
    placement = ("priorityClassName", "topologySpreadConstraints", "extraVolumes", "extraVolumeMounts")
    assert any(all(m["jobs"][k] for k in placement) for m in merged)
    assert any(m["mlflow"]["priorityClassName"] and m["mlflow"]["topologySpreadConstraints"] for m in merged)
    assert any(m["judge"]["enabled"] and m["judge"]["runtimeClassName"] for m in merged)
    assert any(m["seaweedfs"]["enabled"] and m["seaweedfs"]["image"]["digest"] for m in merged)
    assert any(m["mlflow"]["service"]["annotations"] and m["serviceAccount"]["annotations"] for m in merged)
    assert any(m["pipeline"]["kueue"]["queueName"] for m in merged)


@pytest.mark.parametrize("variant_name", VARIANTS)
def test_lint_strict(variant_name: str) -> None:
    for kube_version in (None, f"v{KUBE_VERSIONS[0]}.0"):
        report = helm.lint(
            CHART, variant_values(variant_name), strict=True, namespace=NAMESPACE, kube_version=kube_version
        )
        problems = [m for m in report["messages"] if m["severity"] >= 2]  # 2 = warning, 3 = error
        assert not problems and not report["errors"], (problems, report["errors"])


def test_lint_reports_a_broken_chart(tmp_path) -> None:
    """The lint gate can fail: a template that renders invalid YAML is an error."""
    broken = tmp_path / "rloo-kfp"
    with helm.Chart.load(CHART) as c:
        c.save_dir(tmp_path)
    (broken / "templates" / "broken.yaml").write_text("kind: ConfigMap\nmetadata: [unclosed\n")
    report = helm.lint(broken, strict=True)
    assert report["errors"], report


# Kinds without a namespace (the ClusterRole that reads the TrainJobs' ClusterTrainingRuntime, and its binding).
CLUSTER_SCOPED = {"ClusterRole", "ClusterRoleBinding"}


def test_manifests_parse_and_are_named(variant) -> None:
    name, docs = variant
    assert docs, name
    seen = set()
    for doc in docs:
        assert {"apiVersion", "kind", "metadata"} <= set(doc), doc
        meta = doc["metadata"]
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", meta["name"]) and len(meta["name"]) <= 63, meta
        if doc["kind"] not in CLUSTER_SCOPED:
            assert meta.get("namespace"), f"{doc['kind']}/{meta['name']} has no namespace"
        key = (doc["kind"], meta.get("namespace"), meta["name"])
        assert key not in seen, f"duplicate {key}"
        seen.add(key)
        assert meta["labels"]["app.kubernetes.io/instance"] == "rel"


def test_names_fit_with_the_longest_release_name() -> None:
    """Helm allows 53-character release names; every name must still be a DNS label, and StatefulSet names must
    leave room for their pods' controller-revision-hash label (name + 11 characters <= 63)."""
    release = "r" * 53
    helm.validate_release_name(release)
    docs = documents(render(variant_values("all-in-values.yaml"), release=release))
    for doc in docs:
        name = doc["metadata"]["name"]
        limit = 52 if doc["kind"] == "StatefulSet" else 63
        assert len(name) <= limit, (doc["kind"], name)
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name), name


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
def test_kubernetes_validate_strict(variant, kube_version: str) -> None:
    name, docs = variant
    for doc in docs:
        if doc["kind"] in CUSTOM_KINDS:
            continue
        try:
            kubernetes_validate.validate(doc, kube_version, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(
                f"{name} {doc['kind']}/{doc['metadata']['name']} @ {kube_version}: {e.message} at {list(e.path)}"
            )


def test_kubernetes_validate_catches_an_invalid_manifest() -> None:
    docs = documents(render())
    bad = copy.deepcopy(find(docs, "Deployment", "-mlflow"))
    bad["spec"]["template"]["spec"]["containers"][0]["imagePullPolicy"] = ["IfNotPresent"]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, KUBE_VERSIONS[0], strict=True)
    unknown_field = copy.deepcopy(find(docs, "Service", "-mlflow"))
    unknown_field["spec"]["portz"] = []
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(unknown_field, KUBE_VERSIONS[0], strict=True)


def test_validated_versions_match_the_claim() -> None:
    """The lowest version validated is the one Chart.yaml's kubeVersion starts at."""
    claim = yaml.safe_load((CHART / "Chart.yaml").read_text())["kubeVersion"]
    lowest = re.fullmatch(r">=\s*(\d+\.\d+)\.\d+(-0)?", claim)
    assert lowest, claim
    assert lowest.group(1) == KUBE_VERSIONS[0]

    def minor(v: str) -> tuple[int, int]:
        major, minor_, *_ = v.split(".")
        return int(major), int(minor_)

    assert minor(KUBE_VERSIONS[-1]) > minor(KUBE_VERSIONS[1]) > minor(KUBE_VERSIONS[0])


def test_policies(variant) -> None:
    name, docs = variant
    pods = [d for d in docs if pod_spec(d) is not None]
    assert pods, name
    violations = [v for d in docs for v in policy_violations(d)]
    assert not violations, "\n".join(violations)


def test_no_secret_values_rendered(variant) -> None:
    """No Secret objects, and no credentials inside connection URIs anywhere in the output."""
    _, docs = variant
    assert not [d for d in docs if d["kind"] == "Secret"]
    text = yaml.safe_dump_all(docs)
    assert not re.search(r"://[^/\s:@\"']+:[^/\s@\"']+@", text), "a URI with user:password@"


def _pod(**overrides: Any) -> dict[str, Any]:
    container = {
        "name": "c",
        "image": "example.com/app:1.0",
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        },
        "resources": {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"cpu": "1", "memory": "1Gi"}},
    }
    spec = {
        "automountServiceAccountToken": False,
        "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [container],
    }
    for path, value in overrides.items():
        node: Any = spec
        keys = path.split(".")
        for key in keys[:-1]:
            node = node[int(key)] if key.isdigit() else node[key]
        if value is None:
            node.pop(keys[-1], None)
        else:
            node[keys[-1]] = value
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}, "spec": spec}


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({}, None),
        ({"securityContext.runAsNonRoot": None}, "runAsNonRoot is not true"),
        ({"securityContext.seccompProfile": None}, "seccompProfile"),
        ({"hostNetwork": True}, "hostNetwork"),
        ({"automountServiceAccountToken": None}, "automountServiceAccountToken"),
        ({"volumes": [{"name": "h", "hostPath": {"path": "/"}}]}, "hostPath"),
        ({"containers.0.securityContext.allowPrivilegeEscalation": True}, "allowPrivilegeEscalation"),
        ({"containers.0.securityContext.privileged": True}, "privileged"),
        ({"containers.0.securityContext.capabilities": {"drop": ["NET_RAW"]}}, "lacks ALL"),
        ({"containers.0.securityContext.capabilities": {"drop": ["ALL"], "add": ["SYS_ADMIN"]}}, "adds"),
        ({"containers.0.securityContext.readOnlyRootFilesystem": False}, "readOnlyRootFilesystem"),
        ({"containers.0.securityContext.runAsUser": 0}, "runs as root"),
        ({"containers.0.resources": {"requests": {"cpu": "1", "memory": "1Gi"}}}, "no limits.cpu"),
        ({"containers.0.resources": None}, "no requests.memory"),
        ({"containers.0.image": "example.com/app"}, "not pinned"),
        ({"containers.0.image": "example.com/app:latest"}, "not pinned"),
        ({"containers.0.env": [{"name": "PGPASSWORD", "value": "hunter2"}]}, "env PGPASSWORD"),
        ({"containers.0.env": [{"name": "HF_TOKEN", "valueFrom": {"configMapKeyRef": {}}}]}, "env HF_TOKEN"),
    ],
)
def test_policy_check_catches_violations(overrides: dict[str, Any], expected: str | None) -> None:
    found = policy_violations(_pod(**overrides))
    if expected is None:
        assert found == []
    else:
        assert any(expected in v for v in found), found


def test_policy_check_covers_init_containers_and_secrets() -> None:
    pod = _pod()
    pod["spec"]["initContainers"] = [{"name": "init", "image": "example.com/app:1.0"}]
    found = policy_violations(pod)
    assert any("container init" in v and "no requests.cpu" in v for v in found), found
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s"}, "stringData": {"k": "v"}}
    assert policy_violations(secret)
