"""Models and data in object storage written by any tool (`aws s3 cp`, Spark, boto3), against real SeaweedFS:
read as listed (sizes checked, the listing unchanged through the read), fetched once per machine, and an rloo
upload still verified against its manifest."""

from __future__ import annotations

import hashlib
import json
import tempfile
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest

from rloo.demo.tiny import TinySetup
from rloo.storage import publish_atomic
from rloo.storage.backends import S3Backend
from rloo.storage.prefix import cached_prefix, fetch_prefix
from tests.fixtures.servers import S3Server
from tests.fixtures.train_cli import train_argv


def _count_downloads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many files each S3 download of this test transferred (the real download runs)."""
    counts: list[int] = []
    real = S3Backend.get_files

    def counted(self: S3Backend, items: list[Any], bar: Any) -> None:
        counts.append(len(items))
        real(self, items, bar)

    monkeypatch.setattr(S3Backend, "get_files", counted)
    return counts


def _metrics(out: Path) -> dict[str, Any]:
    return json.loads((out / "metrics.jsonl").read_text().splitlines()[0])


def test_a_reward_model_in_object_storage_trains_like_the_local_one(
    s3_env: S3Server,
    tiny_setup: TinySetup,
    toy_dataset: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`rloo train --reward_model_path s3://...` on a cluster without the Hub: the reward model copied up with
    plain boto3 (no manifest) is fetched into the machine's scratch (s3transfer's managed download,
    boto/s3transfer s3transfer/download.py) and scores the same rollouts the same as the local directory."""
    from rloo.cli import main

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "scratch"))
    (tmp_path / "scratch").mkdir()
    uri = s3_env.copy_up(tiny_setup.reward_model, f"rm-{uuid.uuid4().hex[:8]}")
    runs = {}
    for name, rm in (("local", str(tiny_setup.reward_model)), ("s3", uri)):
        argv = train_argv(tiny_setup, toy_dataset, tmp_path / name, max_steps=1)
        funcs = argv.index("--reward_funcs")
        argv[funcs : funcs + 2] = ["--reward_model_path", rm]
        assert main([*argv, "--report_to", "none"]) == 0
        runs[name] = _metrics(tmp_path / name)
    scores = [k for k in runs["local"] if k.startswith("objective/scores")]
    assert scores and all(runs["s3"][k] == runs["local"][k] for k in scores)
    (copy,) = [p for p in (tmp_path / "scratch" / "rloo-models").iterdir() if p.is_dir()]
    local_files = {p.name for p in tiny_setup.reward_model.iterdir() if p.is_file()}
    assert local_files <= {p.name for p in copy.iterdir()}


def test_processes_of_one_machine_fetch_a_prefix_once(
    s3_env: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ranks of a node read one reward model or dataset at once: one of them downloads (a file lock), the
    others wait and reuse its copy; an object replaced later (same size, a new ETag) is read again."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    counts = _count_downloads(monkeypatch)
    client, prefix = s3_env.client(), f"shared-{uuid.uuid4().hex[:8]}"
    client.put_object(Bucket=s3_env.bucket, Key=f"{prefix}/config.json", Body=b"{}")
    client.put_object(Bucket=s3_env.bucket, Key=f"{prefix}/model.safetensors", Body=b"a" * 4096)
    uri = f"s3://{s3_env.bucket}/{prefix}"
    got: list[Path] = []
    threads = [threading.Thread(target=lambda: got.append(cached_prefix(uri, "area")[0])) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert counts == [2] and len(set(got)) == 1 and len(got) == 4
    client.put_object(Bucket=s3_env.bucket, Key=f"{prefix}/model.safetensors", Body=b"b" * 4096)
    where, read = cached_prefix(uri, "area")
    assert counts == [2, 2] and (where / "model.safetensors").read_bytes() == b"b" * 4096
    assert {f.path: f.sha256 for f in read.files}["model.safetensors"] == hashlib.sha256(
        b"b" * 4096
    ).hexdigest()


def test_an_atomically_published_prefix_is_verified_and_recorded_where_it_is(
    s3_env: S3Server, tmp_path: Path
) -> None:
    """An rloo upload published atomically (its pointer manifest names versions/<id>/): read through the
    manifest, every SHA-256 checked, each file recorded under the key it is stored at, with the ETag
    ListObjectsV2 gives for it (AWS S3 API reference, Object.ETag)."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text("{}")
    uri = f"s3://{s3_env.bucket}/published-{uuid.uuid4().hex[:8]}"
    pointer = publish_atomic(src, uri, progress=False)
    read = fetch_prefix(uri, tmp_path / "copy")
    (only,) = read.files
    key = f"{uri.removeprefix(f's3://{s3_env.bucket}/')}/{pointer.root}/config.json"
    head = s3_env.client().head_object(Bucket=s3_env.bucket, Key=key)
    assert read.manifest and (only.path, only.key, only.etag) == ("config.json", key, head["ETag"].strip('"'))
    assert (tmp_path / "copy" / "config.json").read_text() == "{}"
