"""Prompt datasets from a local directory laid out like a Hub dataset repository, or an s3:// upload of one."""

from __future__ import annotations

import json
import tempfile
import uuid
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from rloo.data import (
    PromptDataset,
    check_dataset_source,
    dataset_record,
    format_prompts,
    load_prompt_dataset,
    local_splits,
    tokenize_prompts,
)
from rloo.demo.tiny import TinySetup, build_tokenizer
from rloo.demo.toy import write_toy_dataset
from rloo.errors import UserError
from rloo.eval.data import load_eval_rows
from tests.fixtures.servers import S3Server, use_s3


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def read_parquet_column(path: Path, name: str) -> list[Any]:
    return pq.read_table(path).column(name).to_pylist()


def test_parquet_hub_layout_with_arbitrary_split_name(toy_dataset: Path) -> None:
    data = toy_dataset / "data"
    assert sorted(local_splits(toy_dataset)) == ["descriptiveness", "test", "train"]
    ds = load_prompt_dataset(str(toy_dataset), "descriptiveness")
    assert ds.split == "descriptiveness"
    assert ds.prompts == read_parquet_column(data / "train-00000-of-00001.parquet", "prompt")
    assert len(ds) == 16 and not ds.conversational
    # the extra column is kept, row-aligned
    assert ds.extra == {"target": read_parquet_column(data / "train-00000-of-00001.parquet", "target")}
    test = load_prompt_dataset(str(toy_dataset), "test")
    assert test.prompts == read_parquet_column(data / "test-00000-of-00001.parquet", "prompt")
    assert len(test) == 4


def test_jsonl_extra_columns_and_shards(tmp_path: Path) -> None:
    rows = [{"prompt": f"p{i}", "label": i, "meta": {"src": f"s{i}"}} for i in range(5)]
    write_jsonl(tmp_path / "data" / "train-00000-of-00002.jsonl", rows[:3])
    write_jsonl(tmp_path / "data" / "train-00001-of-00002.jsonl", rows[3:])
    write_jsonl(tmp_path / "data" / "validation.jsonl", [{"prompt": "v", "label": 9, "meta": None}])
    assert sorted(local_splits(tmp_path)) == ["train", "validation"]
    ds = load_prompt_dataset(str(tmp_path), "train")
    assert ds.prompts == ["p0", "p1", "p2", "p3", "p4"]  # shards concatenated in order
    assert ds.extra["label"] == [0, 1, 2, 3, 4]
    assert ds.extra["meta"] == [{"src": f"s{i}"} for i in range(5)]
    assert ds.extra_for([4, 0]) == {"label": [4, 0], "meta": [{"src": "s4"}, {"src": "s0"}]}
    val = load_prompt_dataset(str(tmp_path), "validation")
    assert (val.prompts, val.extra["label"], val.split) == (["v"], [9], "validation")


def test_json_array_and_files_at_the_root(tmp_path: Path) -> None:
    (tmp_path / "train.json").write_text(json.dumps([{"prompt": "a", "x": 1}, {"prompt": "b", "x": 2}]))
    ds = load_prompt_dataset(str(tmp_path), "train")
    assert ds.prompts == ["a", "b"] and ds.extra == {"x": [1, 2]}


def test_missing_column_in_one_shard_is_filled_with_none(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "data" / "train-0.jsonl", [{"prompt": "a", "x": 1}])
    write_jsonl(tmp_path / "data" / "train-1.jsonl", [{"prompt": "b"}])
    assert load_prompt_dataset(str(tmp_path), "train").extra == {"x": [1, None]}


def test_missing_test_split_falls_back_to_train(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "data" / "train-00000-of-00001.jsonl", [{"prompt": "only"}])
    ds = load_prompt_dataset(str(tmp_path), "test", fallback_split="train")
    assert (ds.split, ds.prompts) == ("train", ["only"])
    with pytest.raises(UserError) as info:
        load_prompt_dataset(str(tmp_path), "test")
    msg = str(info.value)
    assert "no split 'test'" in msg and "available: train" in msg and "--dataset_test_split" in msg


def test_missing_prompt_column(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    pq.write_table(pa.table({"query": ["q"], "answer": ["a"]}), data / "train-00000-of-00001.parquet")
    with pytest.raises(UserError) as info:
        load_prompt_dataset(str(tmp_path), "train")
    msg = str(info.value)
    assert "no 'prompt' column" in msg and "answer, query" in msg and "rename" in msg


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_empty_split(tmp_path: Path, fmt: str) -> None:
    data = tmp_path / "data"
    data.mkdir()
    if fmt == "parquet":
        pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), data / "train-00000-of-00001.parquet")
    else:
        (data / "train-00000-of-00001.jsonl").write_text("\n")
    with pytest.raises(UserError, match="split 'train' is empty; give a split with at least one prompt"):
        load_prompt_dataset(str(tmp_path), "train")


@pytest.mark.parametrize(
    ("files", "match"),
    [
        ({}, "no data files found"),
        ({"data/train.jsonl": "{not json\n"}, "cannot read dataset file"),
        ({"data/train.jsonl": '{"prompt": 3}\n'}, "row 0 of 'prompt' is int"),
    ],
)
def test_bad_local_datasets(tmp_path: Path, files: dict[str, str], match: str) -> None:
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    with pytest.raises(UserError, match=match) as info:
        load_prompt_dataset(str(tmp_path), "train")
    assert "\n" not in str(info.value)


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="no such directory"):
        load_prompt_dataset(str(tmp_path / "absent"), "train")


def test_conversational_prompts_through_the_chat_template(tmp_path: Path, tiny_setup: TinySetup) -> None:
    root = write_toy_dataset(tmp_path / "chat", num_train=3, num_test=1, conversational=True)
    ds = load_prompt_dataset(str(root), "train")
    assert ds.conversational
    assert all(isinstance(p, list) and p[0]["role"] == "user" for p in ds.prompts)
    assert len(ds.extra["target"]) == 3
    tok = AutoTokenizer.from_pretrained(tiny_setup.policy)
    texts = format_prompts(ds.prompts, tok)
    # the tiny template: "role: content", then a blank line and the generation prompt "assistant:"
    assert texts == [f"user: {p[0]['content']}\n\nassistant:" for p in ds.prompts]
    ids = tokenize_prompts(texts, tok, chat=True)
    assert [tok.decode(i) for i in ids] == texts
    # plain prompts pass through unchanged
    assert format_prompts(["a", "b"], tok) == ["a", "b"]


def test_chat_prompts_need_a_chat_template(tmp_path: Path) -> None:
    tok = build_tokenizer(tmp_path / "tok", with_chat_template=False)
    with pytest.raises(UserError, match="no chat template"):
        format_prompts([[{"role": "user", "content": "hi"}]], tok)


def test_prompt_dataset_defaults() -> None:
    ds = PromptDataset(prompts=[])
    assert len(ds) == 0 and not ds.conversational and ds.extra == {} and ds.split == "train"


# --- datasets in object storage (the real SeaweedFS of tests/conftest.py) ------------------------------


@pytest.fixture
def s3_dataset(
    s3_server: S3Server, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, toy_dataset: Path
) -> tuple[S3Server, str]:
    """The toy dataset uploaded with rloo's storage upload to a fresh prefix; a private download cache."""
    from rloo.storage import upload_dir

    server = use_s3(s3_server, monkeypatch)
    cache = tmp_path / "tmp"
    cache.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(cache))  # where s3:// datasets are cached
    uri = f"s3://{server.bucket}/datasets-{uuid.uuid4().hex[:8]}/toy"
    upload_dir(toy_dataset, uri, progress=False)
    return server, uri


def test_s3_dataset_reads_like_the_local_directory(
    s3_dataset: tuple[S3Server, str], toy_dataset: Path
) -> None:
    _, uri = s3_dataset
    remote = load_prompt_dataset(uri, "descriptiveness")
    local = load_prompt_dataset(str(toy_dataset), "descriptiveness")
    assert remote.prompts == local.prompts and remote.extra == local.extra
    assert remote.record is not None and local.record is not None
    assert (remote.record.kind, remote.record.source, remote.record.split) == ("s3", uri, "descriptiveness")
    # the same files give the same digest wherever they are stored
    assert remote.record.digest == local.record.digest and remote.record.digest.startswith("sha256:")
    assert remote.record.num_rows == len(remote)
    check_dataset_source(uri)
    # evaluation reads it the same way (the toy test split has prompt + target, not completion: a one-line
    # refusal about the columns, after reading it from the bucket)
    with pytest.raises(UserError, match="has no reference completions"):
        load_eval_rows(uri, "test")
    assert dataset_record(uri, "descriptiveness") == remote.record


def test_s3_dataset_with_a_tampered_file_is_refused(s3_dataset: tuple[S3Server, str]) -> None:
    server, uri = s3_dataset
    key = uri.removeprefix(f"s3://{server.bucket}/") + "/data/train-00000-of-00001.parquet"
    client = server.client()
    body = bytearray(client.get_object(Bucket=server.bucket, Key=key)["Body"].read())
    body[len(body) // 2] ^= 0xFF  # same size: only the SHA-256 can tell
    client.put_object(Bucket=server.bucket, Key=key, Body=bytes(body))
    with pytest.raises(UserError, match=r"fails its SHA-256 check") as err:
        load_prompt_dataset(uri, "train")
    assert str(err.value).startswith(f"--dataset_name {uri}: ") and "\n" not in str(err.value)


def test_s3_prefix_without_manifest_is_refused_in_one_line(
    s3_server: S3Server, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    server = use_s3(s3_server, monkeypatch)
    prefix = f"raw-{uuid.uuid4().hex[:8]}"
    rows = b'{"prompt": "hi"}\n'
    server.client().put_object(Bucket=server.bucket, Key=f"{prefix}/data/train.jsonl", Body=rows)
    uri = f"s3://{server.bucket}/{prefix}"
    for read in (lambda: load_prompt_dataset(uri, "train"), lambda: check_dataset_source(uri)):
        with pytest.raises(UserError) as err:
            read()
        message = str(err.value)
        assert message.startswith(f"--dataset_name {uri}: no _MANIFEST.json at this prefix; upload")
        assert f"upload_dir('DATASET_DIR', '{uri}')" in message and "\n" not in message
    # a missing bucket says so, not "no manifest"
    with pytest.raises(UserError, match="no-such-bucket") as err:
        load_prompt_dataset("s3://no-such-bucket/x", "train")
    assert "_MANIFEST" not in str(err.value)


def test_local_dataset_digest_is_of_its_files(tmp_path: Path) -> None:
    root = tmp_path / "ds"
    write_jsonl(root / "data" / "train.jsonl", [{"prompt": "a"}])
    write_jsonl(root / "data" / "test.jsonl", [{"prompt": "b"}])
    first = load_prompt_dataset(str(root), "train").record
    assert first is not None and first.kind == "local" and first.source == str(root.resolve())
    (root / "README.md").write_text("not data")  # only the data files count
    assert dataset_record(str(root), "train", config="x").digest == first.digest
    write_jsonl(root / "data" / "test.jsonl", [{"prompt": "c"}])
    assert load_prompt_dataset(str(root), "train").record.digest != first.digest  # type: ignore[union-attr]
