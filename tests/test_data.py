"""Prompt datasets from a local directory laid out like a Hub dataset repository."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from rloo.data import (
    PromptDataset,
    format_prompts,
    load_prompt_dataset,
    local_splits,
    tokenize_prompts,
)
from rloo.demo.tiny import TinySetup, build_tokenizer
from rloo.demo.toy import write_toy_dataset
from rloo.errors import UserError


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
