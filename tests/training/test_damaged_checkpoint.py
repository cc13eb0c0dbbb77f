"""A damaged checkpoint never restarts a run from update 0 in silence: with an earlier intact checkpoint the
run resumes from that one and says which, and with none it is refused in one line naming the file and the size
its manifest records.

As huggingface/transformers src/transformers/trainer.py (``_load_from_checkpoint``) refuses a checkpoint
without valid weights ("Can't find a valid checkpoint at ...") rather than training from scratch; the check
here is the checkpoint's manifest (every file's size and SHA-256).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from rloo.config import RLOOConfig
from rloo.demo.tiny import TinySetup
from rloo.errors import UserError
from rloo.training import trainer
from rloo.training.checkpoint import MANIFEST
from tests.fixtures import recipes

pytestmark = pytest.mark.slow


class _Crash(Exception):
    pass


def _config(tiny: TinySetup, data: Path, out: Path) -> RLOOConfig:
    return recipes.config(tiny, data, out, max_steps=4, save_steps=1, seed=5)


def _crash_at(monkeypatch: pytest.MonkeyPatch, update: int) -> None:
    """The process dies as update ``update`` starts (checkpoints 1..update are written)."""

    def hook(at_update: int, phase: str) -> None:
        if at_update == update and phase == "generation":
            raise _Crash

    monkeypatch.setattr(trainer, "PHASE_HOOKS", [hook])


def _truncate_weights(checkpoint: Path) -> tuple[str, int]:
    """Cut the checkpoint's weights short, as a full disk or a killed copy does; returns the file's name and
    the size its manifest records."""
    weights = checkpoint / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    manifest = json.loads((checkpoint / MANIFEST).read_text())
    (entry,) = [f for f in manifest["files"] if f["path"] == "model.safetensors"]
    return "model.safetensors", int(entry["size"])


def test_the_only_checkpoint_damaged_is_refused_naming_the_file(
    tiny_setup: TinySetup, toy_dataset: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "out"
    cfg = _config(tiny_setup, toy_dataset, out)
    with monkeypatch.context() as mp:
        _crash_at(mp, 1)
        with pytest.raises(_Crash):
            trainer.train(cfg)
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1"]
    name, size = _truncate_weights(out / "checkpoint-1")
    with pytest.raises(UserError) as refused:
        trainer.train(cfg)
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(
        f"cannot resume from {out / 'checkpoint-1'}: {name} has 100 bytes, the manifest says {size}"
    )
    assert "--resume_from_checkpoint none" in message
    assert not (out / "training_complete.json").exists()
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 1  # the update trained before is kept


def test_a_damaged_newest_checkpoint_resumes_from_the_intact_one_before_it(
    tiny_setup: TinySetup,
    toy_dataset: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    out = tmp_path / "out"
    cfg = _config(tiny_setup, toy_dataset, out)
    with monkeypatch.context() as mp:
        _crash_at(mp, 2)
        with pytest.raises(_Crash):
            trainer.train(cfg)
    name, size = _truncate_weights(out / "checkpoint-2")
    with caplog.at_level(logging.INFO):
        result = trainer.train(cfg)
    warned = [
        r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "damaged" in r.getMessage()
    ]
    assert warned == [
        f"{out / 'checkpoint-2'} is damaged ({name} has 100 bytes, the manifest says {size}): resuming from "
        f"{out / 'checkpoint-1'}, the newest intact checkpoint"
    ]
    assert [h["update"] for h in result.history] == [1, 2, 3, 4]
    assert "resumed from" in caplog.text and "(update 1 of 4)" in caplog.text
