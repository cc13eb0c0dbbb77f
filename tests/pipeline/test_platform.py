"""The platform's settings (images, pull secrets, environment, CA bundle, Kueue's queue, an S3 workload identity)
applied to the compiled pipeline: as kfp.kubernetes writes them, readable by the backend's protobuf schema,
handed on to the multi-node launcher for its job's pods, and no change at all when there is nothing to apply.
What the job's pods make of them: tests/k8s/test_platform.py."""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any, ClassVar

import pytest
import yaml
from google.protobuf import json_format
from kfp import dsl, kubernetes
from kfp.kubernetes import kubernetes_executor_config_pb2
from kfp.pipeline_spec import pipeline_spec_pb2

from rloo.errors import UserError
from rloo.k8s import platform as k8s_platform
from rloo.k8s.builders import build_trainjob
from rloo.k8s.platform import CA_DIR, CA_ENV, PLATFORM_ENV, Platform
from rloo.pipeline import platform_overlay
from rloo.pipeline.compile import default_yaml
from rloo.pipeline.images import IMAGE_EXTRAS
from rloo.pipeline.platform_overlay import EXECUTOR_IMAGES
from rloo.stages.constants import S3_SECRET_KEYS
from tests.k8s.test_builders import _trainjob_pod
from tests.k8s.test_platform import SETTINGS, check_pod, job_spec

REPO = Path(__file__).resolve().parents[2]


def _docs(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(text) if d]


@pytest.fixture(scope="module")
def committed() -> str:
    return default_yaml().read_text()


@pytest.fixture(scope="module")
def applied(committed: str) -> list[dict[str, Any]]:
    return _docs(platform_overlay.apply(committed, platform_overlay.parse(SETTINGS, "test")))


def test_executor_table_is_the_compiled_pipeline(tmp_path: Path) -> None:
    # compile with a distinct image per kind: each executor's image says which kind its component uses
    env = {
        **os.environ,
        **{f"RLOO_IMAGE_{k.upper()}": f"reg.test/kind-{k}:1" for k in ("slim", "train", "eval")},
    }
    out = tmp_path / "p.yaml"
    subprocess.run(
        [sys.executable, "-m", "rloo.cli", "pipeline", "compile", "--output", str(out)],
        check=True,
        env=env,
        cwd=REPO,
        capture_output=True,
    )
    executors = _docs(out.read_text())[0]["deploymentSpec"]["executors"]
    kinds = {name: e["container"]["image"].split("kind-")[1].split(":")[0] for name, e in executors.items()}
    assert kinds == EXECUTOR_IMAGES


def test_every_step_and_the_training_job_get_the_platform_images(applied: list[dict[str, Any]]) -> None:
    spec = applied[0]
    for name, executor in spec["deploymentSpec"]["executors"].items():
        assert executor["container"]["image"] == SETTINGS["images"][EXECUTOR_IMAGES[name]], name
    found = list(platform_overlay._task_inputs(spec, "train_image"))
    assert found and all(v == {"runtimeValue": {"constant": SETTINGS["images"]["train"]}} for v in found)
    assert "ghcr.io/rloo-kfp" not in yaml.safe_dump_all(applied)


def test_environment_and_ca_on_every_step(applied: list[dict[str, Any]]) -> None:
    bundle = f"{CA_DIR}/bundle.pem"
    for name, executor in applied[0]["deploymentSpec"]["executors"].items():
        env = {e["name"]: e["value"] for e in executor["container"]["env"]}
        assert {k: env[k] for k in SETTINGS["env"]} == SETTINGS["env"], name
        assert {k: env[k] for k in CA_ENV} == dict.fromkeys(CA_ENV, bundle)
        pod = json.loads(env[PLATFORM_ENV])
        assert pod == {k: SETTINGS[k] for k in ("imagePullSecrets", "env", "caBundle")}


def test_kubernetes_settings_are_what_kfp_kubernetes_writes(
    committed: str, applied: list[dict[str, Any]]
) -> None:
    tasks = []

    @dsl.pipeline(name="p")
    def reference():  # type: ignore[no-untyped-def]
        task = _noop()
        kubernetes.set_image_pull_secrets(task, SETTINGS["imagePullSecrets"])
        kubernetes.use_config_map_as_volume(task, config_map_name="corp-ca", mount_path=CA_DIR)
        tasks.append(task)

    expected = tasks[0].platform_config["kubernetes"]
    before = _docs(committed)[1]["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    after = applied[1]["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    assert after.keys() == EXECUTOR_IMAGES.keys()
    for name, config in after.items():
        assert config["imagePullSecret"] == expected["imagePullSecret"]
        assert config["configMapAsVolume"] == expected["configMapAsVolume"]
        rest = {k: v for k, v in config.items() if k not in ("imagePullSecret", "configMapAsVolume")}
        assert rest == before.get(name, {}), name  # secrets as env, timeouts, tolerations: untouched


@dsl.component(base_image="python:3.11")
def _noop():  # type: ignore[no-untyped-def]
    pass


def test_the_backend_reads_it(applied: list[dict[str, Any]]) -> None:
    # the KFP backend unmarshals both documents with protojson: unknown fields or wrong types fail here too
    json_format.ParseDict(applied[0], pipeline_spec_pb2.PipelineSpec())
    for config in applied[1]["platforms"]["kubernetes"]["deploymentSpec"]["executors"].values():
        json_format.ParseDict(config, kubernetes_executor_config_pb2.KubernetesExecutorConfig())


def test_nothing_to_apply_changes_nothing_and_applying_twice_is_once(committed: str) -> None:
    assert platform_overlay.apply(committed, Platform()) == committed
    same = {"images": {k: e for k, e in (("slim", "ghcr.io/rloo-kfp/rloo-slim:0.2.0"),)}}
    assert (
        platform_overlay.apply(committed, platform_overlay.parse(same, "t")) == committed
    )  # the images it already names
    settings = platform_overlay.parse(SETTINGS, "test")
    once = platform_overlay.apply(committed, settings)
    assert platform_overlay.apply(once, settings) == once


@pytest.fixture
def job_env(applied: list[dict[str, Any]]) -> dict[str, str]:
    """The launcher step's environment as the applied package gives it."""
    launcher = applied[0]["deploymentSpec"]["executors"]["exec-train-rloo-multinode"]["container"]
    return {e["name"]: e["value"] for e in launcher["env"]}


def test_the_launcher_gets_what_its_jobs_pods_need(job_env: dict[str, str]) -> None:
    """RLOO_PLATFORM: the pull secrets, environment and CA bundle of platform.json, not its images (the
    launcher's image input names the job's)."""
    pod_platform = k8s_platform.from_env(job_env)
    assert pod_platform == replace(platform_overlay.parse(SETTINGS, "t"), images={})
    trainjob = build_trainjob(job_spec(pod_platform))
    check_pod(_trainjob_pod(trainjob))
    assert k8s_platform.from_env({k: v for k, v in job_env.items() if k != PLATFORM_ENV}) == Platform()


def test_platform_json_names_the_pipelines_images(tmp_path: Path) -> None:
    """rloo.pipeline.platform_overlay reads platform.json with this pipeline's image kinds."""
    assert set(platform_overlay.parse(SETTINGS, "t").images) == set(IMAGE_EXTRAS)
    path = tmp_path / "platform.json"
    path.write_text(json.dumps(SETTINGS))
    assert platform_overlay.read(path) == platform_overlay.parse(SETTINGS, "t")
    with pytest.raises(
        UserError, match=r"^t: images: unknown image 'trainer'; the images are train, eval, slim\.$"
    ):
        platform_overlay.parse({"images": {"trainer": "a/b:1"}}, "t")


def test_a_package_from_another_version_is_refused(committed: str) -> None:
    docs = _docs(committed)
    docs[0]["deploymentSpec"]["executors"]["exec-new-step"] = {"container": {"image": "x"}}
    with pytest.raises(UserError, match="exec-new-step"):
        platform_overlay.apply(yaml.safe_dump_all(docs), platform_overlay.parse(SETTINGS, "t"))


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rloo.cli", "pipeline", *args], capture_output=True, text=True, cwd=REPO
    )


def test_compile_with_a_platform_file(tmp_path: Path) -> None:
    settings = tmp_path / "platform.json"
    settings.write_text(json.dumps(SETTINGS))
    out = tmp_path / "p.yaml"
    done = _cli("compile", "--platform", str(settings), "--output", str(out))
    assert done.returncode == 0, done.stderr
    assert "train image (--platform): " + SETTINGS["images"]["train"] in done.stderr
    assert _docs(out.read_text()) == _docs(
        platform_overlay.apply(default_yaml().read_text(), platform_overlay.read(settings))
    )
    refused = _cli("compile", "--platform", str(settings))
    assert refused.returncode == 2 and "give --output PATH" in refused.stderr
    missing = _cli("compile", "--platform", str(tmp_path / "nope.json"), "--output", str(out))
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1 and "no such file" in missing.stderr


class _Sidecar(http.server.BaseHTTPRequestHandler):
    posts: ClassVar[list[str]] = []

    def do_POST(self) -> None:
        _Sidecar.posts.append(self.path)
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def sidecar() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Sidecar)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _Sidecar.posts.clear()
    yield f"http://127.0.0.1:{server.server_address[1]}/quitquitquit"
    server.shutdown()


def test_the_sidecar_is_stopped_even_when_the_upload_fails(
    sidecar: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from rloo.cli import pipeline_cmd
    from rloo.pipeline import submit

    monkeypatch.setattr(submit, "ISTIO_QUIT_URL", sidecar)
    # a corporate proxy whose NO_PROXY forgot 127.0.0.1: the call to the sidecar must not go through it
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")
    monkeypatch.setenv("NO_PROXY", "localhost")
    monkeypatch.setattr(submit.stop_istio_sidecar, "__defaults__", (sidecar,))
    package = tmp_path / "p.yaml"
    package.write_text(default_yaml().read_text())
    # nothing listens on port 9: the upload fails, the sidecar is still asked to exit
    code = pipeline_cmd.main(
        ["upload", "--host", "http://127.0.0.1:9", "--package", str(package), "--stop-istio-sidecar"]
    )
    assert code != 0 and _Sidecar.posts == ["/quitquitquit"]
    assert "asked the Istio sidecar to exit" in capsys.readouterr().err
    assert "nothing to stop" in submit.stop_istio_sidecar("http://127.0.0.1:9/quitquitquit")


def test_upload_applies_the_platform_through_the_real_kfp_client(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`rloo pipeline upload --platform --namespace` with kfp.Client against a stand-in of KFP's v2beta1 API:
    what KFP stores is the package with the platform applied, in the profile, once per distinct platform."""
    from rloo.cli import pipeline_cmd
    from tests.fixtures.kfp_api import kfp_api

    settings = tmp_path / "platform.json"
    settings.write_text(json.dumps(SETTINGS))
    package = tmp_path / "p.yaml"
    package.write_text(default_yaml().read_text())
    with kfp_api() as api:
        argv = ["upload", "--host", api.url, "--package", str(package), "--platform", str(settings)]
        argv += ["--namespace", "team-a"]
        assert pipeline_cmd.main(argv) == 0
        assert pipeline_cmd.main(argv) == 0  # a helm upgrade without changes
        (stored,) = api.packages()
        assert stored == platform_overlay.apply(package.read_text(), platform_overlay.read(settings))
        assert [(p.name, p.namespace) for p in api.pipelines] == [("rloo-rlhf", "team-a")]
        settings.write_text(json.dumps({**SETTINGS, "imagePullSecrets": ["other"]}))
        assert pipeline_cmd.main(argv) == 0
        assert len(api.packages()) == 2 and "other" in api.packages()[1]
    out = [line for line in capsys.readouterr().out.splitlines() if not line.startswith("Pipeline details")]
    assert out[0].startswith("created pipeline rloo-rlhf") and out[1].startswith("unchanged")
    assert out[2].startswith("added version rloo-rlhf / sha256-")


# Kueue's queue label on the GPU steps, S3 keys optional with a workload identity ---------------------------

KUEUE = {"kueue": {"queueName": "gpu-queue", "pytorchJobIntegration": True}}


def _k8s_executors(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return docs[1]["platforms"]["kubernetes"]["deploymentSpec"]["executors"]


def test_the_gpu_steps_get_kueues_queue_label_as_add_pod_label_writes_it(committed: str) -> None:
    """kfp.kubernetes ``add_pod_label`` (kubeflow/pipelines ``kubernetes_platform/python/kfp/kubernetes/
    pod_metadata.py``) writes ``podMetadata.labels``; KFP's Argo compiler (``backend/src/v2/compiler/argocompiler/
    container.go``, ``extendPodMetadata``) puts them on the step's pod, where Kueue's pod webhook
    (kubernetes-sigs/kueue ``pkg/controller/jobs/pod/pod_webhook.go``) reads ``kueue.x-k8s.io/queue-name``. Only
    the single-node train and evaluate pods: the launcher's job carries its own label, and a queued CPU step would
    wait for quota it does not need."""
    tasks = []

    @dsl.pipeline(name="p")
    def reference():  # type: ignore[no-untyped-def]
        task = _noop()
        kubernetes.add_pod_label(task, "kueue.x-k8s.io/queue-name", "gpu-queue")
        tasks.append(task)

    expected = tasks[0].platform_config["kubernetes"]["podMetadata"]
    applied = _docs(platform_overlay.apply(committed, platform_overlay.parse(KUEUE, "t")))
    before = _k8s_executors(_docs(committed))
    for name, config in _k8s_executors(applied).items():
        if name in platform_overlay.QUEUED_EXECUTORS:
            assert config["podMetadata"] == expected, name
        else:
            assert "podMetadata" not in config, name
        rest = {k: v for k, v in config.items() if k != "podMetadata"}
        assert rest == before.get(name, {}), name
        parsed = json_format.ParseDict(config, kubernetes_executor_config_pb2.KubernetesExecutorConfig())
        labels = dict(parsed.pod_metadata.labels)
        assert labels == (
            {"kueue.x-k8s.io/queue-name": "gpu-queue"} if name in platform_overlay.QUEUED_EXECUTORS else {}
        )
    assert (
        set(platform_overlay.QUEUED_EXECUTORS) == {"exec-train-rloo", "exec-evaluate"} <= set(EXECUTOR_IMAGES)
    )


def test_the_validate_step_reads_the_kueue_setting(committed: str) -> None:
    """RLOO_PLATFORM reaches every step, the validate step included, with only the Kueue setting set: that step
    reads ``from_env(os.environ).kueue.pytorchjob_integration`` to accept ``queue_name`` with a PyTorchJob."""
    applied = _docs(platform_overlay.apply(committed, platform_overlay.parse(KUEUE, "t")))
    for executor in applied[0]["deploymentSpec"]["executors"].values():
        env = {e["name"]: e["value"] for e in executor["container"].get("env") or []}
        settings = k8s_platform.from_env(env)
        assert settings.kueue.pytorchjob_integration and settings.kueue.queue_name == "gpu-queue"
    assert (
        platform_overlay.apply(committed, platform_overlay.parse({"kueue": {"queueName": ""}}, "t"))
        == committed
    )


def test_a_workload_identity_makes_every_steps_s3_keys_optional(committed: str) -> None:
    """KFP's driver (kubeflow/pipelines ``backend/src/v2/driver/k8s.go``) sets the pod's ``secretKeyRef.optional``
    from ``secretAsEnv.optional`` when the field is present: with ``optional: true`` a pod whose S3 Secret (or key)
    is missing starts and its S3 client uses the service account's identity (IRSA), instead of sitting in
    CreateContainerConfigError. Only the S3 Secret changes; the judge's stays required."""
    applied = _docs(
        platform_overlay.apply(committed, platform_overlay.parse({"s3WorkloadIdentity": True}, "t"))
    )
    before = _k8s_executors(_docs(committed))
    s3_keys = set(S3_SECRET_KEYS.values())
    changed = 0
    for name, config in _k8s_executors(applied).items():
        parsed = json_format.ParseDict(config, kubernetes_executor_config_pb2.KubernetesExecutorConfig())
        for entry, message, original in zip(
            config.get("secretAsEnv") or [],
            parsed.secret_as_env,
            before[name].get("secretAsEnv") or [],
            strict=True,
        ):
            names = {k["envVar"] for k in entry["keyToEnv"]}
            if names == s3_keys:
                assert message.HasField("optional") and message.optional, name
                changed += not original.get("optional")
            else:
                assert entry == original, (name, names)
        assert {k: v for k, v in config.items() if k != "secretAsEnv"} == {
            k: v for k, v in before[name].items() if k != "secretAsEnv"
        }, name
    # the steps that mount the S3 keys required: fetch, train (both), evaluate, push
    assert changed >= 5
    # the launcher finds the setting for its job's pods
    launcher = applied[0]["deploymentSpec"]["executors"]["exec-train-rloo-multinode"]["container"]
    assert k8s_platform.from_env({e["name"]: e["value"] for e in launcher["env"]}).s3_workload_identity
