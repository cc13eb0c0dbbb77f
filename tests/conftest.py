"""Shared fixtures: one tiny local model setup and one toy Hub-layout dataset per test session."""

from __future__ import annotations

import os

# Nothing may reach the Hub at test time; code that would try meets huggingface_hub's offline mode instead
# (set before huggingface_hub is first imported: it reads the variable once).
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pathlib import Path

import pytest

from rloo.tiny import TinySetup, build_tiny_setup
from rloo.toy import write_toy_dataset


@pytest.fixture(scope="session")
def tiny_setup(tmp_path_factory: pytest.TempPathFactory) -> TinySetup:
    """Tokenizer (no pad token, chat template), gpt_neox policy and reward model, built once."""
    return build_tiny_setup(tmp_path_factory.mktemp("tiny_setup"))


@pytest.fixture(scope="session")
def toy_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Hub layout: data/{train,test,descriptiveness}-00000-of-00001.parquet with prompt + target columns."""
    return write_toy_dataset(
        tmp_path_factory.mktemp("toy_dataset"), num_train=16, num_test=4, extra_split="descriptiveness"
    )
