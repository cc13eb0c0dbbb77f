"""The compiled pipeline: the committed YAML is current, and its DAG and platform spec say what we mean."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("kfp")
pytest.importorskip("kfp.kubernetes")

from rloo.cli.pipeline_cmd import main as pipeline_main
from rloo.pipeline.compile import default_yaml, load_yaml
from rloo.pipeline.images import DEFAULT_REGISTRY, DEFAULT_TAG
from rloo.stages import constants as C

COMMITTED = default_yaml()


def image(name: str) -> str:
    """The default reference: the committed YAML is compiled without RLOO_IMAGE_* overrides."""
    return f"{DEFAULT_REGISTRY}/rloo-{name}:{DEFAULT_TAG}"


@pytest.fixture(scope="module")
def docs() -> tuple[dict[str, Any], dict[str, Any]]:
    spec, platform = load_yaml(COMMITTED)
    return spec, platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]


def test_committed_yaml_is_current(tmp_path: Path) -> None:
    # A fresh process without RLOO_IMAGE_*/RLOO_SCRATCH_* overrides: both are fixed when the pipeline is built.
    out = tmp_path / "p.yaml"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RLOO_IMAGE_", "RLOO_SCRATCH_"))}
    code = f"from rloo.cli.pipeline_cmd import main; raise SystemExit(main(['compile', '--output', {str(out)!r}]))"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(out)
    assert out.read_text() == COMMITTED.read_text(), (
        "pipelines/rloo_pipeline.yaml is stale: run 'rloo pipeline compile' and commit the result."
    )


def _tasks(spec: dict[str, Any], comp: str) -> dict[str, Any]:
    return spec["components"][comp]["dag"]["tasks"]


# What the single-node train step's pod spec requests, also passed to the condition DAG it runs in (KFP's
# compiler passes a DAG no value that only a pod-spec field uses)
_POD_SPEC_INPUTS = {
    f"pipelinechannel--{name}"
    for name in (
        "gpu_resource",
        "gpu_node_selector",
        "gpu_tolerations",
        "train_cpu",
        "train_memory",
        "eval_cpu",
        "eval_memory",
    )
} | {f"pipelinechannel--{name}" for name in ("s3_secret", "mlflow_secret", "hf_secret", "judge_secret")}


def test_dag_edges(docs: tuple[dict[str, Any], dict[str, Any]]) -> None:
    spec, _ = docs
    root = spec["root"]["dag"]["tasks"]
    assert root["finish-run"]["triggerPolicy"]["strategy"] == "ALL_UPSTREAM_TASKS_COMPLETED"  # exit handler
    assert root["finish-run"]["dependentTasks"] == ["exit-handler-1"]
    inner = _tasks(spec, "comp-exit-handler-1")
    assert set(inner) == {"validate-params", "fetch-sft", "condition-branches-2", "evaluate", "push-model"}
    assert inner["fetch-sft"]["dependentTasks"] == ["validate-params"]  # nothing else runs before validation
    assert "validate-params" in inner["condition-branches-2"]["dependentTasks"]
    assert "fetch-sft" in inner["condition-branches-2"]["dependentTasks"]
    # validate-params: every later step reads its part of the plan the validate step built
    assert set(inner["evaluate"]["dependentTasks"]) == {
        "condition-branches-2",
        "fetch-sft",
        "validate-params",
    }
    # fetch-sft: the push names the base model by where it was fetched from (Hub id or store URI)
    push_after = {"condition-branches-2", "evaluate", "fetch-sft", "validate-params"}
    assert set(inner["push-model"]["dependentTasks"]) == push_after
    # no later step takes a raw pipeline parameter it could read from the plan: only the pod-spec values the
    # single-node train step checks it got, and the exit handler's experiment (it runs when validation failed)
    for name, task in inner.items():
        raw = {
            v["componentInputParameter"]
            for v in task.get("inputs", {}).get("parameters", {}).values()
            if "componentInputParameter" in v
        }
        assert name == "validate-params" or raw <= {"pipelinechannel--num_nodes"} | _POD_SPEC_INPUTS, (
            name,
            raw,
        )
    branches = _tasks(spec, "comp-condition-branches-2")
    conditions = sorted(t["triggerPolicy"]["condition"] for t in branches.values())
    assert conditions == [
        "!(int(inputs.parameter_values['pipelinechannel--num_nodes']) == 1)",
        "int(inputs.parameter_values['pipelinechannel--num_nodes']) == 1",
    ]


def test_gpu_requests_and_images(docs: tuple[dict[str, Any], dict[str, Any]]) -> None:
    spec, _ = docs
    execs = spec["deploymentSpec"]["executors"]
    train = execs["exec-train-rloo"]["container"]
    assert train["image"] == image("train")
    acc = train["resources"]["accelerator"]
    # the validate step's text output: the driver reads an integer parameter there as '' (test_compiled_for_driver)
    assert acc["resourceCount"] == "{{$.inputs.parameters['pipelinechannel--validate-params-gpu_limit']}}"
    assert acc["resourceType"] == "{{$.inputs.parameters['pipelinechannel--gpu_resource']}}"
    assert execs["exec-evaluate"]["container"]["image"] == image("eval")
    # one GPU, none when gpu_count is 0 (a CPU cluster): the validate step's text output again
    eval_gpus = execs["exec-evaluate"]["container"]["resources"]["accelerator"]["resourceCount"]
    assert eval_gpus == "{{$.inputs.parameters['pipelinechannel--validate-params-eval_gpu_limit']}}"
    for cpu_step in ("validate-params", "fetch-sft", "train-rloo-multinode", "push-model", "finish-run"):
        container = execs[f"exec-{cpu_step}"]["container"]
        assert container["image"] == image("slim")
        assert "accelerator" not in container.get("resources", {}), cpu_step


def _param(name: str) -> str:
    return f"{{{{$.inputs.parameters['pipelinechannel--{name}']}}}}"


def test_every_executor_requests_and_limits_cpu_and_memory(
    docs: tuple[dict[str, Any], dict[str, Any]],
) -> None:
    """No pod of the pipeline runs without CPU/memory requests and limits: the GPU steps' come from pipeline
    parameters (requests == limits), the CPU steps' are the constants of rloo.stages.constants."""
    spec, _ = docs
    execs = spec["deploymentSpec"]["executors"]
    keys = ("resourceCpuRequest", "resourceCpuLimit", "resourceMemoryRequest", "resourceMemoryLimit")
    for name, e in execs.items():
        res = e["container"].get("resources") or {}
        assert all(res.get(k) for k in keys), f"{name}: {res}"
    for name, prefix in (("exec-train-rloo", "train"), ("exec-evaluate", "eval")):
        res = execs[name]["container"]["resources"]
        assert res["resourceCpuRequest"] == res["resourceCpuLimit"] == _param(f"{prefix}_cpu")
        assert res["resourceMemoryRequest"] == res["resourceMemoryLimit"] == _param(f"{prefix}_memory")
    for name, fixed in (
        ("exec-validate-params", C.VALIDATE_RESOURCES),
        ("exec-fetch-sft", C.FETCH_RESOURCES),
        ("exec-train-rloo-multinode", C.LAUNCHER_RESOURCES),
        ("exec-push-model", C.PUSH_RESOURCES),
        ("exec-finish-run", C.FINISH_RESOURCES),
    ):
        res = execs[name]["container"]["resources"]
        got = [res[k] for k in keys]
        assert got == [fixed.cpu_request, fixed.cpu_limit, fixed.memory_request, fixed.memory_limit], name
    # the multi-node job's pods get the training pod's settings from the plan the launcher reads
    multi = _tasks(spec, "comp-condition-4")["train-rloo-multinode"]["inputs"]["parameters"]
    assert multi["plan"]["componentInputParameter"] == "pipelinechannel--validate-params-plan"
    params = spec["root"]["inputDefinitions"]["parameters"]
    for name in ("train_cpu", "train_memory", "eval_cpu", "eval_memory", "train_service_account"):
        assert params[name]["parameterType"] == "STRING", name


def test_caching_retries_and_run_ids(docs: tuple[dict[str, Any], dict[str, Any]]) -> None:
    spec, _ = docs
    inner = _tasks(spec, "comp-exit-handler-1")
    single = _tasks(spec, "comp-condition-3")["train-rloo"]
    multi = _tasks(spec, "comp-condition-4")["train-rloo-multinode"]
    for task in (single, multi, inner["evaluate"]):
        assert task["cachingOptions"] == {}, "GPU/training steps must not be cached"
    assert inner["validate-params"]["cachingOptions"] == {}, "a resubmission must check everything again"
    for task, policy in (
        (inner["fetch-sft"], C.io_retry()),
        (inner["push-model"], C.io_retry()),
        # a retried train step resumes from the run's checkpoints, a retried launcher adopts its job, a retried
        # evaluation starts over; each try holds GPUs: fewer, later (rloo.stages.retry stops those that cannot heal)
        (single, C.TRAIN_RETRY),
        (multi, C.LAUNCHER_RETRY),
        (inner["evaluate"], C.EVAL_RETRY),
    ):
        assert task["retryPolicy"] == {
            "backoffDuration": f"{policy.backoff_s}s",
            "backoffFactor": float(policy.factor),
            "backoffMaxDuration": f"{policy.max_duration_s}s",
            "maxRetryCount": policy.retries,
        }
    run_id = single["inputs"]["parameters"]["kfp_run_id"]["runtimeValue"]["constant"]
    run_name = single["inputs"]["parameters"]["kfp_run_name"]["runtimeValue"]["constant"]
    assert (run_id, run_name) == ("{{$.pipeline_job_uuid}}", "{{$.pipeline_job_name}}")


def _secret_names(executor: dict[str, Any]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for s in executor.get("secretAsEnv", []):
        param = s["secretNameParameter"]["componentInputParameter"]
        out[param] = {k["envVar"] for k in s["keyToEnv"]}
    return out


def test_platform_spec(docs: tuple[dict[str, Any], dict[str, Any]]) -> None:
    _, execs = docs
    s3 = set(C.S3_SECRET_KEYS.values())
    assert _secret_names(execs["exec-fetch-sft"]) == {
        "pipelinechannel--s3_secret": s3,
        "pipelinechannel--hf_secret": {"HF_TOKEN"},
    }
    assert _secret_names(execs["exec-evaluate"]) == {
        "pipelinechannel--s3_secret": s3,
        "pipelinechannel--mlflow_secret": set(C.MLFLOW_SECRET_KEYS.values()),
        "pipelinechannel--judge_secret": {"OPENAI_API_KEY"},
        # the training reward model, which scores the judged pairs, may be a private Hub repo
        "pipelinechannel--hf_secret": {"HF_TOKEN"},
    }
    # validation looks the model up (s3:// upload, Hub repo) and sees every secret a later step mounts; all
    # optional, so a missing secret fails as a message (rloo.stages.validate.check_secrets)
    assert _secret_names(execs["exec-validate-params"]) == {
        "pipelinechannel--s3_secret": s3,
        "pipelinechannel--hf_secret": {"HF_TOKEN"},
        "pipelinechannel--mlflow_secret": set(C.MLFLOW_SECRET_KEYS.values()),
        "pipelinechannel--judge_secret": {"OPENAI_API_KEY"},
    }
    assert all(s["optional"] for s in execs["exec-validate-params"]["secretAsEnv"])
    # the MLflow secret's keys (URI, and user/password for a server behind MLflow's basic-auth app) are
    # optional wherever they are read: a run may log to no server, or to one without a login
    assert {"MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"} <= set(C.MLFLOW_SECRET_KEYS.values())
    for e in execs.values():
        for s in e.get("secretAsEnv", []):
            if s["secretNameParameter"]["componentInputParameter"].endswith("mlflow_secret"):
                assert s["optional"], e
    # a judge reward (--judge_reward_coef in extra_train_args) asks the judge from the train pods, so they get
    # its key, optionally: a run without a judge reward never reads it, and a missing secret fails no pod
    train_secrets = {
        s["secretNameParameter"]["componentInputParameter"]: s
        for s in execs["exec-train-rloo"]["secretAsEnv"]
    }
    assert _secret_names(execs["exec-train-rloo"])["pipelinechannel--judge_secret"] == {"OPENAI_API_KEY"}
    assert train_secrets["pipelinechannel--judge_secret"]["optional"]
    # the multi-node launcher reads and records the run's failure for good in the store before its job starts
    assert _secret_names(execs["exec-train-rloo-multinode"]) == {"pipelinechannel--s3_secret": s3}
    assert _secret_names(execs["exec-finish-run"]) == {"mlflow_secret": set(C.MLFLOW_SECRET_KEYS.values())}
    # the exit handler deletes a job the terminated launcher left: it knows its own pod's namespace
    assert {f["name"] for f in execs["exec-finish-run"]["fieldPathAsEnv"]} == set(C.POD_FIELD_ENV)
    for gpu in ("exec-train-rloo", "exec-evaluate"):
        e = execs[gpu]
        assert e["emptyDirMounts"][0] == {
            "medium": "Memory",
            "mountPath": "/dev/shm",
            "sizeLimit": C.SHM_SIZE,
            "volumeName": "dshm",
        }
        assert e["tolerations"] == [
            {"effect": "NoSchedule", "key": "nvidia.com/gpu", "operator": "Exists"},
            {"tolerationJson": {"componentInputParameter": "pipelinechannel--gpu_tolerations"}},
        ]
        assert (
            e["nodeSelector"]["nodeSelectorJson"]["componentInputParameter"]
            == "pipelinechannel--gpu_node_selector"
        )
    assert execs["exec-train-rloo"]["activeDeadlineSeconds"] == str(C.TRAIN_TIMEOUT_S)
    assert execs["exec-evaluate"]["activeDeadlineSeconds"] == str(C.EVAL_TIMEOUT_S)
    assert execs["exec-validate-params"]["activeDeadlineSeconds"] == str(C.VALIDATE_TIMEOUT_S)
    for cpu in ("exec-validate-params", "exec-fetch-sft", "exec-push-model"):
        assert "tolerations" not in execs[cpu]
    assert "emptyDirMounts" not in execs["exec-validate-params"]


def test_steps_that_stage_models_get_scratch_space(docs: tuple[dict[str, Any], dict[str, Any]]) -> None:
    """Models are staged in /tmp, an emptyDir on the node's disk with a size limit, not in the container's
    writable layer (every temporary directory of the steps is under /tmp)."""
    _, execs = docs
    for step, key in (
        ("fetch-sft", "fetch"),
        ("train-rloo", "train"),
        ("evaluate", "eval"),
        ("push-model", "push"),
    ):
        scratch = [m for m in execs[f"exec-{step}"]["emptyDirMounts"] if m["volumeName"] == C.SCRATCH_VOLUME]
        # on disk (no medium): Memory would count against the pod's memory limit
        assert scratch == [
            {"mountPath": "/tmp", "sizeLimit": C.DEFAULT_SCRATCH[key], "volumeName": "scratch"}
        ]


def test_a_local_run_retries_nothing() -> None:
    """kfp.local honours retry policies; their minutes of backoff are for a cluster, not 'make demo'."""
    from rloo.pipeline.compile import load_pipeline
    from rloo.pipeline.local import _without_retries

    spec = load_pipeline().pipeline_spec

    def retried() -> list[str]:
        dags = [spec.root.dag, *(c.dag for c in spec.components.values() if c.HasField("dag"))]
        return sorted(n for d in dags for n, t in d.tasks.items() if t.HasField("retry_policy"))

    before = retried()
    assert {"fetch-sft", "train-rloo", "evaluate", "push-model"} <= set(before)
    with _without_retries(spec):
        assert retried() == []
    assert retried() == before
    train = spec.components["comp-condition-3"].dag.tasks["train-rloo"].retry_policy
    assert train.max_retry_count == C.GPU_RETRIES  # restored whole, not just marked present


def test_scratch_size_is_set_at_compile_time(monkeypatch: pytest.MonkeyPatch) -> None:
    from rloo.errors import UserError

    monkeypatch.setenv("RLOO_SCRATCH_TRAIN", "1Ti")
    assert C.scratch_size("train") == "1Ti"
    assert C.scratch_size("eval") == C.DEFAULT_SCRATCH["eval"]
    monkeypatch.setenv("RLOO_SCRATCH_EVAL", "lots")
    with pytest.raises(UserError, match="RLOO_SCRATCH_EVAL must be"):
        C.scratch_size("eval")


def test_the_launcher_knows_its_own_pod(docs: tuple[dict[str, Any], dict[str, Any]]) -> None:
    """The multi-node job's owner reference names the launcher pod: the downward API gives its name, uid and
    namespace (rloo.k8s.builders.owner_from_env reads them)."""
    _, execs = docs
    fields = {f["name"]: f["fieldPath"] for f in execs["exec-train-rloo-multinode"]["fieldPathAsEnv"]}
    assert fields == C.POD_FIELD_ENV
    assert set(fields.values()) == {"metadata.name", "metadata.uid", "metadata.namespace"}


def test_components_import_nothing_heavy_at_module_level() -> None:
    """A component's module may import kfp, the stdlib and rloo.pipeline.images; anything else (torch...)
    would only be importable at compile time, not inside KFP's serialized function body."""
    import ast

    root = COMMITTED.parents[1] / "components"
    files = sorted(root.glob("*/component.py"))
    assert {f.parent.name for f in files} >= {"fetch_sft", "train_rloo", "evaluate", "push_model", "validate"}
    for f in files:
        tree = ast.parse(f.read_text())
        for node in tree.body:
            if isinstance(node, ast.ImportFrom):
                assert node.module in ("kfp", "kfp.dsl", "typing", "rloo.pipeline.images"), (
                    f"{f}: {node.module}"
                )
            elif isinstance(node, ast.Import):
                assert all(a.name.split(".")[0] == "kfp" for a in node.names), f


def test_cli_errors_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert pipeline_main(["submit"]) == 2
    assert capsys.readouterr().err.strip().count("\n") == 0
    assert pipeline_main(["nonsense"]) == 2


def test_every_parameter_is_documented(docs: tuple[dict[str, Any], dict[str, Any]]) -> None:
    spec, _ = docs
    params = spec["root"]["inputDefinitions"]["parameters"]
    assert {"model", "rloo_k", "gpu_count", "num_nodes", "judge_base_url", "mlflow_experiment"} <= set(params)
    undocumented = [name for name, p in params.items() if not p.get("description")]
    assert not undocumented
    assert params["gpu_count"]["parameterType"] == "NUMBER_INTEGER"
    assert params["gpu_node_selector"]["parameterType"] == "STRUCT"
