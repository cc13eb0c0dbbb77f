"""Prompts longer than the model's positions: cut from the left to fit, counted, said once; refused in one
line when the response alone fills the model.

Real models built here: a GPT-2 with 128 learned positions (a prompt past them was an IndexError in its
position embedding) and the tiny GPT-NeoX with 512 rotary positions (a 2,000-token prompt trained silently
on positions it never had).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from rloo.config import RLOOConfig
from rloo.demo.tiny import TinySetup
from rloo.errors import UserError
from rloo.eval.config import EvalConfig
from rloo.eval.generation import TransformersEngine
from rloo.training.trainer import RLOOTrainer, train
from tests.fixtures.long_prompts import LONG_PROMPT, build_learned_position_lm, write_long_prompt_dataset


@pytest.fixture(scope="module")
def learned_128(tiny: TinySetup, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_learned_position_lm(tmp_path_factory.mktemp("gpt2") / "model", tiny.tokenizer, positions=128)


@pytest.fixture(scope="module")
def long_ds(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_long_prompt_dataset(tmp_path_factory.mktemp("long_ds") / "ds")


def _config(model: Path, data: Path, out: Path, **kw: Any) -> RLOOConfig:
    base: dict[str, Any] = dict(
        model_name_or_path=str(model),
        dataset_name=str(data),
        reward_funcs=["rloo.demo.toy:letter_reward"],
        output_dir=str(out),
        per_device_train_batch_size=4,
        rloo_k=2,
        response_length=8,
        max_steps=2,  # 2 updates x 2 prompts: every prompt of the dataset once
        num_sample_generations=1,  # the sample table generates from the (long) eval prompts too
        save_steps=0,
        disable_tqdm=True,
        report_to="none",
    )
    return RLOOConfig(**{**base, **kw})


@pytest.mark.parametrize(("which", "positions"), [("learned_128", 128), ("rotary_512", 512)])
def test_long_prompts_are_cut_from_the_left_counted_and_warned_once(
    which: str,
    positions: int,
    request: pytest.FixtureRequest,
    tiny: TinySetup,
    long_ds: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    model = request.getfixturevalue("learned_128") if which == "learned_128" else tiny.policy
    cfg = _config(model, long_ds, tmp_path / "out")
    with caplog.at_level(logging.WARNING):
        trainer = RLOOTrainer(cfg)
        keep = positions - cfg.response_length
        # the end of each prompt, where the task is asked, is what is kept
        full = trainer.tokenizer(trainer.train_texts[0], verbose=False)["input_ids"]
        assert len(full) > 2000 and trainer.train_ids[0] == full[-keep:]
        assert max(map(len, trainer.train_ids + trainer.eval_ids)) == keep
        assert len(trainer.train_ids[3]) < 20  # short prompts untouched
        result = trainer.train()
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    cut = [w for w in warnings if "longer than max_prompt_length" in w]
    assert cut == [
        f"2 of 4 training prompts are longer than max_prompt_length ({keep} tokens, the longest {len(full)}): their beginning is cut off"
    ]
    assert not any("indexing errors" in w for w in warnings)  # transformers' own warning stays quiet
    counts = [h["prompts/num_truncated"] for h in result.history]
    assert sum(counts) == 2 and len(counts) == 2  # each long prompt counted in the update that drew it
    assert (tmp_path / "out" / "training_complete.json").is_file()


def test_max_prompt_length_flag(tiny: TinySetup, long_ds: Path, tmp_path: Path) -> None:
    trainer = RLOOTrainer(_config(tiny.policy, long_ds, tmp_path / "out", max_prompt_length=40))
    assert [len(ids) for ids in trainer.train_ids[:2]] == [40, 40]
    assert trainer.truncated_prompts == {0, 1}
    with pytest.raises(
        UserError,
        match=r"^--max_prompt_length 505 \+ --response_length 8 exceeds the model's 512 positions .*at most 504",
    ):
        RLOOTrainer(_config(tiny.policy, long_ds, tmp_path / "out", max_prompt_length=505))
    with pytest.raises(UserError, match=r"--max_prompt_length must be >= 1 \(got 0\)"):
        _config(tiny.policy, long_ds, tmp_path / "out", max_prompt_length=0)


def test_response_filling_the_model_is_refused(learned_128: Path, long_ds: Path, tmp_path: Path) -> None:
    with pytest.raises(UserError) as info:
        train(_config(learned_128, long_ds, tmp_path / "out", response_length=128))
    assert str(info.value) == (
        "--response_length 128 leaves no room for a prompt: the model takes 128 positions "
        "(max_position_embeddings); use a response_length below 128."
    )
    assert not (tmp_path / "out").exists()


def test_eval_generation_cuts_long_prompts_and_refuses_no_room(learned_128: Path) -> None:
    engine = TransformersEngine(_eval_config(learned_128, max_new_tokens=8), device=None)
    texts = engine.generate(str(learned_128), [LONG_PROMPT, "Write about the sea:"])  # no IndexError
    assert len(texts) == 2
    with pytest.raises(
        UserError, match=r"^--max_new_tokens 128 leaves no room for a prompt: .* 128 positions"
    ):
        TransformersEngine(_eval_config(learned_128, max_new_tokens=128)).generate(
            str(learned_128), [LONG_PROMPT]
        )


def _eval_config(model: Path, **kw: Any) -> EvalConfig:
    return EvalConfig(
        model_name_or_path=str(model),
        dataset_name="unused",
        judge_base_url="http://127.0.0.1:9/v1",
        judge_model="unused",
        engine="transformers",
        **kw,
    )
