"""Every file a finished run leaves in output_dir (final model, checkpoints, metrics, samples, plots) gets the
mode the umask gives a plain file: 0644 under umask 022, so a reader running as another user (a serving pod,
a shared volume) can open all of them. safetensors writes its files 0600 on its own."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from rloo.demo.tiny import TinySetup
from rloo.diskspace import current_umask
from rloo.training.trainer import train
from tests.fixtures import recipes


@pytest.fixture
def umask(request: pytest.FixtureRequest) -> Iterator[int]:
    before = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(before)


def _modes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): stat.S_IMODE(p.stat().st_mode) for p in root.rglob("*") if p.is_file()}


@pytest.mark.parametrize(
    ("umask", "peft"), [(0o022, False), (0o027, True)], indirect=["umask"], ids=["022-full", "027-lora"]
)
def test_every_file_of_a_finished_output_dir_honours_the_umask(
    tiny_setup: TinySetup, toy_dataset: Path, tmp_path: Path, umask: int, peft: bool
) -> None:
    assert current_umask() == umask
    out = tmp_path / "out"
    cfg = recipes.config(
        tiny_setup,
        toy_dataset,
        out,
        per_device_train_batch_size=8,
        rloo_k=4,
        max_steps=3,
        save_steps=2,
        num_sample_generations=1,
        use_peft=peft,
        merge_adapter=peft,
    )
    train(cfg)
    modes = _modes(out)
    weights = "adapter_model.safetensors" if peft else "model.safetensors"
    # the files the report was about, and every other one
    assert {weights, f"checkpoint-2/{weights}", "metrics.jsonl", "training_complete.json"} <= modes.keys()
    if peft:
        assert "merged/model.safetensors" in modes
    want = 0o666 & ~umask
    wrong = {name: oct(mode) for name, mode in modes.items() if mode != want}
    assert not wrong, f"not {oct(want)}: {wrong}"
