"""The pipeline in its real images (``make test-images``): built from images/ with podman, pushed to a real
registry, then every step of ``rloo pipeline run --local --containers`` run in its image, named by the digest
the registry gave, through kfp.local's DockerRunner.

Opt-in (``RLOO_TEST_IMAGES=1``, which ``make test-images`` sets): the builds take minutes and need podman and
Debian's ``docker-registry`` (the CNCF distribution registry). No public registry is reachable here, so the
base is a Debian stand-in (``images/build.py --ci-base``) and the CUDA ``train`` and vLLM ``eval`` images are
not built: the CPU flavour ``train-cpu`` runs the train and evaluate steps, ``slim`` the others, each exactly
as its Dockerfile says. The build is the release workflow's (``.github/workflows/release.yml``): push, record
by digest, SBOM.
"""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from rloo import __version__
from rloo.k8s.images import is_pinned
from tests.fixtures.servers import free_port

pytestmark = pytest.mark.skipif(
    os.environ.get("RLOO_TEST_IMAGES") != "1", reason="container builds: 'make test-images' runs these"
)

ROOT = Path(__file__).resolve().parents[2]
TAG = "ci"
CI_BASE = "localhost/rloo-ci-base:bookworm"
NAMES = ("slim", "train-cpu")


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "CONTAINERS_CONF": str(ROOT / "images" / "ci" / "containers.conf"), **extra}


@dataclass
class Registry:
    host: str  # 127.0.0.1:PORT
    conf: Path  # registries.conf naming it insecure (plain HTTP), for podman's pushes and pulls

    def env(self, **extra: str) -> dict[str, str]:
        return _env(CONTAINERS_REGISTRIES_CONF=str(self.conf), RLOO_IMAGE_TAG=TAG, **extra)

    def has_manifest(self, pinned: str) -> bool:
        repo, digest = pinned.removeprefix(f"{self.host}/").split("@")
        request = urllib.request.Request(f"http://{self.host}/v2/{repo}/manifests/{digest}", method="HEAD")
        accept = (
            "application/vnd.oci.image.manifest.v1+json, application/vnd.docker.distribution.manifest.v2+json"
        )
        request.add_header("Accept", accept)
        with urllib.request.urlopen(request, timeout=10) as response:
            return bool(response.status == 200)


@dataclass
class Built:
    record: dict[str, str]  # what images/build.py recorded: name -> reference by digest
    record_path: Path
    sbom_dir: Path
    seconds: dict[str, float]


def _podman(registry: Registry, *args: str) -> str:
    proc = subprocess.run(["podman", *args], env=registry.env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.fixture(scope="session")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    """A real registry (the distribution registry Debian packages as docker-registry), on 127.0.0.1."""
    work = tmp_path_factory.mktemp("registry")
    host = f"127.0.0.1:{free_port()}"
    config = work / "config.yml"
    config.write_text(
        f"version: 0.1\nstorage:\n  filesystem:\n    rootdirectory: {work / 'data'}\nhttp:\n  addr: {host}\n"
    )
    conf = work / "registries.conf"
    conf.write_text(f'[[registry]]\nlocation = "{host}"\ninsecure = true\n')
    log = (work / "registry.log").open("wb")
    proc = subprocess.Popen(["docker-registry", "serve", str(config)], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"http://{host}/v2/", timeout=2)
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, (
                    work / "registry.log"
                ).read_text()
                time.sleep(0.2)
        yield Registry(host, conf)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


@pytest.fixture(scope="session")
def built(registry: Registry, tmp_path_factory: pytest.TempPathFactory) -> Built:
    """slim and train-cpu built on the stand-in base with this machine's pip setup, pushed, recorded and
    given their SBOMs, as the release workflow does it; seconds per build and push."""
    out = tmp_path_factory.mktemp("built")
    record_path, sbom_dir = out / "images.json", out / "sbom"
    build = [sys.executable, str(ROOT / "images" / "build.py"), "--builder", "podman"]
    subprocess.run([*build, "--ci-base"], env=_env(), check=True, timeout=900)
    seconds = {}
    for name in NAMES:
        env = registry.env(
            RLOO_IMAGE_REGISTRY=f"{registry.host}/rloo-test",
            **{f"BASE_IMAGE_{name.upper().replace('-', '_')}": CI_BASE},
        )
        flags = ["--host-pip", "--push", "--record", str(record_path), "--sbom", str(sbom_dir)]
        start = time.monotonic()
        subprocess.run([*build, *flags, name], env=env, check=True, timeout=1800)
        seconds[name] = time.monotonic() - start
    record = json.loads(record_path.read_text())
    # in the test log: the numbers benchmarks/RESULTS.md keeps (by tag: podman's own digest of an image it
    # built is not the one the registry gave it, which it learns when it pulls)
    tags = {"slim": f"rloo-slim:{TAG}", "train-cpu": f"rloo-train:{TAG}-cpu"}
    for name, tag in tags.items():
        ref = f"{registry.host}/rloo-test/{tag}"
        size = int(_podman(registry, "image", "inspect", "--format", "{{.Size}}", ref))
        print(f"image {ref} ({record[name]}): {size / 1e9:.2f} GB", file=sys.stderr)
    print(
        f"build+push+SBOM seconds: {json.dumps({k: round(v) for k, v in seconds.items()})}", file=sys.stderr
    )
    return Built(record, record_path, sbom_dir, seconds)


@pytest.fixture(scope="session")
def docker_host(registry: Registry, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """podman's Docker API on a socket of its own: what kfp.local's DockerRunner (docker-py) talks to."""
    sock = tmp_path_factory.mktemp("podman") / "podman.sock"
    proc = subprocess.Popen(
        ["podman", "system", "service", "--time=0", f"unix://{sock}"],
        env=registry.env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while not sock.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "podman's API socket never appeared"
            time.sleep(0.2)
        yield f"unix://{sock}"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_the_record_names_each_image_by_the_digest_the_registry_serves(
    built: Built, registry: Registry
) -> None:
    assert set(built.record) == set(NAMES)
    for ref in built.record.values():
        assert is_pinned(ref) and ref.startswith(f"{registry.host}/rloo-test/rloo-"), ref
        assert registry.has_manifest(ref), ref


@pytest.mark.parametrize("name", NAMES)
def test_images_run_as_non_root_on_a_read_only_root(built: Built, registry: Registry, name: str) -> None:
    ref = built.record[name]
    out = _podman(
        registry, "run", "--rm", "--read-only", "--tmpfs", "/tmp", ref, "sh", "-c", "id -u; rloo --version"
    )
    assert out.split() == ["1000", "rloo", __version__], out


@pytest.mark.parametrize("name", NAMES)
def test_the_sbom_lists_exactly_what_the_image_has_installed(
    built: Built, registry: Registry, name: str
) -> None:
    document = json.loads((built.sbom_dir / f"{name}.cdx.json").read_text())
    assert document["bomFormat"] == "CycloneDX"
    assert {"name": "rloo:image", "value": built.record[name]} in document["metadata"]["properties"]

    def key(dist_name: str, version: str) -> tuple[str, str]:
        return dist_name.lower().replace("_", "-"), version

    listed = json.loads(
        _podman(
            registry, "run", "--rm", built.record[name], "python3", "-m", "pip", "list", "--format", "json"
        )
    )
    installed = {key(d["name"], d["version"]) for d in listed}
    components = {key(c["name"], c["version"]) for c in document["components"]}
    assert components == installed
    assert ("rloo-kfp", __version__) in components and any(n == "torch" for n, _ in components)
    assert not any(n.startswith("cyclonedx") for n, _ in components)  # the generator is not in the image


def test_the_pipeline_runs_every_step_in_its_image_pinned_by_digest(
    built: Built, registry: Registry, docker_host: str, tmp_path: Path
) -> None:
    work = tmp_path / "work"
    cmd = [
        sys.executable,
        "-m",
        "rloo.cli",
        "pipeline",
        "run",
        "--local",
        "--containers",
        "--workdir",
        str(work),
    ]
    cmd += ["--images", str(built.record_path), "--updates", "2"]
    env = registry.env(DOCKER_HOST=docker_host, HF_HUB_OFFLINE="1")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    assert "succeeded" in proc.stdout and "push decision:" in proc.stdout
    assert f"slim image: {built.record['slim']}" in proc.stderr

    # every step ran in its image by digest: kfp.local's log of each step names it (found, or pulled from the
    # registry: podman's own digest of a built image is not the one the registry gave it)
    logs = {p.stem: p.read_text() for p in (work / "logs").rglob("*.log") if p.stem != "pipeline"}
    slim, train_cpu = built.record["slim"], built.record["train-cpu"]
    expected = {
        "validate-params": slim,
        "fetch-sft": slim,
        "train-rloo": train_cpu,
        "evaluate": train_cpu,
        "push-model": slim,
        "finish-run": slim,
    }
    for step, ref in expected.items():
        assert f"image '{ref}'" in logs[step], (step, logs[step][-2000:])

    # what the steps wrote, they wrote as the images' user; the trained model is verified against its manifest
    from rloo.storage.manifest import verify_local
    from rloo.storage.transfer import read_manifest

    (model,) = [p.parent for p in (work / "store").glob("*/model/_MANIFEST.json")]
    assert model.stat().st_uid == 1000
    verify_local(model, read_manifest(str(model)), str(model))

    # MLflow: the parent run and one run per stage, all finished
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{work / 'mlruns' / 'mlflow.db'}")
    (experiment,) = [e for e in client.search_experiments() if e.name != "Default"]
    runs = client.search_runs([experiment.experiment_id])
    assert {r.data.tags.get("rloo.stage") for r in runs} >= {"train", "eval", "push"}
    assert all(r.info.status == "FINISHED" for r in runs), [(r.info.run_name, r.info.status) for r in runs]


def test_the_charts_upload_job_runs_in_the_slim_image(
    built: Built, registry: Registry, tmp_path: Path
) -> None:
    """The chart's upload hook as Kubernetes would run it: the Job rendered by real Helm with the images from
    the record, its container run in the slim image by digest (uid 1000, read-only root, the ConfigMap
    mounted where the Job mounts it, the Job's env), against a stand-in of the KFP API and of an Istio sidecar.
    KFP gets the pipeline with every step in the recorded images and the platform's pull secret, and the
    sidecar is told to exit."""
    import yaml

    from rloo.k8s import platform
    from tests.fixtures.kfp_api import kfp_api
    from tests.helm.helpers import documents, find, render

    slim_repo, slim_digest = built.record["slim"].split("@")
    cpu_repo, cpu_digest = built.record["train-cpu"].split("@")
    quits: list[str] = []

    class Sidecar(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            quits.append(self.path)
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    sidecar = http.server.ThreadingHTTPServer(("127.0.0.1", 15020), Sidecar)
    threading.Thread(target=sidecar.serve_forever, daemon=True).start()
    try:
        with kfp_api() as api:
            values = {
                "images": {
                    "slim": {"repository": slim_repo, "digest": slim_digest},
                    "train": {"repository": cpu_repo, "digest": cpu_digest},
                    "eval": {"repository": cpu_repo, "digest": cpu_digest},
                },
                "imagePullSecrets": ["corp-registry"],
                "extraEnv": {"NO_PROXY": "127.0.0.1,localhost", "HF_ENDPOINT": "https://hf.corp.example"},
                "upload": {
                    "kfpHost": api.url,
                    "namespace": "team-a",
                    "istioSidecar": True,
                    "kfpToken": {"enabled": False},
                },
            }
            docs = documents(render(values))
            job = find(docs, "Job", "-upload")
            (c,) = job["spec"]["template"]["spec"]["containers"]
            # the chart keeps the tag beside the digest (repo:tag@digest); the runtime pulls by the digest
            assert c["image"] == f"{slim_repo}:{__version__}@{slim_digest}"
            chart_images = json.loads(find(docs, "ConfigMap", "-pipeline")["data"]["platform.json"])["images"]
            mount = next(m["mountPath"] for m in c["volumeMounts"] if m["name"] == "pipeline")
            config = tmp_path / "pipeline"
            config.mkdir()
            for key, text in find(docs, "ConfigMap", "-pipeline")["data"].items():
                (config / key).write_text(text)
                (config / key).chmod(0o644)  # a ConfigMap volume's mode; the pod's uid is 1000
            config.chmod(0o755)
            env = [f"{e['name']}={e['value']}" for e in c["env"] if "value" in e]
            run = ["run", "--rm", "--network", "host", "--read-only", "--user", "1000:1000"]
            run += ["--tmpfs", "/tmp", "--tmpfs", "/home/rloo", "-v", f"{config}:{mount}:ro"]
            run += [arg for e in env for arg in ("-e", e)]
            out = _podman(registry, *run, c["image"], *c["command"], *c["args"])
            assert "created pipeline rloo-rlhf" in out, out
            (stored,) = api.packages()
            assert [p.namespace for p in api.pipelines] == ["team-a"]
    finally:
        sidecar.shutdown()
        sidecar.server_close()
    assert quits == ["/quitquitquit"]
    spec, k8s = (d for d in yaml.safe_load_all(stored) if d)
    images = {e["container"]["image"] for e in spec["deploymentSpec"]["executors"].values()}
    assert images == set(chart_images.values()) == {c["image"], f"{cpu_repo}:{__version__}@{cpu_digest}"}
    for config_of in k8s["platforms"]["kubernetes"]["deploymentSpec"]["executors"].values():
        assert [p["secretName"] for p in config_of["imagePullSecret"]] == ["corp-registry"]
    launcher = spec["deploymentSpec"]["executors"]["exec-train-rloo-multinode"]["container"]
    pod = json.loads(next(e["value"] for e in launcher["env"] if e["name"] == platform.PLATFORM_ENV))
    assert (
        pod["imagePullSecrets"] == ["corp-registry"]
        and pod["env"]["HF_ENDPOINT"] == "https://hf.corp.example"
    )
