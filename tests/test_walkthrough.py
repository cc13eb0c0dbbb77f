"""docs/platform-walkthrough.md against the repository: what it tells a platform team to run is what the
Makefile, the chart, the pipeline and the CLI accept.

- ``--set`` keys are read as Helm reads them (dotted paths, scalars typed: helm/helm ``pkg/strvals/parser.go``)
  and must be in ``helm/values.schema.json``; the values of each ``helm install`` render with Helm's own code;
- the Secrets it creates are the ones the chart's NOTES list for those very values (names, keys, and the
  in-cluster URLs), which are the pipeline's ``STEP_SECRETS``;
- the volumes it deletes are the StatefulSets' claims, named ``<claim>-<statefulset>-<ordinal>`` by the
  StatefulSet controller (kubernetes/kubernetes ``pkg/controller/statefulset/stateful_set_utils.go``,
  ``getPersistentVolumeClaimName``);
- Helm comes from ``https://get.helm.sh/helm-<version>-linux-amd64.tar.gz``, unpacked to ``linux-amd64/helm``
  with a ``.sha256`` of the bare digest beside it (helm/helm ``scripts/get-helm-4``), at the release the chart's
  tests render with;
- the smoke test's parameter script runs against a real S3 server (SeaweedFS) and its parameters pass the
  validate step's checks, bucket, model and datasets included.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.fixtures.doc_commands import SHELLS, check_rloo_command, code_blocks, rloo_commands, shell_commands
from tests.fixtures.servers import S3Server, use_s3
from tests.helm.helpers import documents, render

ROOT = Path(__file__).resolve().parents[1]
DOC = (ROOT / "docs" / "platform-walkthrough.md").read_text()
SMOKE_AT = DOC.index("\n## Smoke test on kind")
SECTIONS = {"platform": DOC[:SMOKE_AT], "smoke": DOC[SMOKE_AT:]}
RELEASE, NAMESPACE = "rloo", "kubeflow"


def _commands(text: str) -> list[list[str]]:
    return [
        words for block in code_blocks(text) if block.lang in SHELLS for words in shell_commands(block.body)
    ]


def _helm_installs(text: str) -> list[list[str]]:
    return [w for w in _commands(text) if w[:2] == ["helm", "install"]]


def _set_values(words: list[str]) -> dict[str, Any]:
    """The values of a ``helm install``'s ``--set`` flags, as nested mappings."""
    values: dict[str, Any] = {}
    for flag, arg in itertools.pairwise(words):
        if flag != "--set":
            continue
        key, _, raw = arg.partition("=")
        node = values
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = yaml.safe_load(raw) if raw else ""
    return values


def _schema_has(schema: dict[str, Any], path: list[str]) -> bool:
    for part in path:
        props = schema.get("properties") or {}
        if part not in props:
            return False
        schema = props[part]
    return True


@pytest.mark.parametrize("section", SECTIONS)
def test_each_helm_install_sets_keys_the_schema_has_and_renders(section: str) -> None:
    import json

    schema = json.loads((ROOT / "helm" / "values.schema.json").read_text())
    (install,) = _helm_installs(SECTIONS[section])
    assert install[2:6] == [RELEASE, "./helm", "-n", NAMESPACE], install
    keys = [arg.split("=")[0] for flag, arg in itertools.pairwise(install) if flag == "--set"]
    assert keys, "no --set in the install"
    for key in keys:
        assert _schema_has(schema, key.split(".")), f"--set {key}: not in helm/values.schema.json"
    assert documents(_render(section))


def _render(section: str) -> dict[str, str]:
    (install,) = _helm_installs(SECTIONS[section])
    values = _set_values(install)
    values.setdefault("images", {})["allowDefaultRegistry"] = False  # as a real install: no test shortcut
    return render(values, namespace=NAMESPACE, release=RELEASE)


_CREATE_SECRET = re.compile(r"kubectl [^\n]*create secret generic (?:[^\n]*\\\n)*[^\n]*")


def _secrets(text: str) -> dict[str, dict[str, str]]:
    """``kubectl create secret generic NAME --from-literal=KEY=VALUE ...`` (in code blocks, or anywhere in
    NOTES): name -> key -> value."""
    found: dict[str, dict[str, str]] = {}
    commands = (
        _commands(text)
        if "```" in text
        else [words for m in _CREATE_SECRET.finditer(text) for words in shell_commands(m[0])]
    )
    for words in commands:
        if "secret" in words and "generic" in words:
            name = words[words.index("generic") + 1]
            literals = [w.split("=", 1)[1] for w in words if w.startswith("--from-literal=")]
            found[name] = dict(lit.split("=", 1) for lit in literals)
    return found


@pytest.mark.parametrize("section", SECTIONS)
def test_the_secrets_are_the_ones_the_chart_lists_for_these_values(section: str) -> None:
    from rloo.stages.constants import STEP_SECRETS
    from rloo.stages.plan import ClusterConfig

    notes = _secrets(_render(section)["rloo-kfp/templates/NOTES.txt"])
    doc = _secrets(SECTIONS[section])
    assert doc, "no Secrets created"
    optional = {getattr(ClusterConfig(), p) for p, (_, required) in STEP_SECRETS.items() if not required}
    assert set(notes) - set(doc) <= optional, "a Secret the chart needs is not created"
    for name, keys in doc.items():
        assert name in notes, f"{name}: no Secret of that name is read"
        assert set(keys) == set(notes[name]), f"{name}: keys {sorted(keys)} != {sorted(notes[name])}"
        for key, value in notes[name].items():
            if not value.startswith("<"):  # a concrete value (an in-cluster URL): the same in the walkthrough
                assert keys[key] == value, f"{name} {key}"


@pytest.mark.parametrize("section", SECTIONS)
def test_the_objects_it_names_are_the_ones_the_chart_renders(section: str) -> None:
    docs = documents(_render(section))
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    claims = {
        f"{t['metadata']['name']}-{d['metadata']['name']}-0"
        for d in docs
        if d["kind"] == "StatefulSet"
        for t in d["spec"].get("volumeClaimTemplates", [])
    }
    configmaps = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ConfigMap"}
    test_pods = {d["metadata"]["name"] for d in docs if d["kind"] == "Pod"}
    kfp_services = {
        "ml-pipeline": 8888,
        "ml-pipeline-ui": 80,
    }  # KFP's own (NOTES port-forwards ml-pipeline too)
    text = DOC if section == "smoke" else SECTIONS[section]  # the smoke test repeats steps 5 to 7
    for words in _commands(text):
        if words[:1] != ["kubectl"]:
            continue
        if "port-forward" in words:
            target = next(w for w in words if w.startswith("svc/"))[4:]
            remote = int(words[words.index(f"svc/{target}") + 1].split(":")[1])
            if target in kfp_services:
                assert remote == kfp_services[target]
            elif target.startswith(f"{RELEASE}-rloo-kfp-") and (
                section == "smoke" or "seaweedfs" not in target
            ):
                assert target in services, f"svc/{target}: the chart renders no such Service"
                assert remote in [p["port"] for p in services[target]["spec"]["ports"]], (
                    f"svc/{target}:{remote}"
                )
        if words[1:4] == ["-n", NAMESPACE, "delete"] and "pvc" in words:
            for claim in words[words.index("pvc") + 1 :]:
                assert claim in claims, f"pvc {claim}: no StatefulSet of the chart claims it"
        if "configmap" in words and "get" in words:
            name = words[words.index("configmap") + 1]
            key = re.search(r"\{\.data\.(.+)\}", next(w for w in words if w.startswith("jsonpath=")))
            assert name in configmaps and key is not None
            assert key[1].replace("\\.", ".") in configmaps[name]["data"]
        if "logs" in words:
            assert words[-1] in test_pods, f"{words[-1]}: no helm test pod of that name"


def test_every_make_target_exists() -> None:
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([\w-]+):", makefile, re.MULTILINE))
    build = _build_module()
    for words in _commands(DOC):
        if words[:1] != ["make"]:
            continue
        for word in words[1:]:
            name, eq, value = word.partition("=")
            if eq and name == "IMAGES":
                assert set(value.split()) <= set(build.NAMES), value
            elif not eq:
                assert word in targets, f"make {word}: no such target"


@pytest.mark.parametrize("argv", rloo_commands(DOC), ids=lambda argv: " ".join(argv[:2]))
def test_every_rloo_command_is_accepted(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    check_rloo_command(argv, capsys)


def _build_module() -> Any:
    spec = importlib.util.spec_from_file_location("images_build", ROOT / "images" / "build.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_smoke_images_are_the_ones_make_images_builds_and_the_chart_gives_the_steps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The archives loaded into kind hold the images ``make images`` tags for the walkthrough's registry and
    tag, and the chart hands exactly those to the steps: train-cpu for train and evaluate."""
    import json

    (exported,) = [
        w for w in _commands(SECTIONS["smoke"]) if w[:1] == ["export"] and "RLOO_IMAGE_TAG" in str(w)
    ]
    for assignment in exported[1:]:
        name, _, value = assignment.partition("=")
        monkeypatch.setenv(name, value)
    build = _build_module()
    saved = [w[2] for w in _commands(SECTIONS["smoke"]) if w[:2] == ["docker", "save"]]
    assert saved == [build.reference("slim"), build.reference("train-cpu")]
    pipeline = next(d for d in documents(_render("smoke")) if d["metadata"]["name"].endswith("-pipeline"))
    images = json.loads(pipeline["data"]["platform.json"])["images"]
    assert images == {
        "slim": build.reference("slim"),
        "train": build.reference("train-cpu"),
        "eval": build.reference("train-cpu"),
    }


def test_helm_is_the_release_the_chart_is_tested_with() -> None:
    import helm_python

    (version,) = set(re.findall(r"HELM_VERSION=(v[\d.]+)", DOC))
    assert f"--version {version}" in DOC
    libraries = sorted((Path(helm_python.__file__).parent / "lib").glob("libhelm_c.so*"))
    embedded = set(re.findall(rb"helm\.sh/helm/v4@(v[\d.]+)", libraries[0].read_bytes()))
    assert embedded == {version.encode()}
    assert "linux-amd64/helm" in DOC and "tar.gz.sha256" in DOC


def _smoke_script() -> str:
    (block,) = [b for b in code_blocks(SECTIONS["smoke"]) if "embedded_params" in b.body]
    script = re.search(r"<<'EOF'\n(.*?)^EOF$", block.body, re.DOTALL | re.MULTILINE)
    assert script is not None
    return script[1]


def test_the_smoke_parameters_pass_the_validate_steps_checks(
    s3_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The script builds the demo's assets, uploads them to a real S3 server and writes the parameters; the run
    those parameters describe passes what its validate step checks (bucket, model, datasets) and what submit
    checks, and its judge is the Service the walkthrough exposes."""
    from rloo.demo.judge import MODEL, ToyJudge
    from rloo.pipeline.params import check_params, with_defaults
    from rloo.pipeline.submit import params_for_submit
    from rloo.stages.validate import build_plan

    use_s3(s3_server, monkeypatch)
    prefix = f"s3://{s3_server.bucket}/smoke"
    env = {**os.environ, "SMOKE_PREFIX": prefix}
    proc = subprocess.run(
        [sys.executable, "-c", _smoke_script()],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    params = yaml.safe_load((tmp_path / "smoke-params.yaml").read_text())
    assert params["model"] == f"{prefix}/model" and params["output_uri"] == f"s3://{s3_server.bucket}/runs"
    checked = check_params(params, required=True)
    plan = build_plan(with_defaults(checked), check_paths=True)
    assert plan.cluster.gpu_count == 0  # a CPU cluster
    params_for_submit(checked)

    run = next(w for w in _commands(SECTIONS["smoke"]) if w[:4] == ["kubectl", "-n", NAMESPACE, "run"])
    expose = next(w for w in _commands(SECTIONS["smoke"]) if "expose" in w)
    assert expose[expose.index("pod") + 1] == run[4] and "--port=8000" in expose
    assert params["judge_base_url"] == f"http://{run[4]}.{NAMESPACE}.svc.cluster.local:8000/v1"
    assert params["judge_model"] == MODEL
    assert "ToyJudge('0.0.0.0', 8000).start()" in run[-1] and callable(ToyJudge("127.0.0.1", 0).start)
