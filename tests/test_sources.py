"""One rule for what a model or dataset argument names (rloo.storage.location.source_kind), the same in every
stage and command: ``gpt2`` and ``org/name`` are Hub ids; ``./gpt2``, ``/x/gpt2``, ``~/m``, ``file://...``,
``a/b/c`` and existing paths are local; ``s3://b/p`` is object storage."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from rloo.errors import UserError
from rloo.storage.location import source_kind
from tests.fixtures.servers import S3Server, use_s3

HUB = ["gpt2", "EleutherAI/pythia-14m", "trl-lib/tldr", "distilbert-base-uncased", "org/name.v2"]
LOCAL = ["./gpt2", "/x/gpt2", "~/models/gpt2", "file:///x/gpt2", "a/b/c", "org/name/", "my model", "org//x"]
S3 = ["s3://b/p", "S3://bucket/prefix/model"]


@pytest.mark.parametrize("value", HUB)
def test_hub_ids(value: str) -> None:
    assert source_kind(value) == "hub"


@pytest.mark.parametrize("value", LOCAL)
def test_local_paths(value: str) -> None:
    assert source_kind(value) == "local"


@pytest.mark.parametrize("value", S3)
def test_s3_uris(value: str) -> None:
    assert source_kind(value) == "s3"


def test_an_existing_directory_shaped_like_a_hub_id_is_local(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert source_kind("gpt2") == "hub"
    (tmp_path / "gpt2").mkdir()
    assert source_kind("gpt2") == "local"  # as transformers' from_pretrained reads it


# --- every stage and command applies it ----------------------------------------------------------------


def test_train_takes_a_bare_hub_id_and_refuses_missing_paths(
    tmp_path: Path, s3_server: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rloo.models import check_model_source

    check_model_source("model_name_or_path", "gpt2")  # a Hub id: left to transformers
    for local in ("./gpt2", str(tmp_path / "gpt2"), "a/b/c"):
        with pytest.raises(UserError, match=r"no such directory; pass a model directory or a Hub id\.$"):
            check_model_source("model_name_or_path", local)
    # an s3:// model is fetched before loading: the prefix must hold one (tests/storage/test_any_upload.py)
    server = use_s3(s3_server, monkeypatch)
    empty = f"s3://{server.bucket}/{tmp_path.name}/none"
    with pytest.raises(UserError, match=rf"--model_name_or_path {empty}: no objects under this prefix"):
        check_model_source("model_name_or_path", empty)


def test_datasets_follow_the_same_rule(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from rloo.data import read_split
    from rloo.eval.data import load_eval_rows

    monkeypatch.chdir(tmp_path)
    # a bare name goes to the Hub (offline in tests: the Hub's one-line failure), not "no such directory"
    with pytest.raises(UserError) as err:
        read_split("tldr", "train")
    assert "no such directory" not in str(err.value)
    for local in ("./tldr", "a/b/c"):
        with pytest.raises(UserError, match="no such directory"):
            read_split(local, "train")
        with pytest.raises(UserError, match="no such directory"):
            load_eval_rows(local, "test")


def test_pipeline_steps_take_a_bare_hub_id(tmp_path: Path) -> None:
    from rloo.stages.fetch import fetch_model
    from rloo.stages.sft import durable_model_name
    from rloo.stages.validate import check_pipeline_model

    check_pipeline_model("gpt2")  # old rule: "model 'gpt2': no such directory"
    for local in ("./gpt2", str(tmp_path / "gpt2"), "a/b/c"):
        with pytest.raises(UserError, match="no such directory"):
            check_pipeline_model(local)
    assert durable_model_name({"source": "gpt2", "uri": "s3://b/run/sft"}) == "gpt2"
    assert durable_model_name({"source": "./gpt2", "uri": "s3://b/run/sft"}) == "s3://b/run/sft"
    assert durable_model_name({"source": "s3://b/sft", "uri": "s3://b/run/sft"}) == "s3://b/run/sft"

    class Hub:
        """Stands in for HfApi (the Hub cannot be reached from tests): one repo, 'gpt2'."""

        def model_info(self, repo_id: str, revision: str | None = None) -> object:
            assert repo_id == "gpt2"
            return SimpleNamespace(sha="c" * 40)

        def snapshot_download(self, repo_id: str, *, revision: str | None, local_dir: Path) -> str:
            Path(local_dir).mkdir(parents=True)
            (Path(local_dir) / "config.json").write_text("{}")
            return str(local_dir)

    meta = fetch_model("gpt2", str(tmp_path / "store" / "sft"), hub_api=Hub())
    assert meta["source"] == "gpt2" and meta["revision"] == "c" * 40
    assert durable_model_name(meta) == "gpt2"


def test_push_routes_by_the_same_rule(tmp_path: Path) -> None:
    from rloo.push.trained import check_trained_model

    # a push takes a training output: a Hub id is a missing directory there, as before; s3:// by its manifest
    with pytest.raises(UserError, match="--model_path gpt2: no such directory"):
        check_trained_model("gpt2")
    with pytest.raises(UserError, match=r"invalid S3 bucket name 'bad_bucket'"):
        check_trained_model("S3://bad_bucket/x")
