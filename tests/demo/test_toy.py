"""Tests for rloo.demo.toy: the Hub-style toy dataset and the pure-Python reward functions."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rloo.demo.toy import (
    letter_reward,
    sometimes_none_reward,
    target_letter_reward,
    vowel_majority_reward,
    write_toy_dataset,
)

TRAIN = "data/train-00000-of-00001.parquet"
TEST = "data/test-00000-of-00001.parquet"


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def test_layout_and_columns(tmp_path: Path) -> None:
    path = write_toy_dataset(tmp_path / "ds", num_train=20, num_test=5)
    assert path == tmp_path / "ds"
    assert _files(path) == [TEST, TRAIN]
    train, test = pq.read_table(path / TRAIN), pq.read_table(path / TEST)
    assert (train.num_rows, test.num_rows) == (20, 5)
    assert train.schema == pa.schema([("prompt", pa.string()), ("target", pa.string())])
    for row in train.to_pylist():
        assert row["prompt"].endswith(":") and len(row["prompt"].split()) >= 2
        assert row["target"] in set("aeiou")
    assert len(set(train.column("prompt").to_pylist())) > 5  # varied prompts


def test_extra_split(tmp_path: Path) -> None:
    path = write_toy_dataset(tmp_path, num_train=8, num_test=4, extra_split="descriptiveness")
    assert _files(path) == ["data/descriptiveness-00000-of-00001.parquet", TEST, TRAIN]
    extra = pq.read_table(path / "data/descriptiveness-00000-of-00001.parquet")
    assert extra.equals(pq.read_table(path / TRAIN))
    for bad in ("train", "test", "../x", "a b", ""):
        with pytest.raises(ValueError):
            write_toy_dataset(tmp_path / "bad", extra_split=bad)
    with pytest.raises(ValueError):
        write_toy_dataset(tmp_path / "bad", num_train=0)


def test_loads_with_datasets(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    path = write_toy_dataset(tmp_path / "ds", num_train=12, num_test=3, extra_split="descriptiveness")
    files = {"train": str(path / TRAIN), "test": str(path / TEST)}
    loaded = datasets.load_dataset("parquet", data_files=files, cache_dir=str(tmp_path / "cache"))
    assert loaded["train"].num_rows == 12 and loaded["test"].num_rows == 3
    assert loaded["train"].column_names == ["prompt", "target"]
    assert loaded["train"][0] == pq.read_table(path / TRAIN).to_pylist()[0]
    # Laid out like a Hub repo, the folder alone is enough: splits come from the file names.
    by_folder = datasets.load_dataset(str(path), cache_dir=str(tmp_path / "cache2"))
    assert sorted(by_folder) == ["descriptiveness", "test", "train"]


def test_deterministic(tmp_path: Path) -> None:
    a = write_toy_dataset(tmp_path / "a", seed=3)
    b = write_toy_dataset(tmp_path / "b", seed=3)
    c = write_toy_dataset(tmp_path / "c", seed=4)
    for split in (TRAIN, TEST):
        assert pq.read_table(a / split).equals(pq.read_table(b / split))
        assert not pq.read_table(a / split).equals(pq.read_table(c / split))
    # train and test are different draws
    assert pq.read_table(a / TRAIN).slice(0, 32).to_pylist() != pq.read_table(a / TEST).to_pylist()


def test_conversational(tmp_path: Path) -> None:
    plain = write_toy_dataset(tmp_path / "plain", num_train=10, num_test=2, seed=1)
    chat = write_toy_dataset(tmp_path / "chat", num_train=10, num_test=2, seed=1, conversational=True)
    plain_rows = pq.read_table(plain / TRAIN).to_pylist()
    chat_rows = pq.read_table(chat / TRAIN).to_pylist()
    for p, c in zip(plain_rows, chat_rows, strict=True):
        assert c["prompt"] == [{"role": "user", "content": p["prompt"]}]
        assert c["target"] == p["target"]


def test_letter_reward_values() -> None:
    completions = [
        "aXe b",  # non-space a,X,e,b; vowels a,e -> 2/4 = 0.5
        "aeiou",  # all vowels -> 1.0
        "xyz",  # none -> 0.0
        "",  # empty -> 0.0
        "   \n",  # only whitespace -> 0.0
        "AE io!",  # non-space A,E,i,o,! ; vowels (case-insensitive) A,E,i,o -> 4/5 = 0.8
        "é 1",  # non-space é,1 ; é is not in aeiou -> 0/2 = 0.0
    ]
    assert letter_reward(completions) == [0.5, 1.0, 0.0, 0.0, 0.0, 0.8, 0.0]
    # pass/fail at more than half: exactly half (0.5) fails
    assert vowel_majority_reward(completions) == [0.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.0]


def test_letter_reward_trl_signature_and_messages() -> None:
    out = letter_reward(
        prompts=["p1", "p2"],
        completions=[
            [{"role": "assistant", "content": "ab"}],  # a,b -> 1/2
            [
                {"role": "user", "content": "zzz"},
                {"role": "assistant", "content": "oo x"},
            ],  # last: o,o,x -> 2/3
        ],
        completion_ids=[[1, 2], [3]],
        trainer_state=None,
        target=["a", "e"],
    )
    assert out == pytest.approx([0.5, 2 / 3])
    assert letter_reward(completions=[[]]) == [0.0]  # an empty message list is an empty completion
    with pytest.raises(TypeError):
        letter_reward(completions=[42])


def test_target_letter_reward() -> None:
    out = target_letter_reward(
        completions=["aXa b", "eeee", "aeiou", ""],
        target=["a", "e", "u", "o"],
        prompts=["p"] * 4,
        completion_ids=[[0]] * 4,
        trainer_state=None,
    )
    # "aXa b": a,X,a,b -> two "a" of 4 = 0.5 ; "eeee" target e -> 1.0 ; "aeiou" target u -> 1/5 ; "" -> 0.0
    assert out == pytest.approx([0.5, 1.0, 0.2, 0.0])
    with pytest.raises(ValueError):
        target_letter_reward(completions=["a", "b"], target=["a"])


def test_sometimes_none_reward() -> None:
    out = sometimes_none_reward(
        completions=["aXe b", "ab", "", "aei", [{"role": "assistant", "content": "x"}]]
    )
    # "aXe b" has 5 chars (odd) -> letter_reward 0.5 ; "ab" 2 (even) -> None ; "" 0 (even) -> None ;
    # "aei" 3 (odd) -> 1.0 ; "x" 1 (odd) -> 0.0
    assert out == [0.5, None, None, 1.0, 0.0]


def test_toy_eval_dataset_loads_as_evaluation_rows(tmp_path: Path) -> None:
    from rloo.demo.toy import write_toy_eval_dataset
    from rloo.eval.data import load_eval_rows

    path = write_toy_eval_dataset(tmp_path / "ev", num_test=8, seed=3)
    rows = load_eval_rows(str(path), "test", config=None, num_examples=None)
    assert len(rows.prompts) == 8 and all(p.endswith(":") for p in rows.prompts)
    assert write_toy_eval_dataset(tmp_path / "again", num_test=8, seed=3).joinpath("data").is_dir()
    again = load_eval_rows(str(tmp_path / "again"), "test", config=None, num_examples=None)
    assert again.references == rows.references  # same seed, same rows
    with pytest.raises(ValueError, match="num_test"):
        write_toy_eval_dataset(tmp_path / "bad", num_test=0)
    one = load_eval_rows(
        str(write_toy_eval_dataset(tmp_path / "one", num_test=1)), "test", config=None, num_examples=None
    )
    assert letter_reward(one.references) == [0.5]


def test_toy_eval_references_are_graded_over_the_whole_range(tmp_path: Path) -> None:
    """The demo's set (32 rows, seed 1): distinct prompts (a repeated one would count twice), and references
    whose vowel fractions are i/31 for i = 0..31, so a judge of vowel fractions reads degrees, not a pass mark.
    """
    from rloo.demo.toy import write_toy_eval_dataset
    from rloo.eval.data import load_eval_rows

    demo = load_eval_rows(
        str(write_toy_eval_dataset(tmp_path / "demo", seed=1)), "test", config=None, num_examples=None
    )
    assert len(set(demo.prompts)) == len(demo.prompts) == 32
    fractions = letter_reward(demo.references)
    assert sorted(fractions) == pytest.approx([i / 31 for i in range(32)])
    assert fractions != sorted(fractions)  # in no particular order of the rows
    for ref in demo.references:
        assert 40 <= len(ref.replace(" ", "")) <= 64 and ref == " ".join(ref.split())  # about 16 tokens
    # a model writing vowel fraction s beats the references below s: its win rate is about s
    for s in (0.0, 0.35, 0.7, 1.0):
        below = sum(f < s for f in fractions) + 0.5 * sum(f == s for f in fractions)
        assert below / 32 == pytest.approx(s, abs=1 / 31)
