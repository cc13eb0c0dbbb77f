"""The compiled pipeline under the rules of the code that runs it on a cluster, not kfp.local's: Argo's retry
window, the Secrets a pod needs before it can start, what the driver puts in a GPU pod, caching, the pod's QoS.

Each test reads ``pipelines/rloo_pipeline.yaml`` (what is uploaded) the way the named upstream code reads it.
"""

# no "from __future__ import annotations": kfp's executor reads the component's annotations

import io
import json
import math
from contextlib import redirect_stderr
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("kfp")

from rloo.pipeline.compile import default_yaml, load_yaml
from rloo.stages import constants as C


@pytest.fixture(scope="module")
def compiled() -> tuple[dict[str, Any], dict[str, Any]]:
    spec, platform = load_yaml(default_yaml())
    return spec, platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]


def _tasks(spec: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Every task of every DAG, by name (the names are unique in this pipeline)."""
    dags = [spec["root"]["dag"], *(c["dag"] for c in spec["components"].values() if "dag" in c)]
    return {name: task for dag in dags for name, task in dag["tasks"].items()}


def _executor(spec: dict[str, Any], task: dict[str, Any]) -> str:
    return spec["components"][task["componentRef"]["name"]]["executorLabel"]


# --- Argo's retry window ------------------------------------------------------------------------------------


def _seconds(duration: str) -> int:
    """A proto Duration as the SDK writes it ('3600s') to the whole seconds KFP's Argo compiler passes on
    (``GetBackoffMaxDuration().Seconds``), which Argo's ``ParseStringToDuration`` reads as seconds."""
    assert duration.endswith("s"), duration
    return int(float(duration[:-1]))


def _argo_factor(factor: float) -> int:
    """KFP's Argo compiler writes the factor with Go's ``%v`` (``AnyStringPtr``: 2.0 -> "2"); Argo reads it
    with ``intstr.Int32``, which fails the node on anything but an integer ("1.5")."""
    text = f"{factor:g}"
    assert text.lstrip("-").isdigit(), f"backoff factor {factor} is not an integer: Argo fails the node"
    return int(text)


def argo_attempts(
    retries: int, backoff_s: int, factor: int, max_duration_s: int, pod_deadline_s: int, scheduling_s: int
) -> list[tuple[float, float]]:
    """``(start, end)`` of every attempt Argo runs of a step whose every attempt fails at its deadline (waiting
    ``scheduling_s`` for a node first), under ``workflow/controller/operator.go`` ``processNodeRetries``:

    - the window is counted from the first attempt's start: once past it the node fails ("Max duration limit
      exceeded");
    - the wait before retry n (n = attempts so far) is ``duration * factor**(n-1)``; when it would end past
      the window the node fails ("Backoff would exceed max duration limit");
    - a retry runs with the window's end as its ``executionDeadline`` (the pod's ``ARGO_DEADLINE``: the wait
      container kills the step then), besides its own activeDeadlineSeconds (set by KFP's driver,
      ``backend/src/v2/driver/k8s.go``)."""
    attempts: list[tuple[float, float]] = []
    start, deadline = 0.0, math.inf
    window_end = float(max_duration_s)
    while True:
        end = min(start + scheduling_s + pod_deadline_s, deadline)
        attempts.append((start, end))
        if len(attempts) > retries:
            return attempts  # retryStrategy.limit reached
        if end > window_end:
            return attempts  # Max duration limit exceeded
        wait = backoff_s * factor ** (len(attempts) - 1)
        if end + wait > window_end:
            return attempts  # Backoff would exceed max duration limit
        start, deadline = end + wait, window_end


def test_argo_attempts_model_the_controller() -> None:
    """The model above on the SDK's default window (3600 s) and this project's earlier 900 s one: a step with
    a 2 h deadline gets one attempt, the retries Argo never starts."""
    assert len(argo_attempts(2, 120, 2, 3600, 2 * 3600, 0)) == 1
    assert len(argo_attempts(2, 120, 2, 900, 600, 0)) == 2  # the retry started, and was cut at 900 s
    assert argo_attempts(2, 120, 2, 900, 600, 0)[1] == (720.0, 900.0)
    assert len(argo_attempts(2, 1, 2, 10_000, 100, 0)) == 3


def test_every_retry_gets_its_full_deadline(compiled: tuple[dict[str, Any], dict[str, Any]]) -> None:
    """Every retried step's ``retryPolicy`` as KFP's Argo compiler turns it into a ``retryStrategy``
    (``backend/src/v2/compiler/argocompiler/container.go``, ``getTaskRetryParametersWithValues``) and Argo
    runs it (``argoproj/argo-workflows workflow/controller/operator.go``, ``processNodeRetries``): each attempt,
    failing at its full deadline after waiting its scheduling time, is followed by the next one, and no
    attempt is cut short by the window."""
    spec, execs = compiled
    retried = {n: t for n, t in _tasks(spec).items() if "retryPolicy" in t}
    assert {"fetch-sft", "train-rloo", "train-rloo-multinode", "evaluate", "push-model"} <= set(retried)
    for name, task in retried.items():
        policy = task["retryPolicy"]
        executor = execs[_executor(spec, task)]
        deadline = int(executor["activeDeadlineSeconds"])  # each attempt's own: a retried step needs one
        # the scheduling allowance: a GPU pod may wait for a node pool to scale up (rloo.stages.constants)
        resources = spec["deploymentSpec"]["executors"][_executor(spec, task)]["container"].get(
            "resources", {}
        )
        scheduling = C.GPU_SCHEDULING_S if "accelerator" in resources else C.CPU_SCHEDULING_S
        attempts = argo_attempts(
            retries=int(policy["maxRetryCount"]),
            backoff_s=_seconds(policy["backoffDuration"]),
            factor=_argo_factor(policy["backoffFactor"]),
            max_duration_s=_seconds(policy["backoffMaxDuration"]),
            pod_deadline_s=deadline,
            scheduling_s=scheduling,
        )
        assert len(attempts) == int(policy["maxRetryCount"]) + 1, f"{name}: only {len(attempts)} attempts run"
        for start, end in attempts:
            assert end - start == scheduling + deadline, f"{name}: an attempt cut at {end - start:.0f}s"


def test_the_retry_window_is_derived_from_the_policy() -> None:
    """The window is computed, never a literal that a new deadline can outgrow: every attempt whole plus
    every backoff (``duration * factor**n`` before retry n+1, Argo's formula)."""
    policy = C.RetryPolicy(retries=3, backoff_s=60, factor=2, timeout_s=1000, scheduling_s=100)
    assert policy.backoffs_s() == [60, 120, 240]
    assert policy.max_duration_s == 4 * 1100 + 420
    longer = C.RetryPolicy(retries=3, backoff_s=60, factor=2, timeout_s=2000, scheduling_s=100)
    assert longer.max_duration_s == policy.max_duration_s + 4 * 1000


# --- Secrets: checked before any GPU is requested ----------------------------------------------------------


def _secret_mounts(executor: dict[str, Any]) -> list[tuple[str, set[str], bool]]:
    """``(secret parameter, env vars, optional)`` of an executor's ``secretAsEnv`` (KFP's driver,
    ``backend/src/v2/driver/k8s.go``: a ``SecretKeySelector`` per key with ``Optional`` as given)."""
    out = []
    for s in executor.get("secretAsEnv", []):
        param = s["secretNameParameter"]["componentInputParameter"].removeprefix("pipelinechannel--")
        out.append((param, {k["envVar"] for k in s["keyToEnv"]}, bool(s.get("optional", False))))
    return out


def test_validate_sees_every_secret_a_later_step_needs(
    compiled: tuple[dict[str, Any], dict[str, Any]],
) -> None:
    """A Secret or key a pod mounts with ``optional: false`` and that does not exist keeps the pod in
    ``CreateContainerConfigError`` (kubelet ``pkg/kubelet/kubelet_pods.go`` ``makeEnvironmentVariables``),
    which Argo does not treat as a failure (``workflow/controller/operator.go`` only fails pods on their
    terminal phases or deadlines): a GPU pod would hold its node until ``activeDeadlineSeconds``. So the
    validate step, before any GPU is requested, mounts each of them optionally and checks it
    (``rloo.stages.validate.check_secrets``, which reads ``C.STEP_SECRETS``)."""
    _, execs = compiled
    needed: dict[str, set[str]] = {}
    for name, executor in execs.items():
        for param, envs, optional in _secret_mounts(executor):
            if not optional and name != "exec-validate-params":
                needed.setdefault(param, set()).update(envs)
    assert needed, "no step mounts a required secret: the test reads the wrong field"
    seen = {
        param: envs for param, envs, optional in _secret_mounts(execs["exec-validate-params"]) if optional
    }
    for param, envs in needed.items():
        assert envs <= seen.get(param, set()), (
            f"validate does not see {param}'s {envs - seen.get(param, set())}"
        )
    declared = {p: set(keys.values()) for p, (keys, required) in C.STEP_SECRETS.items() if required}
    assert declared == needed, "rloo.stages.constants.STEP_SECRETS disagrees with what the steps mount"


def _validate_as_launched(tmp_path: Path, params: dict[str, Any], env: dict[str, str]) -> tuple[int, str]:
    """The real ``validate_params`` component through ``kfp.dsl.executor.Executor`` (what
    ``kfp.dsl.executor_main`` runs) with the executor input KFP's launcher hands it
    (``backend/src/v2/component/launcher_v2.go``: every input in ``parameterValues``, an output file per output
    parameter and artifact), in a pod environment ``env``. Returns (exit code, stderr)."""
    import os

    from kfp.dsl.executor import Executor

    from rloo.pipeline.compile import load_pipeline

    load_pipeline()  # the repository root on sys.path, for components/
    from components.validate.component import validate_params

    outputs = {name: {"outputFile": str(tmp_path / name)} for name in ("plan", "gpu_limit", "eval_gpu_limit")}
    executor_input = {
        "inputs": {"parameterValues": params},
        "outputs": {
            "parameters": outputs,
            "artifacts": {
                "summary": {
                    "artifacts": [
                        {
                            "name": "summary",
                            "type": {"schemaTitle": "system.Markdown"},
                            "uri": str(
                                tmp_path / "summary"
                            ),  # the launcher maps minio:// to /minio/...: a local path here
                            "metadata": {},
                        }
                    ]
                }
            },
            "outputFile": str(tmp_path / "executor_output.json"),
        },
    }
    saved = dict(os.environ)
    err = io.StringIO()
    try:
        os.environ.clear()
        os.environ.update(env)
        with redirect_stderr(err):
            Executor(executor_input=executor_input, function_to_execute=validate_params.python_func).execute()
        code = 0
    except SystemExit as e:
        code = int(e.code or 0)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return code, err.getvalue()


def _pod_env(**secrets: str) -> dict[str, str]:
    """A KFP step's environment on a cluster: KFP's ``commonEnvs`` (``argocompiler/common.go``) and the
    Secret variables that reached it."""
    import os

    keep = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "HF_HUB_OFFLINE", "TMPDIR")}
    return {**keep, "KFP_POD_NAME": "rloo-rlhf-x-validate-params-1", "KFP_POD_UID": "u-1", **secrets}


S3_KEYS = {"AWS_ACCESS_KEY_ID": "a", "AWS_SECRET_ACCESS_KEY": "b", "S3_ENDPOINT_URL": "http://s3:8333"}


@pytest.mark.parametrize(
    ("missing", "secret"),
    [("OPENAI_API_KEY", "rloo-judge"), ("AWS_SECRET_ACCESS_KEY", "rloo-s3"), ("S3_ENDPOINT_URL", "rloo-s3")],
)
def test_a_missing_secret_fails_the_validate_step_in_one_line(
    tmp_path: Path, missing: str, secret: str
) -> None:
    """On a cluster pod, a Secret key a later step needs and that did not reach the validate step fails it
    with exit 2 and one line naming the Secret, its parameter and the key; nothing else is checked first."""
    from tests.stages.test_validate import good

    env = _pod_env(**{**S3_KEYS, "OPENAI_API_KEY": "k"})
    del env[missing]
    code, err = _validate_as_launched(tmp_path, good(), env)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert f"Secret {secret!r}" in lines[0] and missing in lines[0] and "kubectl create secret" in lines[0]
    assert not (tmp_path / "plan").exists()  # nothing half-written


def test_with_every_secret_the_validate_step_writes_its_outputs(tmp_path: Path, tiny_setup: Any) -> None:
    """The same step, every Secret there and the judge up (the step asks it: tests/stages/test_validate_judge.py):
    it goes on to the plan and writes each output file the launcher reads back, the evaluation's GPU count among
    them (none on a CPU cluster)."""
    from rloo.demo.judge import MODEL, ToyJudge
    from tests.stages.test_validate import good

    env = _pod_env(**S3_KEYS, OPENAI_API_KEY="")  # a key may be empty (a judge without a login): it exists
    with ToyJudge() as judge:
        params = good(
            model=str(tiny_setup.policy), gpu_count=0, judge_base_url=judge.base_url, judge_model=MODEL
        )
        code, err = _validate_as_launched(tmp_path, params, env)
    assert code == 0, err
    out = json.loads((tmp_path / "executor_output.json").read_text())
    assert out["parameterValues"]["eval_gpu_limit"] == "0"
    assert out["parameterValues"]["gpu_limit"] == "0"
    assert json.loads(out["parameterValues"]["plan"])["cluster"]["gpu_count"] == 0


def test_a_local_run_checks_no_secrets(tmp_path: Path) -> None:
    """kfp.local (and the CLI) mount no Secrets and set no ``KFP_POD_NAME``: nothing to check there."""
    from rloo.stages.validate import check_secrets
    from tests.stages.test_validate import good

    check_secrets(good(), {})
    with pytest.raises(Exception, match="rloo-judge"):
        check_secrets(good(), _pod_env(**S3_KEYS))


# --- What the driver puts in the GPU pods --------------------------------------------------------------------


def test_gpu_pods_tolerate_the_pools_taints(compiled: tuple[dict[str, Any], dict[str, Any]]) -> None:
    """KFP 2.17's driver (``backend/src/v2/driver/k8s.go``) appends a ``tolerationJson`` bound to a LIST
    parameter as that many tolerations: the GPU steps tolerate the pipeline's ``gpu_tolerations`` (an AKS pool
    tainted ``sku=gpu``, a ``dedicated=ml`` pool) besides ``nvidia.com/gpu``; the CPU steps none."""
    spec, execs = compiled
    root = spec["root"]["inputDefinitions"]["parameters"]
    assert root["gpu_tolerations"]["parameterType"] == "LIST"
    for name in ("exec-train-rloo", "exec-evaluate"):
        tolerations = execs[name]["tolerations"]
        bound = [t["tolerationJson"]["componentInputParameter"] for t in tolerations if "tolerationJson" in t]
        assert bound == ["pipelinechannel--gpu_tolerations"], name
    for name, executor in execs.items():
        if name not in ("exec-train-rloo", "exec-evaluate"):
            assert "tolerations" not in executor, name


def test_evaluate_follows_gpu_count(compiled: tuple[dict[str, Any], dict[str, Any]]) -> None:
    """The evaluation pod's GPU limit is the validate step's text output ``eval_gpu_limit`` ('1', or '0' when
    ``gpu_count`` is 0, a CPU cluster), not a constant 1 that leaves it Pending there forever: the driver
    (``backend/src/v2/driver/driver.go``) sets the limit from ``resourceCount`` read as a string."""
    from rloo.stages.plan import ClusterConfig
    from rloo.stages.validate import eval_gpu_limit

    spec, _ = compiled
    acc = spec["deploymentSpec"]["executors"]["exec-evaluate"]["container"]["resources"]["accelerator"]
    assert (
        acc["resourceCount"] == "{{$.inputs.parameters['pipelinechannel--validate-params-eval_gpu_limit']}}"
    )
    assert "count" not in acc
    assert eval_gpu_limit(ClusterConfig(gpu_count=0)) == "0"
    assert eval_gpu_limit(ClusterConfig(gpu_count=8)) == "1"


def test_the_validate_step_is_never_cached(compiled: tuple[dict[str, Any], dict[str, Any]]) -> None:
    """KFP's backend reuses a cached execution when ``cachingOptions.enableCache`` is true and the inputs
    match (``backend/src/v2/driver/cache.go``): a resubmission would skip the bucket, model, data and Secret
    checks. The compiled task says ``cachingOptions: {}`` (enableCache false)."""
    spec, _ = compiled
    task = _tasks(spec)["validate-params"]
    assert not task.get("cachingOptions", {}).get("enableCache", False)


# --- The GPU pods' QoS class --------------------------------------------------------------------------------

# KFP's launcher init container in every step's pod (backend/src/v2/compiler/argocompiler/argo.go,
# launcherResources): requests 0.1 CPU, limits 0.5 CPU and 256Mi.
KFP_LAUNCHER_INIT = {"requests": {"cpu": "100m"}, "limits": {"cpu": "500m", "memory": "256Mi"}}


def qos_class(containers: list[dict[str, Any]]) -> str:
    """A pod's QoS class from its containers' resources (init containers included), as Kubernetes computes it
    (``pkg/apis/core/helper/qos/qos.go``, ``GetPodQOS``): Guaranteed only when every container sets CPU and
    memory limits equal to its requests."""
    requests_any = limits_any = False
    guaranteed = True
    for c in containers:
        req, lim = c.get("requests", {}), c.get("limits", {})
        requests_any |= bool(req)
        limits_any |= bool(lim)
        for resource in ("cpu", "memory"):
            if resource not in lim or req.get(resource, lim[resource]) != lim[resource]:
                guaranteed = False
    if not requests_any and not limits_any:
        return "BestEffort"
    return "Guaranteed" if guaranteed else "Burstable"


def test_gpu_pods_are_burstable_and_the_source_says_so(
    compiled: tuple[dict[str, Any], dict[str, Any]],
) -> None:
    """The GPU steps' container asks requests == limits, but the launcher init container KFP adds does not,
    so the pod is Burstable; no comment may promise Guaranteed QoS."""
    main = {"requests": {"cpu": "16", "memory": "128Gi"}, "limits": {"cpu": "16", "memory": "128Gi"}}
    assert qos_class([main]) == "Guaranteed"
    assert qos_class([KFP_LAUNCHER_INIT, main]) == "Burstable"
    source = (Path(__file__).resolve().parents[2] / "pipelines" / "rloo_pipeline.py").read_text()
    assert "Guaranteed QoS" not in source and "Burstable" in source


@pytest.mark.parametrize(
    ("tolerations", "message"),
    [
        ({"key": "sku"}, "must be a list"),
        (["sku=gpu"], "must be a mapping"),
        ([{"key": "sku", "operator": "In"}], "operator must be Equal or Exists"),
        ([{"key": "sku", "operator": "Exists", "value": "gpu"}], "empty with operator Exists"),
        (
            [{"operator": "Equal", "value": "gpu"}],
            "empty key tolerates every taint only with operator Exists",
        ),
        ([{"key": "sku", "value": "gpu", "effect": "NoRun"}], "effect must be one of"),
        (
            [{"key": "sku", "effect": "NoSchedule", "tolerationSeconds": 60}],
            "applies only to effect NoExecute",
        ),
        ([{"key": "bad key!"}], "not a label key"),
        ([{"key": "sku", "valu": "gpu"}], "unknown field 'valu'"),
    ],
)
def test_bad_tolerations_are_refused_before_any_pod(tolerations: Any, message: str) -> None:
    """The API server's rules for a toleration (``kubernetes pkg/apis/core/validation/validation.go``,
    ``ValidateTolerations``; an unknown field is dropped silently by the driver's ``json.Unmarshal``), checked
    by the validate step: otherwise the GPU pod is refused at creation, after the steps before it ran."""
    from rloo.errors import UserError
    from rloo.stages.plan import ClusterConfig

    with pytest.raises(UserError, match=message):
        ClusterConfig(gpu_tolerations=tolerations)
    ClusterConfig(
        gpu_tolerations=[{"key": "sku", "operator": "Equal", "value": "gpu", "effect": "NoSchedule"}]
    )
    ClusterConfig(gpu_tolerations=[{"operator": "Exists"}])  # tolerates every taint
    ClusterConfig(gpu_tolerations=[{"key": "x", "effect": "NoExecute", "tolerationSeconds": 300}])


def test_a_workload_identity_needs_no_s3_keys() -> None:
    """The platform says the pods' service account carries a cloud identity (IRSA): the steps mount the S3
    keys optionally (``rloo.pipeline.platform_overlay.apply``), so the validate step does not ask for them; the judge's
    key is still needed."""
    from rloo.errors import UserError
    from rloo.k8s.platform import PLATFORM_ENV
    from rloo.stages.validate import check_secrets
    from tests.stages.test_validate import good

    irsa = {PLATFORM_ENV: json.dumps({"s3WorkloadIdentity": True})}
    check_secrets(good(), _pod_env(OPENAI_API_KEY="k", **irsa))
    with pytest.raises(UserError, match="rloo-s3"):
        check_secrets(good(), _pod_env(OPENAI_API_KEY="k"))
    with pytest.raises(UserError, match="rloo-judge"):
        check_secrets(good(), _pod_env(**irsa))


def test_the_fetch_step_exits_75_when_the_store_is_out_of_reach(tmp_path: Path, monkeypatch: Any) -> None:
    """Argo retries the fetch step by its exit status only through KFP's retry policy, and this project's
    steps stop every later attempt after exit 2 (``rloo.stages.retry``): a store out of reach must exit 75, a
    retry may heal it. The real ``fetch_sft`` component through ``kfp.dsl.executor.Executor`` (what
    ``kfp.dsl.executor_main`` runs, ``backend/src/v2/component/launcher_v2.go`` handing it its inputs)."""
    from kfp.dsl.executor import Executor

    from rloo.pipeline.compile import load_pipeline
    from rloo.stages.validate import build_plan
    from tests.stages.test_validate import good

    load_pipeline()
    from components.fetch_sft.component import fetch_sft

    plan = build_plan(good(model="s3://models/sft", output_uri="s3://runs/rloo"), check_paths=False)
    for key, value in {**S3_KEYS, "S3_ENDPOINT_URL": "http://127.0.0.1:9", "AWS_MAX_ATTEMPTS": "1"}.items():
        monkeypatch.setenv(key, value)
    artifact = {"type": {"schemaTitle": "system.Model"}, "metadata": {}}
    executor_input = {
        "inputs": {"parameterValues": {"plan": plan.to_json(), "kfp_run_id": "r-1"}},
        "outputs": {
            "artifacts": {
                name: {"artifacts": [{**artifact, "name": name, "uri": str(tmp_path / name)}]}
                for name in ("sft_model", "summary")
            },
            "outputFile": str(tmp_path / "executor_output.json"),
        },
    }
    err = io.StringIO()
    with redirect_stderr(err), pytest.raises(SystemExit) as exit_:
        Executor(executor_input=executor_input, function_to_execute=fetch_sft.python_func).execute()
    assert exit_.value.code == 75, err.getvalue()
    assert err.getvalue().startswith("fetching the SFT model failed: ")
