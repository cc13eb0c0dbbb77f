"""The pipeline in its real images (``make test-images``): built from images/ with podman, then every step of
``rloo pipeline run --local --containers`` run in its image through kfp.local's DockerRunner.

Opt-in (``RLOO_TEST_IMAGES=1``, which ``make test-images`` sets): the builds take minutes and need podman.
No container registry is reachable here, so the base is a Debian stand-in (``images/build.py --ci-base``) and
the CUDA ``train`` and vLLM ``eval`` images are not built: the CPU flavour ``train-cpu`` runs the train and
evaluate steps, ``slim`` the others, each exactly as its Dockerfile says.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(
    os.environ.get("RLOO_TEST_IMAGES") != "1", reason="container builds: 'make test-images' runs these"
)

ROOT = Path(__file__).resolve().parents[2]
REGISTRY, TAG = "localhost/rloo-test", "ci"
SLIM, TRAIN_CPU = f"{REGISTRY}/rloo-slim:{TAG}", f"{REGISTRY}/rloo-train:{TAG}-cpu"
CI_BASE = "localhost/rloo-ci-base:bookworm"


def _env(**extra: str) -> dict[str, str]:
    return {
        **os.environ,
        "RLOO_IMAGE_REGISTRY": REGISTRY,
        "RLOO_IMAGE_TAG": TAG,
        "CONTAINERS_CONF": str(ROOT / "images" / "ci" / "containers.conf"),
        **extra,
    }


def _podman(*args: str) -> str:
    proc = subprocess.run(["podman", *args], env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.fixture(scope="session")
def images() -> dict[str, float]:
    """slim and train-cpu built on the stand-in base with this machine's pip setup; seconds per build."""
    build = [sys.executable, str(ROOT / "images" / "build.py"), "--builder", "podman"]
    subprocess.run([*build, "--ci-base"], env=_env(), check=True, timeout=900)
    seconds = {}
    for name in ("slim", "train-cpu"):
        base = f"BASE_IMAGE_{name.upper().replace('-', '_')}"
        start = time.monotonic()
        subprocess.run([*build, "--host-pip", name], env=_env(**{base: CI_BASE}), check=True, timeout=1800)
        seconds[name] = time.monotonic() - start
    sizes = {ref: int(_podman("image", "inspect", "--format", "{{.Size}}", ref)) for ref in (SLIM, TRAIN_CPU)}
    for ref, size in sizes.items():  # in the test log: the numbers benchmarks/RESULTS.md keeps
        print(f"image {ref}: {size / 1e9:.2f} GB", file=sys.stderr)
    print(f"build seconds: {json.dumps({k: round(v) for k, v in seconds.items()})}", file=sys.stderr)
    return seconds


@pytest.fixture(scope="session")
def docker_host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """podman's Docker API on a socket of its own: what kfp.local's DockerRunner (docker-py) talks to."""
    sock = tmp_path_factory.mktemp("podman") / "podman.sock"
    proc = subprocess.Popen(
        ["podman", "system", "service", "--time=0", f"unix://{sock}"],
        env=_env(),
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


@pytest.mark.parametrize("ref", [SLIM, TRAIN_CPU])
def test_images_run_as_non_root_on_a_read_only_root(images: dict[str, float], ref: str) -> None:
    out = _podman("run", "--rm", "--read-only", "--tmpfs", "/tmp", ref, "sh", "-c", "id -u; rloo --version")
    assert out.split() == ["1000", "rloo", "0.1.0"], out


def test_the_pipeline_runs_every_step_in_its_image(
    images: dict[str, float], docker_host: str, tmp_path: Path
) -> None:
    work = tmp_path / "work"
    env = _env(
        DOCKER_HOST=docker_host,
        RLOO_IMAGE_TRAIN=TRAIN_CPU,
        RLOO_IMAGE_EVAL=TRAIN_CPU,
        HF_HUB_OFFLINE="1",
    )
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
    proc = subprocess.run([*cmd, "--updates", "2"], env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    assert "succeeded" in proc.stdout and "push decision:" in proc.stdout

    # every step ran in its image: kfp.local's log of each step names it
    logs = {p.stem: p.read_text() for p in (work / "logs").rglob("*.log") if p.stem != "pipeline"}
    expected = {
        "validate-params": SLIM,
        "fetch-sft": SLIM,
        "train-rloo": TRAIN_CPU,
        "evaluate": TRAIN_CPU,
        "push-model": SLIM,
        "finish-run": SLIM,
    }
    for step, ref in expected.items():
        assert f"Found image '{ref}'" in logs[step], (step, logs[step][-2000:])

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
