"""Upload, download, manifests and checkpoints against real SeaweedFS and a local directory: same semantics."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from rloo.errors import UserError
from rloo.storage import (
    MANIFEST_NAME,
    CheckpointMirror,
    IncompleteArtifactError,
    Location,
    StorageError,
    build_manifest,
    delete_prefix,
    download_dir,
    is_complete,
    latest_complete_prefix,
    list_complete_prefixes,
    read_manifest,
    upload_dir,
    verify_prefix,
    write_manifest,
)
from rloo.storage.manifest import sha256_file
from tests.fixtures.servers import S3Server
from tests.storage.helpers import SMALL_PARTS, make_tree, same_tree


@pytest.fixture(params=["s3", "local"])
def base(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh parent location per test, in SeaweedFS or in a local directory."""
    if request.param == "local":
        return str(tmp_path / "store")
    request.getfixturevalue("s3_env")
    return f"s3://rloo-test/{request.node.name.replace('[', '-').replace(']', '')}-{os.urandom(3).hex()}"


def _raw_put(uri: str, rel: str, data: bytes) -> None:
    """Write behind the library's back (a tampering user, a damaged disk)."""
    loc = Location.parse(uri)
    if loc.is_local:
        (loc.path / rel).parent.mkdir(parents=True, exist_ok=True)
        (loc.path / rel).write_bytes(data)
    else:
        from rloo.storage import s3_client

        s3_client().put_object(Bucket=loc.bucket, Key=loc.object_key(rel), Body=data)


def _raw_delete(uri: str, rel: str) -> None:
    loc = Location.parse(uri)
    if loc.is_local:
        (loc.path / rel).unlink()
    else:
        from rloo.storage import s3_client

        s3_client().delete_object(Bucket=loc.bucket, Key=loc.object_key(rel))


def test_roundtrip_with_manifest_and_verified_download(base: str, tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src")
    uri = f"{base}/model"
    manifest = upload_dir(src, uri, transfer_config=SMALL_PARTS)
    assert [f.path for f in manifest.files] == ["config.json", "model.safetensors", "tokenizer/vocab.txt"]
    assert manifest.by_path["model.safetensors"].sha256 == sha256_file(src / "model.safetensors")
    assert read_manifest(uri) == manifest and is_complete(uri)
    dest = tmp_path / "dl" / "model"
    assert download_dir(uri, dest, transfer_config=SMALL_PARTS) == manifest
    assert same_tree(src, dest)
    assert json.loads((dest / MANIFEST_NAME).read_text())["num_files"] == 3
    assert not [p for p in dest.parent.iterdir() if p.name != "model"]  # no temp dirs left behind
    # a second download of the same thing is a no-op; a different existing directory is refused
    assert download_dir(uri, dest) == manifest
    other = make_tree(tmp_path / "other", big=10)
    with pytest.raises(UserError, match="exists and is not a verified copy"):
        download_dir(uri, other)
    download_dir(uri, other, overwrite=True)
    assert same_tree(src, other)


def test_a_prefix_without_manifest_is_refused(base: str, tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src", big=100)
    uri = f"{base}/half"
    for p in sorted(src.rglob("*")):  # every file there, but never sealed: an interrupted upload
        if p.is_file():
            _raw_put(uri, p.relative_to(src).as_posix(), p.read_bytes())
    assert not is_complete(uri)
    with pytest.raises(IncompleteArtifactError, match=r"has no _MANIFEST\.json") as e:
        download_dir(uri, tmp_path / "dl")
    assert "\n" not in str(e.value) and "upload the directory again" in str(e.value)
    assert not (tmp_path / "dl").exists()


def test_tampered_or_missing_files_are_refused(base: str, tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src", big=1000)
    uri = f"{base}/m"
    upload_dir(src, uri)
    _raw_put(uri, "config.json", b"X" * (src / "config.json").stat().st_size)
    assert is_complete(uri)  # same size: only the checksum can tell
    with pytest.raises(IncompleteArtifactError, match="fails its SHA-256 check"):
        download_dir(uri, tmp_path / "dl")
    assert not (tmp_path / "dl").exists()
    _raw_delete(uri, "tokenizer/vocab.txt")
    assert not is_complete(uri)
    with pytest.raises(IncompleteArtifactError, match=r"missing: tokenizer/vocab\.txt"):
        verify_prefix(uri)
    with pytest.raises(IncompleteArtifactError):
        download_dir(uri, tmp_path / "dl")


def test_local_overwrite_interrupted_midway_leaves_no_readable_mix(tmp_path: Path) -> None:
    # Publish v1, then try v2 where one destination path cannot be written: the upload stops after some
    # files were replaced. Readers must not accept the mix of v1 and v2 files.
    v1, v2 = make_tree(tmp_path / "v1", big=100, seed=b"1"), make_tree(tmp_path / "v2", big=100, seed=b"2")
    (v2 / "zz").mkdir()
    (v2 / "zz" / "late.bin").write_bytes(b"x")
    dest = tmp_path / "store" / "model"
    upload_dir(v1, dest)
    (dest / "zz").write_text("a file where v2 needs a directory")
    with pytest.raises(StorageError, match="nothing was published") as e:
        upload_dir(v2, dest)
    assert "\n" not in str(e.value)
    assert (dest / "config.json").read_text() == (v2 / "config.json").read_text()  # v2 was partly written
    assert not is_complete(dest)
    with pytest.raises(IncompleteArtifactError):
        download_dir(dest, tmp_path / "dl")


def test_checkpoints_newest_complete_first_and_natural_order(base: str, tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src", big=10)
    for n in (1, 2, 9, 10):
        upload_dir(src, f"{base}/run/checkpoint-{n}")
    _raw_delete(f"{base}/run/checkpoint-10", MANIFEST_NAME)  # the newest upload was interrupted
    upload_dir(src, f"{base}/run/other-1")
    assert list_complete_prefixes(f"{base}/run") == [f"{base}/run/checkpoint-{n}" for n in (1, 2, 9)]
    assert latest_complete_prefix(f"{base}/run") == f"{base}/run/checkpoint-9"
    assert latest_complete_prefix(f"{base}/nothing-here") is None
    delete_prefix(f"{base}/run/checkpoint-9")
    assert latest_complete_prefix(f"{base}/run") == f"{base}/run/checkpoint-2"
    # nested prefixes are independent: publishing the parent neither lists nor deletes them
    upload_dir(src, f"{base}/run")
    assert is_complete(f"{base}/run") and is_complete(f"{base}/run/checkpoint-2")
    assert read_manifest(f"{base}/run").by_path == build_manifest(src).by_path


def test_checkpoint_mirror_uploads_in_background_prunes_and_restores(base: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    mirror = CheckpointMirror(f"{base}/ckpts", keep_last=2, transfer_config=SMALL_PARTS)
    for n in (2, 4, 6):
        ckpt = make_tree(out / f"checkpoint-{n}", big=1000, seed=bytes([n]))
        write_manifest(ckpt)  # the trainer seals its local checkpoint; the mirror re-derives the same one
        mirror.submit(ckpt)
        if n > 2:  # one upload in flight at most: submitting n waited for n - 2 to be complete remotely
            assert is_complete(f"{base}/ckpts/checkpoint-{n - 2}")
        if n == 4:
            import shutil

            shutil.rmtree(ckpt)  # local rotation while (maybe) uploading: the snapshot still has the files
    mirror.wait()
    mirror.close()
    assert list_complete_prefixes(f"{base}/ckpts") == [
        f"{base}/ckpts/checkpoint-4",
        f"{base}/ckpts/checkpoint-6",
    ]
    assert not [p for p in out.iterdir() if p.name.startswith(".rloo-")]  # snapshots cleaned up
    fresh_pod = tmp_path / "fresh"
    restored = CheckpointMirror(f"{base}/ckpts", background=False).restore_latest(fresh_pod)
    assert restored == fresh_pod / "checkpoint-6"
    assert same_tree(out / "checkpoint-6", restored)


def test_exclude_globs_and_local_seal_in_place(tmp_path: Path, s3_env: S3Server) -> None:
    src = make_tree(tmp_path / "out", big=10)
    (src / "mlruns").mkdir()
    (src / "mlruns" / "mlflow.db").write_bytes(b"db")
    (src / "x.tmp").write_text("t")
    m = upload_dir(src, "s3://rloo-test/excluded", exclude=["mlruns", "*.tmp"])
    assert [f.path for f in m.files] == ["config.json", "model.safetensors", "tokenizer/vocab.txt"]
    sealed = upload_dir(src, src, exclude=["mlruns", "*.tmp"])  # publishing in place writes only the manifest
    assert sealed.by_path == m.by_path and is_complete(src)


def _killed_mid_upload(src: Path, uri: str, seen: Any) -> None:
    """Run upload_dir(src, uri) in a subprocess with slowed copies and SIGKILL it once ``seen()`` is true."""
    import signal
    import subprocess
    import sys
    import time

    root = Path(__file__).resolve().parents[2]
    code = (
        "import sys, tests.fixtures.slow_copy\n"
        "from boto3.s3.transfer import TransferConfig\n"
        "from rloo.storage import upload_dir\n"
        "upload_dir(sys.argv[1], sys.argv[2], progress=False,\n"
        "           transfer_config=TransferConfig(multipart_threshold=5 << 20, multipart_chunksize=5 << 20))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "src"), str(root)])}
    env["RLOO_TEST_BYTES_PER_S"] = str(4 << 20)
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(src), uri], env=env, start_new_session=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not seen():
            assert proc.poll() is None, proc.communicate()[0].decode()
            assert time.monotonic() < deadline, "the upload never started"
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def test_next_upload_aborts_the_multipart_uploads_of_a_killed_one(s3_env: S3Server, tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src", big=24 * 1024 * 1024)  # five 5 MiB parts
    uri = f"s3://rloo-test/mpu-{os.urandom(3).hex()}/model"
    other = f"mpu-other-{os.urandom(3).hex()}/x.bin"  # an open upload of someone else's prefix
    client = s3_env.client()
    foreign = client.create_multipart_upload(Bucket="rloo-test", Key=other)["UploadId"]
    loc = Location.parse(uri)

    def open_uploads() -> list[str]:
        ups = client.list_multipart_uploads(Bucket="rloo-test", Prefix=loc.key + "/").get("Uploads", [])
        return [u["Key"] for u in ups]

    # a real transfer, killed after its multipart upload has started: the upload stays open in the bucket
    _killed_mid_upload(src, uri, lambda: bool(open_uploads()))
    assert open_uploads() == [f"{loc.key}/model.safetensors"]
    assert not is_complete(uri)

    upload_dir(src, uri)  # the same upload again (default parts: one PutObject per file)
    assert open_uploads() == []
    download_dir(uri, tmp_path / "dl")
    assert same_tree(src, tmp_path / "dl")
    # only uploads under the prefix being written are aborted
    others = client.list_multipart_uploads(Bucket="rloo-test", Prefix=other).get("Uploads", [])
    assert [u["UploadId"] for u in others] == [foreign]
    client.abort_multipart_upload(Bucket="rloo-test", Key=other, UploadId=foreign)


def test_next_local_upload_removes_the_temp_files_of_a_killed_one(tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src", big=24 * 1024 * 1024)
    dest = tmp_path / "dest"

    def temp_files() -> list[str]:
        return [p.name for p in dest.rglob(".rloo-*")] if dest.is_dir() else []

    _killed_mid_upload(src, str(dest), lambda: bool(temp_files()))
    assert temp_files() and not is_complete(dest)
    upload_dir(src, dest)
    assert temp_files() == [] and is_complete(dest)
