"""Render the chart with real Helm (the Helm v4 Go SDK through helm-python-sdk, no binary, no cluster) and the
policy checks every rendered pod must pass."""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import helm_python as helm
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm"
CI_VALUES = sorted((CHART / "ci").glob("*-values.yaml"))
# Every values variant the tests render: the defaults, then each ci/*-values.yaml.
VARIANTS = ["default", *(p.name for p in CI_VALUES)]
RELEASE = "rel"
NAMESPACE = "rloo"

# Kinds whose objects carry a pod template (path to the pod spec).
POD_PATHS: dict[str, tuple[str, ...]] = {
    "Pod": ("spec",),
    "Deployment": ("spec", "template", "spec"),
    "StatefulSet": ("spec", "template", "spec"),
    "DaemonSet": ("spec", "template", "spec"),
    "Job": ("spec", "template", "spec"),
    "CronJob": ("spec", "jobTemplate", "spec", "template", "spec"),
}
# Containers allowed a writable root filesystem, as (kind, object name suffix, container). Empty on purpose:
# every container of the chart writes only to emptyDir/PVC mounts. Adding one needs a reason in its template.
WRITABLE_ROOT_FS: frozenset[tuple[str, str, str]] = frozenset()
# Volume types the "restricted" Pod Security Standard allows.
RESTRICTED_VOLUMES = {
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
}
# Environment variables whose names say "secret": they must come from a Secret, never a literal value.
SECRET_ENV = re.compile(r"(PASSWORD|SECRET|TOKEN|API_KEY|ACCESS_KEY)")
NOT_SECRET_ENV = re.compile(r"_(PATH|FILE|DIR)$")


@functools.cache
def chart() -> helm.Chart:
    return helm.Chart.load(CHART)


def variant_values(variant: str) -> dict[str, Any]:
    if variant == "default":
        return {}
    return yaml.safe_load((CHART / "ci" / variant).read_text()) or {}


def render(
    values: dict[str, Any] | None = None, *, namespace: str = NAMESPACE, release: str = RELEASE
) -> dict[str, str]:
    """Template path -> rendered text, as `helm template` would produce (schema validated first), with
    :data:`TEST_VALUES` under ``values``."""
    return chart().render(with_test_values(values), name=release, namespace=namespace)


# What every test render adds under its values: the chart refuses images at the default registry, where no release
# has published them (images.allowDefaultRegistry); the tests render the chart without images. A test that sets
# the value itself keeps its own.
TEST_VALUES: dict[str, Any] = {"images": {"allowDefaultRegistry": True}}


def with_test_values(values: dict[str, Any] | None) -> dict[str, Any]:
    """``values`` over :data:`TEST_VALUES` (maps merged key by key, as Helm coalesces ``-f`` files)."""
    return _merged(TEST_VALUES, values or {})


def _merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merged(out[key], value)
        else:
            out[key] = value
    return out


def documents(rendered: dict[str, str]) -> list[dict[str, Any]]:
    """Every manifest, parsed (NOTES.txt and empty documents left out)."""
    docs = []
    for path, text in sorted(rendered.items()):
        if path.endswith("NOTES.txt"):
            continue
        for doc in yaml.safe_load_all(text):
            if doc is not None:
                assert isinstance(doc, dict), f"{path}: a manifest is not a mapping: {doc!r}"
                docs.append(doc)
    return docs


def find(docs: list[dict[str, Any]], kind: str, suffix: str = "") -> dict[str, Any]:
    matches = [d for d in docs if d["kind"] == kind and d["metadata"]["name"].endswith(suffix)]
    assert len(matches) == 1, (
        f"expected one {kind} named *{suffix}, got {[d['metadata']['name'] for d in matches]}"
    )
    return matches[0]


def pod_spec(doc: dict[str, Any]) -> dict[str, Any] | None:
    path = POD_PATHS.get(doc["kind"])
    if path is None:
        return None
    node: Any = doc
    for key in path:
        node = node[key]
    return node


def containers(spec: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield from spec.get("initContainers") or []
    yield from spec.get("containers") or []


def env_of(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env") or []}


def policy_violations(doc: dict[str, Any]) -> list[str]:
    """What keeps ``doc`` from the chart's policies: the "restricted" Pod Security Standard, a read-only root
    filesystem (unless listed in WRITABLE_ROOT_FS), requests and limits on every container, pinned images,
    no service-account token, and secrets only by reference."""
    out: list[str] = []
    where = f"{doc['kind']}/{doc['metadata']['name']}"
    if doc["kind"] == "Secret":
        out.append(f"{where}: the chart renders a Secret (secrets are only referenced)")
    spec = pod_spec(doc)
    if spec is None:
        return out
    psc = spec.get("securityContext") or {}
    if psc.get("runAsNonRoot") is not True:
        out.append(f"{where}: pod securityContext.runAsNonRoot is not true")
    if psc.get("runAsUser") == 0:
        out.append(f"{where}: pod runs as uid 0")
    if (psc.get("seccompProfile") or {}).get("type") not in ("RuntimeDefault", "Localhost"):
        out.append(f"{where}: pod seccompProfile is not RuntimeDefault")
    for flag in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(flag):
            out.append(f"{where}: {flag}")
    if spec.get("automountServiceAccountToken") is not False:
        out.append(f"{where}: automountServiceAccountToken is not false")
    for volume in spec.get("volumes") or []:
        kinds = set(volume) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            out.append(f"{where}: volume {volume['name']} of type {sorted(kinds)} is not allowed")
    for c in containers(spec):
        at = f"{where} container {c['name']}"
        sc = c.get("securityContext") or {}
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"{at}: allowPrivilegeEscalation is not false")
        if sc.get("privileged"):
            out.append(f"{at}: privileged")
        if sc.get("runAsUser") == 0 or sc.get("runAsNonRoot") is False:
            out.append(f"{at}: runs as root")
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            out.append(f"{at}: capabilities.drop lacks ALL")
        if caps.get("add"):
            out.append(f"{at}: adds capabilities {caps['add']}")
        exempt = any(
            doc["kind"] == k and doc["metadata"]["name"].endswith(n) and c["name"] == cn
            for k, n, cn in WRITABLE_ROOT_FS
        )
        if sc.get("readOnlyRootFilesystem") is not True and not exempt:
            out.append(f"{at}: readOnlyRootFilesystem is not true")
        resources = c.get("resources") or {}
        for section in ("requests", "limits"):
            for res in ("cpu", "memory"):
                if res not in (resources.get(section) or {}):
                    out.append(f"{at}: no {section}.{res}")
        image = c.get("image", "")
        if ":" not in image.rsplit("/", 1)[-1] or image.endswith(":latest"):
            out.append(f"{at}: image {image!r} is not pinned to a tag")
        for name, e in env_of(c).items():
            secret_named = SECRET_ENV.search(name) and not NOT_SECRET_ENV.search(name)
            if secret_named and ("value" in e or "secretKeyRef" not in (e.get("valueFrom") or {})):
                out.append(f"{at}: env {name} is not read from a Secret")
    return out
