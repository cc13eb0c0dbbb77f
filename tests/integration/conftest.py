from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from rloo.config import RLOOConfig
from rloo.demo.tiny import TinySetup, build_tiny_setup
from rloo.demo.toy import write_toy_dataset
from tests.fixtures import recipes


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinySetup:
    return build_tiny_setup(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def toy_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_toy_dataset(tmp_path_factory.mktemp("toy"), extra_split="descriptiveness")


@pytest.fixture
def make_config(tiny: TinySetup, toy_data: Path, tmp_path: Path):
    """Small, fast settings for a CPU run; keyword arguments override them."""

    def make(**overrides: Any) -> RLOOConfig:
        return recipes.config(
            tiny, toy_data, tmp_path / "out", recipes.LEARNING, **{"max_steps": 2, "seed": 3, **overrides}
        )

    return make
