"""The compiled pipeline read the way KFP's backend driver reads it at run time.

The driver fills in the pod spec of a step before the pod is created. A template placeholder in a pod-spec
field (``{{$.inputs.parameters['X']}}`` in the accelerator count and type, CPU and memory) is replaced by the
task input ``X`` read with ``GetStringValue()`` (KFP ``backend/src/v2/driver/resolve.go``,
``resolvePodSpecInputRuntimeParameter``): a NUMBER or BOOLEAN value reads as the empty string, so the field
silently loses its value (a GPU step scheduled without GPUs). Kubernetes JSON references (``nodeSelectorJson``
and the like) go through ``resolveK8sJsonParameter``, which needs a STRUCT (or LIST) value.

So: every placeholder in a pod-spec field must resolve, through the DAGs, to a STRING pipeline parameter, a
STRING task output or a constant; every JSON reference to a STRUCT or LIST.
"""

# no "from __future__ import annotations": a test builds a KFP component, and KFP reads its annotations

import re
from typing import Any

import pytest

pytest.importorskip("kfp")

from rloo.pipeline.compile import default_yaml, load_yaml

PLACEHOLDER = re.compile(r"\{\{\$\.inputs\.parameters\['([^']+)'\]\}\}")
# container fields the launcher (not the driver) resolves, with typed conversions: not pod-spec fields
LAUNCHER_FIELDS = {"args", "command"}


def _strings(node: Any) -> list[str]:
    if isinstance(node, str):
        return [node]
    if isinstance(node, dict):
        return [s for v in node.values() for s in _strings(v)]
    if isinstance(node, list):
        return [s for v in node for s in _strings(v)]
    return []


def _json_refs(node: Any, key: str = "") -> list[tuple[str, str]]:
    """``(field, parameter)`` of every ``*Json`` field bound to a component input parameter."""
    out: list[tuple[str, str]] = []
    if isinstance(node, dict):
        if key.endswith("Json") and "componentInputParameter" in node:
            out.append((key, node["componentInputParameter"]))
        for k, v in node.items():
            out += _json_refs(v, k)
    elif isinstance(node, list):
        for v in node:
            out += _json_refs(v, key)
    return out


class Dags:
    """Who calls whom: each (DAG component, task name, task) and the inputs' types as the driver sees them."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.components = {**spec["components"], "root": spec["root"]}
        self.calls: list[tuple[str, str, dict[str, Any]]] = [
            (dag, name, task)
            for dag, comp in self.components.items()
            for name, task in (comp.get("dag") or {}).get("tasks", {}).items()
        ]

    def tasks_of_executor(self, executor: str) -> list[tuple[str, str, dict[str, Any]]]:
        return [
            call
            for call in self.calls
            if self.components[call[2]["componentRef"]["name"]].get("executorLabel") == executor
        ]

    def input_type(self, dag: str, task: dict[str, Any], name: str) -> str:
        """The type of input ``name`` of ``task`` (a task of ``dag``), followed to where its value comes from."""
        binding = task["inputs"]["parameters"][name]
        if "runtimeValue" in binding:
            constant = binding["runtimeValue"]["constant"]
            return "CONSTANT" if not isinstance(constant, str) or not PLACEHOLDER.search(constant) else "?"
        if "taskOutputParameter" in binding:
            out = binding["taskOutputParameter"]
            producer = self.components[dag]["dag"]["tasks"][out["producerTask"]]
            producer_comp = self.components[producer["componentRef"]["name"]]
            return producer_comp["outputDefinitions"]["parameters"][out["outputParameterKey"]][
                "parameterType"
            ]
        if "componentInputParameter" in binding:
            return self.dag_input_type(dag, binding["componentInputParameter"])
        return "?"

    def dag_input_type(self, dag: str, name: str) -> str:
        """A DAG's input, followed up through the task that runs the DAG (to the root's parameters). A DAG
        input nobody declares is 'MISSING': the driver cannot resolve it (KFP's compiler leaves a channel that
        only a pod-spec field uses out of the condition DAGs it crosses)."""
        declared = (self.components[dag].get("inputDefinitions") or {}).get("parameters") or {}
        if name not in declared:
            return "MISSING"
        if dag == "root":
            return str(declared[name]["parameterType"])
        callers = [(d, t) for d, _, t in self.calls if t["componentRef"]["name"] == dag]
        types = {
            self.input_type(d, t, name) if name in t["inputs"].get("parameters", {}) else "MISSING"
            for d, t in callers
        }
        assert len(types) == 1, f"{dag}.{name} is bound to values of types {types}"
        return types.pop()


@pytest.fixture(scope="module")
def compiled() -> tuple[Dags, dict[str, Any], dict[str, Any]]:
    spec, platform = load_yaml(default_yaml())
    return (
        Dags(spec),
        spec["deploymentSpec"]["executors"],
        platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"],
    )


def pod_spec_placeholders(
    dags: Dags, executors: dict[str, Any], platform: dict[str, Any]
) -> list[tuple[str, str, str]]:
    """(executor, parameter, type the driver reads) for every template placeholder in a pod-spec field."""
    out = []
    for label, executor in executors.items():
        container = executor.get("container") or {}
        fields = {k: v for k, v in container.items() if k not in LAUNCHER_FIELDS}
        names = {m for s in _strings([fields, platform.get(label, {})]) for m in PLACEHOLDER.findall(s)}
        for dag, _, task in dags.tasks_of_executor(label):
            out += [(label, name, dags.input_type(dag, task, name)) for name in sorted(names)]
    return out


def test_pod_spec_placeholders_read_as_strings(compiled: tuple[Dags, dict[str, Any], dict[str, Any]]) -> None:
    dags, executors, platform = compiled
    found = pod_spec_placeholders(dags, executors, platform)
    # the GPU steps do use placeholders (the check is not vacuous): train's GPUs, CPU and memory
    assert {("exec-train-rloo", "resourceCount")} <= {
        (label, "resourceCount")
        for label, _, _ in found
        if "resourceCount" in str(executors[label]["container"].get("resources", {}).get("accelerator", {}))
    }
    wrong = [
        f"{label}: {name} is {kind}" for label, name, kind in found if kind not in ("STRING", "CONSTANT")
    ]
    assert not wrong, "pod-spec placeholders the driver would resolve to '' (GetStringValue): " + "; ".join(
        wrong
    )


def test_json_references_are_structs(compiled: tuple[Dags, dict[str, Any], dict[str, Any]]) -> None:
    dags, _, platform = compiled
    checked = 0
    for label, config in platform.items():
        for field, name in _json_refs(config):
            for dag, _, task in dags.tasks_of_executor(label):
                # the task's own input, or else the input of the DAG the task runs in
                bound = name in task["inputs"].get("parameters", {})
                kind = dags.input_type(dag, task, name) if bound else dags.dag_input_type(dag, name)
                assert kind in ("STRUCT", "LIST"), (
                    f"{label}.{field} -> {name} is {kind}: the driver needs JSON"
                )
                checked += 1
    assert checked, "no JSON reference found: the GPU steps' node selector should be one"


def test_the_checker_catches_an_integer_gpu_count() -> None:
    """The checker itself: a task whose accelerator count is an integer pipeline parameter is reported."""
    from kfp import compiler, dsl

    @dsl.component(base_image="python:3.11")
    def step() -> None:
        pass

    @dsl.pipeline(name="p")
    def p(gpu_count: int = 1, gpu_type: str = "nvidia.com/gpu") -> None:
        step().set_accelerator_type(gpu_type).set_accelerator_limit(gpu_count)

    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "p.yaml"
        compiler.Compiler().compile(p, str(out))
        import yaml

        spec = yaml.safe_load(out.read_text())
    found = pod_spec_placeholders(Dags(spec), spec["deploymentSpec"]["executors"], {})
    assert ("exec-step", "pipelinechannel--gpu_count", "NUMBER_INTEGER") in found
    assert ("exec-step", "pipelinechannel--gpu_type", "STRING") in found
