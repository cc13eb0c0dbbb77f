"""The fetch step: the SFT model copied to the run's store as a verified upload, a Hub id pinned to a commit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rloo.errors import UserError
from rloo.stages.fetch import fetch_model, manifest_digest
from tests.stages.test_validate import PinnedHub


def test_fetch_local_model_publishes_verified_copy(tmp_path: Path) -> None:
    src = tmp_path / "sft"
    src.mkdir()
    (src / "config.json").write_text("{}")
    (src / "model.safetensors").write_bytes(b"w" * 100)
    meta = fetch_model(str(src), str(tmp_path / "store" / "sft"))
    assert (tmp_path / "store" / "sft" / "config.json").is_file()
    assert meta["num_files"] == 2 and meta["total_bytes"] == 102
    # the digest ignores the manifest timestamp: publishing the same files again gives the same digest
    again = fetch_model(str(src), str(tmp_path / "store2" / "sft"))
    assert again["manifest_digest"] == meta["manifest_digest"]
    assert meta["manifest_digest"].startswith("sha256:")
    (src / "model.safetensors").write_bytes(b"x" * 100)
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
