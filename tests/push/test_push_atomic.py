"""Production is published atomically for readers: a push SIGKILLed while copying to --production_uri
leaves the previous champion complete and readable, and the re-run leaves no stale file (local and S3)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from rloo.push import PushConfig, run_push
from rloo.storage import Location, download_dir, read_manifest, s3_client, verify_prefix
from rloo.storage.backends import backend_for
from tests.fixtures.servers import S3Server, use_s3
from tests.push.conftest import write_eval

ROOT = Path(__file__).resolve().parents[2]
MiB = 1024 * 1024


@pytest.fixture(autouse=True)
def _no_tracking(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("MLFLOW_TRACKING_URI", "KFP_RUN_ID", "KFP_RUN_NAME", "HF_TOKEN", "RLOO_REPORT_TO"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(params=["local", "s3"])
def where(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    if request.param == "local":
        return {"store": str(tmp_path / "store"), "prod": str(tmp_path / "prod")}
    server: S3Server = request.getfixturevalue("s3_server")
    use_s3(server, monkeypatch)
    base = f"s3://{server.bucket}/atomic-{tmp_path.name}"
    return {"store": f"{base}/store", "prod": f"{base}/prod"}


def _model(trained_dir: Path, dest: Path, seed: bytes) -> Path:
    """A finished training output whose content (so run key) differs by ``seed``, with one slow-to-copy file."""
    shutil.copytree(trained_dir, dest)
    (dest / "big_file.bin").write_bytes(seed * (6 * MiB // len(seed)))
    return dest


def _files(uri: str) -> dict[str, int]:
    return backend_for(Location.parse(uri)).sizes()


def _open_multipart(uri: str) -> list[Any]:
    loc = Location.parse(uri)
    if not loc.is_s3:
        return []
    return s3_client().list_multipart_uploads(Bucket=loc.bucket, Prefix=loc.key + "/").get("Uploads", [])


def test_push_killed_mid_copy_keeps_the_previous_champion(
    where: dict[str, str], trained_dir: Path, tmp_path: Path
) -> None:
    # the challenger beats the champion on every example, so it takes production
    ev_old = write_eval(tmp_path / "eval_old.json", lo=0.04, scores=[0.5] * 20)
    ev = write_eval(tmp_path / "eval_results.json", lo=0.04, scores=[1.0] * 20)

    def cfg(model: Path, out: str) -> PushConfig:
        return PushConfig(
            model_path=str(model), eval_results=str(ev if out != "out1" else ev_old), output_dir=str(tmp_path / out),
            storage_uri=where["store"], production_uri=where["prod"],
        )  # fmt: skip

    old = _model(trained_dir, tmp_path / "old", b"old-champion")
    first = run_push(cfg(old, "out1")).to_dict()
    assert first["production"]["uploaded"]
    champion = read_manifest(where["prod"]).by_path
    assert champion["big_file.bin"].size == 6 * MiB

    new = _model(trained_dir, tmp_path / "new", b"new-challenger")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)]),
        "RLOO_TEST_BYTES_PER_S": str(2 * MiB),  # 3 s per copy of big_file.bin
    }
    argv = [
        "--model_path", str(new), "--eval_results", str(ev), "--output_dir", str(tmp_path / "out2"),
        "--storage_uri", where["store"], "--production_uri", where["prod"],
    ]  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "fixtures" / "slow_copy.py"), "push", *argv],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    old_root = read_manifest(where["prod"]).root
    try:
        deadline = time.monotonic() + 120
        while True:  # the first files of the new version have landed in production: kill it there
            landed = [
                k for k in _files(where["prod"])
                if k.startswith("versions/") and not k.startswith(old_root + "/")
                and not Path(k).name.startswith(".rloo-")
            ]  # fmt: skip
            if landed or _open_multipart(where["prod"]):
                break
            assert proc.poll() is None, proc.communicate()[0].decode()
            assert time.monotonic() < deadline, "the push never reached production"
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL

    # Readers still get the previous champion, complete and verified, not a mix.
    assert read_manifest(where["prod"]).by_path == champion
    verify_prefix(where["prod"])
    got = download_dir(where["prod"], tmp_path / "reader", progress=False)
    assert got.by_path == champion
    assert (tmp_path / "reader" / "big_file.bin").read_bytes()[:12] == b"old-champion"

    # The re-run publishes the new model and leaves nothing else: no old version, no half-copied file, no
    # open multipart upload.
    second = run_push(cfg(new, "out3")).to_dict()
    assert second["production"]["uploaded"] and second["decision"] == "champion"
    pointer = read_manifest(where["prod"])
    assert pointer.root != old_root
    assert set(_files(where["prod"])) == {"_MANIFEST.json"} | {
        f"{pointer.root}/{p}" for p in [*pointer.by_path, "_MANIFEST.json"]
    }
    assert _open_multipart(where["prod"]) == []
    download_dir(where["prod"], tmp_path / "reader2", progress=False)
    assert (tmp_path / "reader2" / "big_file.bin").read_bytes()[:14] == b"new-challenger"
