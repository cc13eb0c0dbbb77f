"""The fetch step: the SFT model copied to the run's store as a verified upload, a Hub id pinned to a commit,
an s3:// prefix read whoever wrote it."""

from __future__ import annotations

import hashlib
import json
import uuid
from pathlib import Path

import pytest

from rloo.errors import UserError
from rloo.stages.fetch import fetch_model, manifest_digest
from tests.fixtures.servers import S3Server, use_s3
from tests.fixtures.weights import safetensors_bytes
from tests.stages.test_validate import PinnedHub


def test_fetch_local_model_publishes_verified_copy(tmp_path: Path) -> None:
    src = tmp_path / "sft"
    src.mkdir()
    (src / "config.json").write_text("{}")
    (src / "model.safetensors").write_bytes(safetensors_bytes(b"w" * 100))
    meta = fetch_model(str(src), str(tmp_path / "store" / "sft"))
    assert (tmp_path / "store" / "sft" / "config.json").is_file()
    assert meta["num_files"] == 2 and meta["total_bytes"] == 2 + len(safetensors_bytes(b"w" * 100))
    # the digest ignores the manifest timestamp: publishing the same files again gives the same digest
    again = fetch_model(str(src), str(tmp_path / "store2" / "sft"))
    assert again["manifest_digest"] == meta["manifest_digest"]
    assert meta["manifest_digest"].startswith("sha256:")
    (src / "model.safetensors").write_bytes(safetensors_bytes(b"x" * 100))
    changed = fetch_model(str(src), str(tmp_path / "store3" / "sft"))
    assert changed["manifest_digest"] != meta["manifest_digest"]


def test_fetch_rejects_non_model_dir(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"config\.json"):
        fetch_model(str(tmp_path), str(tmp_path / "out"))


def test_manifest_digest_is_order_independent() -> None:
    from rloo.storage import FileEntry, Manifest

    a = Manifest(files=(FileEntry("a", 1, "x"), FileEntry("b", 2, "y")), created_at="t1")
    b = Manifest(files=(FileEntry("b", 2, "y"), FileEntry("a", 1, "x")), created_at="t2")
    assert manifest_digest(a) == manifest_digest(b)


def test_fetch_pins_a_hub_model_to_its_resolved_commit(tmp_path: Path) -> None:
    main, tag = "a" * 40, "b" * 40
    hub = PinnedHub({"main": main, "v1": tag})
    meta = fetch_model("org/sft", str(tmp_path / "s1"), hub_api=hub)
    # main is resolved once and exactly that commit is downloaded and recorded: if main moves during the
    # download, the record still says what was fetched
    assert hub.downloads == [("org/sft", main)] and meta["revision"] == main
    assert json.loads((tmp_path / "s1" / "config.json").read_text()) == {"commit": main}
    meta = fetch_model("org/sft", str(tmp_path / "s2"), revision="v1", hub_api=hub)
    assert hub.downloads[-1] == ("org/sft", tag) and meta["revision"] == tag
    with pytest.raises(UserError, match="no revision 'nope'"):
        fetch_model("org/sft", str(tmp_path / "s3"), revision="nope", hub_api=hub)
    assert not (tmp_path / "s3").exists()
    # non-Hub sources have no revision to record, and refuse one
    src = tmp_path / "sft"
    src.mkdir()
    (src / "config.json").write_text("{}")
    assert fetch_model(str(src), str(tmp_path / "s4"))["revision"] is None
    with pytest.raises(UserError, match="only applies to a Hugging Face Hub id"):
        fetch_model(str(src), str(tmp_path / "s5"), revision="v1")
    from rloo.pipeline.reports import fetch_markdown

    assert tag in fetch_markdown({"source": "org/sft", "revision": tag})


def test_fetch_an_s3_model_copied_with_plain_boto3(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, s3_server: S3Server
) -> None:
    """A save_pretrained directory copied up as `aws s3 cp --recursive` does (plain PutObject per file, no
    _MANIFEST.json) is fetched: its top-level files, which transformers' from_pretrained reads
    (huggingface/transformers src/transformers/modeling_utils.py), not the nested checkpoint-N/ of the run
    that wrote it nor hidden files. The artifact records each file read with its key, size, SHA-256 and ETag
    (ListObjectsV2's entity tag, AWS S3 API reference: an MD5 only for single-part unencrypted uploads, so
    recorded, never compared); the published copy is the same model as a fetch of the same local files."""
    server = use_s3(s3_server, monkeypatch)
    client, prefix = server.client(), f"copied-{uuid.uuid4().hex[:8]}"
    files = {
        "config.json": b'{"model_type": "gpt2"}',
        "model.safetensors": safetensors_bytes(b"w" * 1000),
        "tokenizer.json": b"{}",
    }
    etags = {
        name: client.put_object(Bucket=server.bucket, Key=f"{prefix}/{name}", Body=body)["ETag"].strip('"')
        for name, body in files.items()
    }
    client.put_object(Bucket=server.bucket, Key=f"{prefix}/checkpoint-5/model.safetensors", Body=b"old" * 500)
    client.put_object(Bucket=server.bucket, Key=f"{prefix}/.cache/lock", Body=b"")
    source = f"s3://{server.bucket}/{prefix}"
    meta = fetch_model(source, str(tmp_path / "store" / "sft"))
    assert sorted(p.name for p in (tmp_path / "store" / "sft").iterdir()) == [
        "_MANIFEST.json",
        *sorted(files),
    ]
    assert (
        meta["source_manifest"] is False
        and meta["num_files"] == 3
        and meta["total_bytes"] == sum(map(len, files.values()))
    )
    assert meta["source_files"] == [
        {
            "path": name,
            "size": len(files[name]),
            "sha256": hashlib.sha256(files[name]).hexdigest(),
            "etag": etags[name],
            "key": f"{prefix}/{name}",
        }
        for name in sorted(files)
    ]
    local = tmp_path / "local"
    local.mkdir()
    for name, body in files.items():
        (local / name).write_bytes(body)
    assert (
        fetch_model(str(local), str(tmp_path / "store2" / "sft"))["manifest_digest"]
        == meta["manifest_digest"]
    )
    assert json.loads(json.dumps(meta)) == meta  # the KFP artifact's metadata is JSON


def test_fetch_an_s3_prefix_that_holds_no_model_or_a_damaged_upload(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, s3_server: S3Server
) -> None:
    """No config.json at the prefix's top: one line, exit 2, before any download. An rloo upload whose file
    was changed after publishing still fails its SHA-256 check against the manifest."""
    server = use_s3(s3_server, monkeypatch)
    client, prefix = server.client(), f"bad-{uuid.uuid4().hex[:8]}"
    client.put_object(Bucket=server.bucket, Key=f"{prefix}/weights/model.safetensors", Body=b"w")
    with pytest.raises(
        UserError, match=r"^--model s3://\S+: no config\.json at the top of this prefix"
    ) as err:
        fetch_model(f"s3://{server.bucket}/{prefix}", str(tmp_path / "out"))
    assert err.value.exit_code == 2 and not (tmp_path / "out").exists()
    src = tmp_path / "sft"
    src.mkdir()
    (src / "config.json").write_text("{}")
    (src / "model.safetensors").write_bytes(safetensors_bytes(b"w" * 100))
    published = f"s3://{server.bucket}/{prefix}/published"
    fetch_model(str(src), published)
    key = f"{prefix}/published/model.safetensors"
    # same size, header intact: only the SHA-256 tells
    client.put_object(Bucket=server.bucket, Key=key, Body=safetensors_bytes(b"x" * 100))
    with pytest.raises(UserError, match="fails its SHA-256 check"):
        fetch_model(published, str(tmp_path / "out2"))
