"""Prompt datasets from a local directory laid out like a Hub dataset repository, or an s3:// prefix holding
one, written by rloo's storage upload or any other tool."""

from __future__ import annotations

import hashlib
import json
import random
import re
import tempfile
import uuid
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from rloo.data import (
    DatasetRecord,
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
    # sharded names throughout: next to them a plain data/validation.jsonl is no split (datasets' rule)
    write_jsonl(
        tmp_path / "data" / "validation-00000-of-00001.jsonl", [{"prompt": "v", "label": 9, "meta": None}]
    )
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


# --- datasets written with any tool ---------------------------------------------------------------------------
# Which files form which split follows huggingface/datasets src/datasets/data_files.py (get_data_patterns:
# SPLIT_PATTERN_SHARDED, then the split-keyword directory and file name patterns, then everything as train;
# hidden files, __special__ directories and FILES_TO_IGNORE never data). The installed datasets library
# itself is the reference: each layout is resolved by it and by rloo, on the same directory.

LAYOUTS = {
    "sharded names with a stray plain file": [
        "data/train-00000-of-00002.jsonl",
        "data/train-00001-of-00002.jsonl",
        "data/validation.jsonl",
    ],
    "aws s3 cp of two files": ["train.parquet", "test.parquet", "README.md"],
    "spark, one directory per split": [
        "train/part-00000-3f1c-c000.snappy.parquet",
        "train/part-00001-3f1c-c000.snappy.parquet",
        "train/_SUCCESS",
        "train/.part-00000-3f1c-c000.snappy.parquet.crc",
        "test/part-00000-9a2b-c000.snappy.parquet",
    ],
    "spark, no split name": ["part-00000-3f1c.snappy.parquet", "_SUCCESS"],
    "keywords inside file names": ["my_train.csv", "my_test.csv", "notes.txt"],
    "no keyword at all": ["data/descriptiveness.jsonl"],
    "nested split directories": ["data/train/shard_0.csv", "data/train/shard_1.csv", "data/valid/x.json"],
    "numbered shards and aliases": ["train_0.jsonl", "train_1.jsonl", "dev.jsonl", "eval.jsonl"],
    "special and nested names": ["__pycache__/train.jsonl", "x/train.jsonl", "training-data/a.parquet"],
    "directory names win over file names": ["a/b/train-1.parquet", "a/test/z.parquet"],
}


@pytest.mark.parametrize("files", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_splits_are_the_datasets_librarys(tmp_path: Path, files: list[str]) -> None:
    """huggingface/datasets src/datasets/data_files.py (get_data_patterns, resolve_pattern): a directory
    splits here exactly as load_dataset splits it (same splits, same files, same order)."""
    from datasets.data_files import DataFilesDict, get_data_patterns

    from rloo.data import DATA_SUFFIXES

    for rel in files:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x")
    patterns = get_data_patterns(str(tmp_path))
    resolved = DataFilesDict.from_patterns(patterns, str(tmp_path), allowed_extensions=list(DATA_SUFFIXES))
    theirs = {str(k): [Path(f).relative_to(tmp_path).as_posix() for f in v] for k, v in resolved.items() if v}
    ours = {k: [f.relative_to(tmp_path).as_posix() for f in v] for k, v in local_splits(tmp_path).items()}
    assert ours == theirs and ours


def _put(server: S3Server, key: str, body: bytes) -> str:
    """One object written with plain boto3, as `aws s3 cp` writes it (no manifest, no metadata); its ETag."""
    response = server.client().put_object(Bucket=server.bucket, Key=key, Body=body)
    return str(response["ETag"]).strip('"')


def _parquet_bytes(table: pa.Table, tmp_path: Path) -> bytes:
    path = tmp_path / f"{uuid.uuid4().hex}.parquet"
    pq.write_table(table, path)  # snappy, as Spark writes it
    return path.read_bytes()


@pytest.fixture
def raw_s3(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> tuple[S3Server, str]:
    """A fresh prefix nothing of rloo wrote to, and a private download cache."""
    server = use_s3(s3_server, monkeypatch)
    cache = tmp_path / "tmp"
    cache.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(cache))
    return server, f"raw-{uuid.uuid4().hex[:8]}"


def test_s3_dataset_copied_with_plain_boto3_is_read_and_recorded(raw_s3: tuple[S3Server, str]) -> None:
    """An s3:// prefix written as `aws s3 cp` writes it (train.jsonl and test.csv, no _MANIFEST.json) is
    read, and the record lists each file read with its key, size, ETag (as ListObjectsV2 returns it: an
    opaque entity tag, an MD5 of the bytes only for single-part uploads without SSE-KMS, AWS S3 API
    reference, mpUploadComplete / Object ETag) and the SHA-256 of the bytes read. Split rules:
    huggingface/datasets src/datasets/data_files.py (keywords in file names)."""
    server, prefix = raw_s3
    train = b'{"prompt": "a", "n": 1}\n{"prompt": "b", "n": 2}\n'
    test = b"prompt,completion\nq,r\n"
    etags = {"train.jsonl": _put(server, f"{prefix}/train.jsonl", train)}
    etags["test.csv"] = _put(server, f"{prefix}/test.csv", test)
    _put(server, f"{prefix}/README.md", b"# not data")
    uri = f"s3://{server.bucket}/{prefix}"
    check_dataset_source(uri)
    ds = load_prompt_dataset(uri, "train")
    assert ds.prompts == ["a", "b"] and ds.extra == {"n": [1, 2]}
    record = ds.record
    assert record is not None and (record.kind, record.source, record.num_rows) == ("s3", uri, 2)
    (read,) = record.files
    assert (read.path, read.key, read.size) == ("train.jsonl", f"{prefix}/train.jsonl", len(train))
    assert read.etag == etags["train.jsonl"] and read.sha256 == hashlib.sha256(train).hexdigest()
    test_rows = load_eval_rows(uri, "test")  # csv, the evaluation's reader
    assert test_rows.record is not None and test_rows.record.files[0].etag == etags["test.csv"]
    # the digest covers every split's files, the same as for the same files in a local directory
    local = Path(tempfile.gettempdir()) / "same"
    local.mkdir()
    (local / "train.jsonl").write_bytes(train)
    (local / "test.csv").write_bytes(test)
    assert dataset_record(str(local), "train").digest == record.digest
    # recorded beside the model and read back unchanged
    assert DatasetRecord.from_json(record.to_json()) == record


def test_s3_spark_part_files_are_read_in_order(raw_s3: tuple[S3Server, str], tmp_path: Path) -> None:
    """Spark's output (train/part-NNNNN-<uuid>-c000.snappy.parquet, _SUCCESS, hidden .crc files): the
    directory names the split, only the part files are data (huggingface/datasets
    src/datasets/data_files.py: KEYWORDS_IN_DIR_NAME_BASE_PATTERNS, hidden files ignored)."""
    server, prefix = raw_s3
    job = uuid.uuid4()
    parts = [pa.table({"prompt": [f"p{i}" for i in range(j * 3, j * 3 + 3)]}) for j in range(2)]
    for j, table in enumerate(parts):
        name = f"part-{j:05d}-{job}-c000.snappy.parquet"
        _put(server, f"{prefix}/train/{name}", _parquet_bytes(table, tmp_path))
        _put(server, f"{prefix}/train/.{name}.crc", b"crc")
    _put(server, f"{prefix}/train/_SUCCESS", b"")
    _put(server, f"{prefix}/test/part-00000-{job}-c000.snappy.parquet", _parquet_bytes(parts[0], tmp_path))
    uri = f"s3://{server.bucket}/{prefix}/"  # a trailing slash is the same prefix
    ds = load_prompt_dataset(uri, "train")
    assert ds.prompts == [f"p{i}" for i in range(6)]
    assert ds.record is not None and [f.path for f in ds.record.files] == [
        f"train/part-{j:05d}-{job}-c000.snappy.parquet" for j in range(2)
    ]
    assert load_prompt_dataset(uri, "test").prompts == ["p0", "p1", "p2"]


def test_s3_dataset_written_by_datasets_to_parquet(raw_s3: tuple[S3Server, str], tmp_path: Path) -> None:
    """`datasets.Dataset.to_parquet` output copied up with boto3's managed upload (multipart above its
    threshold, as `aws s3 cp` does: its ETag is then no MD5 of the bytes, AWS S3 API reference
    mpUploadComplete) under data/train-00000-of-00001.parquet (huggingface/datasets
    src/datasets/data_files.py SPLIT_PATTERN_SHARDED)."""
    import boto3.s3.transfer
    import datasets

    server, prefix = raw_s3
    rng = random.Random(0)  # incompressible prompts: the file is above the 5 MiB multipart minimum
    rows = {"prompt": [rng.randbytes(100).hex() for _ in range(40_000)], "target": list(range(40_000))}
    local = tmp_path / "train.parquet"
    datasets.Dataset.from_dict(rows).to_parquet(str(local))
    config = boto3.s3.transfer.TransferConfig(
        multipart_threshold=1024 * 1024, multipart_chunksize=1024 * 1024
    )
    key = f"{prefix}/data/train-00000-of-00001.parquet"
    server.client().upload_file(str(local), server.bucket, key, Config=config)
    uri = f"s3://{server.bucket}/{prefix}"
    ds = load_prompt_dataset(uri, "train")
    assert ds.prompts == rows["prompt"] and ds.extra["target"] == rows["target"]
    (read,) = ds.record.files  # type: ignore[union-attr]
    assert read.etag is not None and "-" in read.etag  # a multipart upload's entity tag
    assert read.sha256 == hashlib.sha256(local.read_bytes()).hexdigest() and read.size == local.stat().st_size


def test_s3_dataset_read_once_and_again_after_a_change(
    raw_s3: tuple[S3Server, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prefix read before is not downloaded again while the store lists the same keys, sizes and ETags; a
    file replaced by one of the same size (only its ETag tells) is read again, and the record follows."""
    from rloo.storage.backends import S3Backend

    server, prefix = raw_s3
    downloads: list[int] = []
    real = S3Backend.get_files
    monkeypatch.setattr(
        S3Backend,
        "get_files",
        lambda self, items, bar: (downloads.append(len(items)), real(self, items, bar))[1],
    )
    _put(server, f"{prefix}/train.jsonl", b'{"prompt": "a"}\n')
    uri = f"s3://{server.bucket}/{prefix}"
    first = load_prompt_dataset(uri, "train").record
    assert load_prompt_dataset(uri, "train").record == first and downloads == [1]
    _put(server, f"{prefix}/train.jsonl", b'{"prompt": "b"}\n')
    again = load_prompt_dataset(uri, "train")
    assert again.prompts == ["b"] and downloads == [1, 1]
    assert again.record is not None and first is not None and again.record.digest != first.digest


def test_s3_dataset_changed_while_read_is_retried_not_mixed(
    raw_s3: tuple[S3Server, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A writer still at work (an object replaced between the listing and the download) fails the read with
    exit 75, so that the retried step reads one version, never a mix."""
    from rloo.storage.backends import S3Backend

    server, prefix = raw_s3
    _put(server, f"{prefix}/train.jsonl", b'{"prompt": "old"}\n')
    real = S3Backend.get_files

    def rewritten_meanwhile(self: S3Backend, items: list[Any], bar: Any) -> None:
        _put(server, f"{prefix}/train.jsonl", b'{"prompt": "new!"}\n')
        real(self, items, bar)

    monkeypatch.setattr(S3Backend, "get_files", rewritten_meanwhile)
    uri = f"s3://{server.bucket}/{prefix}"
    with pytest.raises(UserError, match="changed while it was read") as err:
        load_prompt_dataset(uri, "train")
    assert err.value.exit_code == 75 and str(err.value).startswith(f"--dataset_name {uri}: ")


def test_s3_dataset_refusals_are_one_line_with_their_exit_code(
    raw_s3: tuple[S3Server, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An empty prefix or one without data files: exit 2, one line naming the flag; a missing bucket says so;
    a store that cannot be reached: exit 75 (a retry may heal it)."""
    from tests.fixtures.servers import free_port

    server, prefix = raw_s3
    empty = f"s3://{server.bucket}/{prefix}/nothing"
    _put(server, f"{prefix}/docs/README.md", b"#")
    _put(server, f"{prefix}/docs/notes.txt", b"not data")
    for uri, message in (
        (empty, "no objects under this prefix"),
        (f"s3://{server.bucket}/{prefix}/docs", "no data files found (saw notes.txt)"),
    ):
        for read in (lambda u=uri: load_prompt_dataset(u, "train"), lambda u=uri: check_dataset_source(u)):
            with pytest.raises(UserError, match=re.escape(message)) as err:
                read()
            assert str(err.value).startswith(f"--dataset_name {uri}: ") and "\n" not in str(err.value)
            assert err.value.exit_code == 2
    with pytest.raises(UserError, match=r"no-such-bucket.*does not exist") as err:
        load_prompt_dataset("s3://no-such-bucket/x", "train")
    assert err.value.exit_code == 2
    monkeypatch.setenv("S3_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    with pytest.raises(UserError, match="cannot connect") as err:
        check_dataset_source(empty)
    assert err.value.exit_code == 75 and str(err.value).startswith(f"--dataset_name {empty}: ")


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
