from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from rloo.config import RLOOConfig
from rloo.demo.tiny import TinySetup, build_tiny_setup
from rloo.demo.toy import write_toy_dataset


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
        kw: dict[str, Any] = dict(
            model_name_or_path=str(tiny.policy),
            reward_funcs=["rloo.demo.toy:letter_reward"],
            dataset_name=str(toy_data),
            output_dir=str(tmp_path / "out"),
            per_device_train_batch_size=16,
            rloo_k=4,
            num_ppo_epochs=1,
            response_length=6,
            learning_rate=5e-3,
            temperature=1.0,
            max_steps=2,
            num_sample_generations=0,
            save_steps=0,
            disable_tqdm=True,
            seed=3,
        )
        kw.update(overrides)
        return RLOOConfig(**kw)

    return make
