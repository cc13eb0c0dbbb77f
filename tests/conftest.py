"""Shared fixtures: one tiny local model setup and one toy Hub-layout dataset per test session, and the real
SeaweedFS / MLflow servers (started on first use, stopped when the session ends)."""

from __future__ import annotations

import os

# Nothing may reach the Hub at test time; code that would try meets huggingface_hub's offline mode instead
# (set before huggingface_hub is first imported: it reads the variable once).
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from collections.abc import Iterator
from pathlib import Path

import pytest

from rloo.demo.tiny import TinySetup, build_tiny_setup
from rloo.demo.toy import write_toy_dataset
from tests.fixtures.servers import MlflowServer, S3Server, release, shared_mlflow, shared_s3


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


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    server = shared_s3(tmp_path_factory.mktemp("servers"))
    yield server
    release("s3")


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    server = shared_mlflow(tmp_path_factory.mktemp("servers"))
    yield server
    release("mlflow")


@pytest.fixture(autouse=True)
def _own_environment() -> Iterator[None]:
    """Each test gets the process environment as it found it: code under test that sets a variable (a stage
    exporting its settings for a child process) must not change what a later test sees."""
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)
