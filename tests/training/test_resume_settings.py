"""A command given an output_dir that holds a run: the settings that decide what is trained must be the run's
(rloo_config.json), a finished run is extended only when its length grew and is never trained over without
--overwrite_output_dir; --max_steps 0 and a batch larger than the data are said in one line.

huggingface/transformers src/transformers/trainer_utils.py (``compare_trainer_and_checkpoint_args``) compares a
checkpoint's arguments with the command's and warns, keeping the command's; here a setting that cannot change
within a run is refused instead, naming both values. ``--overwrite_output_dir`` is the classic trainer's flag
(transformers 4.x src/transformers/training_args.py: "overwrite the content of the output directory"), and
``max_steps`` follows training_args.py's "If set to a positive number, the total number of training steps".
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import pytest

from rloo.config import RESUMABLE_SETTINGS, RUN_LENGTH_SETTINGS, RLOOConfig
from rloo.demo.tiny import TinySetup
from rloo.errors import UserError
from rloo.training import trainer
from tests.fixtures import recipes

pytestmark = pytest.mark.slow

START_AGAIN = "pass --overwrite_output_dir to start again, or another --output_dir."


class _Crash(Exception):
    pass


@pytest.fixture
def config(tiny_setup: TinySetup, toy_dataset: Path, tmp_path: Path):
    def make(**overrides: Any) -> RLOOConfig:
        own = {"learning_rate": 1e-3, "max_steps": 2, "save_steps": 1, "seed": 5}
        return recipes.config(tiny_setup, toy_dataset, tmp_path / "out", **{**own, **overrides})

    return make


def _crash_at(monkeypatch: pytest.MonkeyPatch, update: int) -> None:
    def hook(at_update: int, phase: str) -> None:
        if at_update == update and phase == "generation":
            raise _Crash

    monkeypatch.setattr(trainer, "PHASE_HOOKS", [hook])


def _weights(out: Path) -> bytes:
    return (out / "model.safetensors").read_bytes()


def test_each_setting_is_a_field_and_the_ones_that_shape_training_must_match() -> None:
    fields = set(RLOOConfig.field_names())
    assert set(RESUMABLE_SETTINGS) <= fields and set(RUN_LENGTH_SETTINGS) <= fields
    assert not set(RESUMABLE_SETTINGS) & set(RUN_LENGTH_SETTINGS)
    assert len(set(RESUMABLE_SETTINGS)) == len(RESUMABLE_SETTINGS)
    shaping = {
        "learning_rate",
        "rloo_k",
        "seed",
        "model_name_or_path",
        "dataset_name",
        "kl_coef",
        "reward_funcs",
    }
    assert not shaping & (set(RESUMABLE_SETTINGS) | set(RUN_LENGTH_SETTINGS))


def test_resuming_with_another_learning_rate_or_rloo_k_is_refused_naming_both_values(
    config, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = config(max_steps=4)
    with monkeypatch.context() as mp:
        _crash_at(mp, 2)
        with pytest.raises(_Crash):
            trainer.train(cfg)
    out = Path(cfg.output_dir)
    changed = config(max_steps=4, learning_rate=1e-2, rloo_k=4, logging_steps=2)  # logging may change
    with pytest.raises(UserError) as refused:
        trainer.train(changed)
    assert str(refused.value) == (
        f"cannot resume {out / 'checkpoint-2'} with other settings (--rloo_k 2 -> 4, --learning_rate 0.001 -> "
        f"0.01), which cannot change within a run; {START_AGAIN}"
    )
    # the same command but for its reporting settings resumes
    result = trainer.train(config(max_steps=4, logging_steps=2, report_to="none"))
    assert result.history[-1]["update"] == 4


def test_a_finished_run_given_other_settings_is_refused_not_called_done(config) -> None:
    cfg = config()
    trainer.train(cfg)
    out = Path(cfg.output_dir)
    before = _weights(out)
    with pytest.raises(UserError) as refused:
        trainer.train(config(kl_coef=0.1))
    assert str(refused.value) == (
        f"{out} holds a finished run trained with other settings (--kl_coef 0.05 -> 0.1), which cannot change "
        f"within a run; {START_AGAIN}"
    )
    assert _weights(out) == before


def test_a_longer_run_extends_a_finished_one_from_its_checkpoint(config) -> None:
    trainer.train(config(max_steps=2, save_steps=1))
    result = trainer.train(config(max_steps=4, save_steps=1))
    assert [h["update"] for h in result.history] == [1, 2, 3, 4]
    out = Path(config().output_dir)
    assert '"num_updates": 4' in (out / "training_complete.json").read_text()


def test_a_longer_run_without_a_checkpoint_is_refused_not_trained_from_scratch(config) -> None:
    trainer.train(config(max_steps=2, save_steps=0))
    out = Path(config().output_dir)
    before = _weights(out)
    with pytest.raises(UserError) as refused:
        trainer.train(config(max_steps=3, save_steps=0))
    assert str(refused.value) == (
        f"{out} holds a finished run of 2 updates and this command asks for 3 (--max_steps 2 -> 3), but the run "
        f"kept no checkpoint to continue from (one every --save_steps 0 updates); {START_AGAIN}"
    )
    assert _weights(out) == before
    with pytest.raises(UserError, match="can be extended, not shortened"):
        trainer.train(config(max_steps=1, save_steps=0))
    assert _weights(out) == before
    # asked for: it starts again, and trains the 3 updates from the start
    result = trainer.train(config(max_steps=3, save_steps=0, overwrite_output_dir=True))
    assert [h["update"] for h in result.history] == [1, 2, 3]
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 3
    assert _weights(out) != before


def test_overwrite_output_dir_starts_again_over_another_runs_checkpoint(
    config, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = config(max_steps=4)
    with monkeypatch.context() as mp:
        _crash_at(mp, 3)
        with pytest.raises(_Crash):
            trainer.train(cfg)
    out = Path(cfg.output_dir)
    result = trainer.train(config(max_steps=2, seed=6, overwrite_output_dir=True))
    assert [h["update"] for h in result.history] == [1, 2]
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1"]  # the other run's are gone


def test_max_steps_0_is_refused_in_one_line(config) -> None:
    with pytest.raises(UserError) as refused:
        config(max_steps=0)
    assert str(refused.value) == (
        "--max_steps must be a positive number of updates, or -1 to let --total_episodes or --num_train_epochs "
        "decide (got 0: 0 would train nothing)."
    )
    assert dataclasses.replace(config(), max_steps=-1).max_steps == -1


def test_a_batch_larger_than_the_prompts_warns_once(config, caplog: pytest.LogCaptureFixture) -> None:
    # 64 completions / rloo_k 2 = 32 prompts per update; the toy split holds 16
    with caplog.at_level(logging.WARNING):
        t = trainer.RLOOTrainer(config(per_device_train_batch_size=64))
    t.release_output()
    (line,) = [r.getMessage() for r in caplog.records if "each update takes" in r.getMessage()]
    assert line.startswith(
        "each update takes 32 prompts (batch 64 / rloo_k 2) but the 'train' split holds 16"
    )
    assert "at most 32 completions" in line
