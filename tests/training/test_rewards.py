"""Reward sources: user reward functions (loading, calling, validating) and the reward model."""

from __future__ import annotations

import contextlib
import math
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from rloo.demo import toy
from rloo.demo.tiny import EOS_TOKEN, TinySetup
from rloo.errors import UserError
from rloo.models import last_token_scores, load_reward_model
from rloo.training.rewards import (
    RewardBatch,
    RewardFunctionSource,
    RewardModelSource,
    TrainerState,
    load_reward_function,
    score_all,
)

PLUGIN = """
import math

CALLS = []
NOT_CALLABLE = 3


def record(prompts, completions, completion_ids, trainer_state, **extra):
    CALLS.append(dict(prompts=prompts, completions=completions, completion_ids=completion_ids,
                      trainer_state=trainer_state, **extra))
    return [float(len(c)) for c in completions]


def explode(completions, **kwargs):
    return {"x": 1}[completions[0]]


def halves(completions, **kwargs):
    return [0.5] * len(completions)
"""


@pytest.fixture
def plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A module ``rloo_test_plugin`` (and a package ``rloo_test_pkg.sub``) importable for this test only."""
    name = "rloo_test_plugin"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(PLUGIN))
    (tmp_path / "rloo_test_pkg").mkdir()
    (tmp_path / "rloo_test_pkg" / "__init__.py").write_text("")
    (tmp_path / "rloo_test_pkg" / "sub.py").write_text("def fn(completions, **kw):\n    return [1.0]\n")
    (tmp_path / "rloo_test_broken.py").write_text("import no_such_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for mod in (name, "rloo_test_pkg", "rloo_test_pkg.sub", "rloo_test_broken"):
        monkeypatch.delitem(sys.modules, mod, raising=False)
    return name


def batch(n: int = 4, **extra: list[Any]) -> RewardBatch:
    prompts = [f"prompt {i // 2}" for i in range(n)]
    completions = [" aeiou" * (i + 1) for i in range(n)]
    return RewardBatch(
        prompts=prompts,
        prompt_texts=prompts,
        completions=completions,
        completion_texts=completions,
        completion_ids=[[1] * (i + 1) for i in range(n)],
        scoring_texts=[p + c for p, c in zip(prompts, completions, strict=True)],
        extra=extra,
        trainer_state=TrainerState(global_step=3, max_steps=10, episode=12, epoch=0.5),
    )


# --- load_reward_function ------------------------------------------------------------------------------
def test_load_reward_function_variants(plugin: str) -> None:
    assert load_reward_function("rloo.demo.toy:letter_reward") is toy.letter_reward
    assert load_reward_function("rloo.demo.toy.letter_reward") is toy.letter_reward  # dotted form
    fn = load_reward_function(f"{plugin}:halves")
    assert fn(completions=["a", "b"]) == [0.5, 0.5]
    assert load_reward_function("rloo_test_pkg.sub:fn")(completions=["x"]) == [1.0]
    assert load_reward_function("rloo_test_pkg.sub.fn") is load_reward_function("rloo_test_pkg.sub:fn")


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("justaname", "is not an import path: write 'pkg.module:function'"),
        (":fn", "is not an import path"),
        ("rloo.demo.toy:", "is not an import path"),
        ("no_such_module_xyz:fn", "cannot import module 'no_such_module_xyz'.*PYTHONPATH"),
        ("rloo_test_broken:fn", "cannot import module 'rloo_test_broken' \\(ModuleNotFoundError"),
        ("rloo_test_plugin:nope", "module 'rloo_test_plugin' has no attribute 'nope'; check the name"),
        ("rloo_test_plugin:NOT_CALLABLE", "'NOT_CALLABLE' is an int, not a function"),
    ],
)
def test_load_reward_function_errors(plugin: str, spec: str, match: str) -> None:
    with pytest.raises(UserError, match=match) as info:
        load_reward_function(spec)
    assert str(info.value).startswith("--reward_funcs")
    assert "\n" not in str(info.value)


# --- RewardFunctionSource --------------------------------------------------------------------------------
def test_reward_function_called_trl_style_with_extra_columns(plugin: str) -> None:
    src = RewardFunctionSource(f"{plugin}:record")
    assert src.name == "record"
    b = batch(4, target=["a", "e", "i", "o"])
    out = src(b)
    torch.testing.assert_close(out, torch.tensor([6.0, 12.0, 18.0, 24.0]))
    (call,) = sys.modules[plugin].CALLS
    assert call["prompts"] == b.prompts
    assert call["completions"] == b.completions
    assert call["completion_ids"] == b.completion_ids
    assert call["trainer_state"].global_step == 3 and call["trainer_state"].max_steps == 10
    assert call["target"] == ["a", "e", "i", "o"]


def test_toy_rewards_through_the_source() -> None:
    b = batch(2, target=["a", "u"])
    torch.testing.assert_close(
        RewardFunctionSource("rloo.demo.toy:letter_reward")(b), torch.tensor([1.0, 1.0])
    )
    # " aeiou" has one 'a' among five letters: 1/5 for target "a"
    torch.testing.assert_close(
        RewardFunctionSource("rloo.demo.toy:target_letter_reward")(b), torch.tensor([0.2, 0.2])
    )


def test_reward_function_that_raises(plugin: str) -> None:
    with pytest.raises(UserError) as info:
        RewardFunctionSource(f"{plugin}:explode")(batch(2))
    msg = str(info.value)
    assert msg.startswith(f"--reward_funcs {plugin}:explode raised KeyError")
    assert f"{plugin}.py:" in msg  # where it raised
    assert "\n" not in msg


@pytest.mark.parametrize(
    ("out", "expected"),
    [
        ([1, 2.5, None, -3], [1.0, 2.5, math.nan, -3.0]),
        ((0.0, 1.0, 2.0, 3.0), [0.0, 1.0, 2.0, 3.0]),
        (np.array([0.5, 1.5, 2.5, 3.5], dtype=np.float32), [0.5, 1.5, 2.5, 3.5]),
        (np.arange(4), [0.0, 1.0, 2.0, 3.0]),
        ([np.float32(1.0), np.int64(2), np.float64(3.0), None], [1.0, 2.0, 3.0, math.nan]),
        (torch.tensor([4.0, 3.0, 2.0, 1.0], requires_grad=True), [4.0, 3.0, 2.0, 1.0]),
        ([None] * 4, [math.nan] * 4),
    ],
)
def test_validate_accepts(out: Any, expected: list[float]) -> None:
    src = RewardFunctionSource("rloo.demo.toy:letter_reward")
    got = src.validate(out, 4)
    assert got.dtype == torch.float32 and got.shape == (4,)
    torch.testing.assert_close(got, torch.tensor(expected), equal_nan=True)


@pytest.mark.parametrize(
    ("out", "match"),
    [
        (1.0, "returned a float; return a list"),
        ({"a": 1.0}, "returned a dict; return a list"),
        ("1234", "returned a str; return a list"),
        (None, "returned a NoneType; return a list"),
        ([1.0, 2.0, 3.0], "returned 3 values for 4 completions"),
        (np.zeros(5), "returned 5 values for 4 completions"),
        ([1.0, "2", 3.0, 4.0], "returned a str for completion 1"),
        ([1.0, 2.0, True, 4.0], "returned a bool for completion 2"),
        ([1.0, 2.0, 3.0, [4.0]], "returned a list for completion 3"),
        ([1.0, math.nan, 3.0, 4.0], r"non-finite reward \(nan\) for completion 1"),
        ([1.0, 2.0, -math.inf, 4.0], r"non-finite reward \(-inf\) for completion 2"),
        (np.array([1.0, np.inf, 0.0, 0.0]), r"non-finite reward \(inf\) for completion 1"),
    ],
)
def test_validate_rejects(out: Any, match: str) -> None:
    src = RewardFunctionSource("rloo.demo.toy:letter_reward")
    with pytest.raises(UserError, match=match) as info:
        src.validate(out, 4)
    assert str(info.value).startswith("--reward_funcs rloo.demo.toy:letter_reward returned")


def test_score_all_stacks_sources(plugin: str) -> None:
    b = batch(3)
    scores = score_all(
        [RewardFunctionSource(f"{plugin}:halves"), RewardFunctionSource(f"{plugin}:record")], b
    )
    torch.testing.assert_close(scores, torch.tensor([[0.5, 6.0], [0.5, 12.0], [0.5, 18.0]]))


# --- reward model ------------------------------------------------------------------------------------------
TEXTS = [
    "user: Write about the sea:\n\nassistant: the sea is blue",
    "Hello" + EOS_TOKEN,  # ends with eos == pad: the model's own pooling would look in the wrong place
    "aeiou eau oo",
    "The old man watches the stars at night. The river reaches the sea." + EOS_TOKEN + EOS_TOKEN,
    "a",
]


@pytest.fixture(scope="module")
def reward_model(tiny_setup: TinySetup) -> tuple[Any, Any]:
    return load_reward_model(str(tiny_setup.reward_model))


def source(model: Any, tok: Any, batch_size: int = 64) -> RewardModelSource:
    return RewardModelSource(
        model, tok, batch_size=batch_size, device=torch.device("cpu"), autocast=contextlib.nullcontext
    )


def test_reward_model_scores_are_padding_invariant(reward_model: tuple[Any, Any]) -> None:
    model, tok = reward_model
    src = source(model, tok)
    batched = src.score_texts(TEXTS)
    alone = torch.cat([src.score_texts([t]) for t in TEXTS])
    assert batched.shape == (len(TEXTS),)
    torch.testing.assert_close(batched, alone, atol=1e-5, rtol=1e-5)
    # the batch really was padded, and the scores are not all the same number
    lengths = [len(tok(t, add_special_tokens=False)["input_ids"]) for t in TEXTS]
    assert len(set(lengths)) > 1
    assert batched.unique().numel() == len(TEXTS)
    # smaller forward batches give the same scores
    torch.testing.assert_close(
        source(model, tok, batch_size=2).score_texts(TEXTS), batched, atol=1e-5, rtol=0
    )


def test_last_token_scores_equals_the_head_on_the_last_token(reward_model: tuple[Any, Any]) -> None:
    model, tok = reward_model
    for text in TEXTS:
        ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
        # unpadded single row: the classifier's per-position logits at the last position
        hidden = getattr(model, model.base_model_prefix)(input_ids=ids).last_hidden_state
        expected = model.score(hidden)[0, -1, 0]
        got = last_token_scores(model, ids, torch.ones_like(ids))
        torch.testing.assert_close(got, expected.reshape(1), atol=1e-5, rtol=1e-5)
    # right padding with pad == eos: appending pads with a zero mask changes nothing
    ids = torch.tensor([tok(TEXTS[2], add_special_tokens=False)["input_ids"]])
    pad = torch.full((1, 3), tok.pad_token_id)
    padded = torch.cat([ids, pad], 1)
    mask = torch.cat([torch.ones_like(ids), torch.zeros_like(pad)], 1)
    torch.testing.assert_close(
        last_token_scores(model, padded, mask),
        last_token_scores(model, ids, torch.ones_like(ids)),
        atol=1e-5,
        rtol=0,
    )


class SpyTokenizer:
    """Delegates to a real tokenizer and records the texts it was asked to encode."""

    def __init__(self, tok: Any) -> None:
        self.__dict__["_tok"] = tok
        self.__dict__["seen"] = []

    def __call__(self, texts: list[str], **kw: Any) -> Any:
        self.seen.extend(texts)
        return self._tok(texts, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tok, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._tok, name, value)


def test_reward_model_reads_text_with_its_own_tokenizer(reward_model: tuple[Any, Any]) -> None:
    model, tok = reward_model
    spy = SpyTokenizer(tok)
    src = source(model, spy)
    b = batch(4)
    b.completion_ids = [[10**6, -5]] * 4  # the policy's ids are never fed to the reward model
    scores = src(b)
    assert spy.seen == b.scoring_texts
    torch.testing.assert_close(scores, source(model, tok).score_texts(b.scoring_texts))


def test_reward_model_truncates_on_the_left(tiny_setup: TinySetup) -> None:
    model, tok = load_reward_model(str(tiny_setup.reward_model))
    text = TEXTS[3]
    ids = tok(text, add_special_tokens=False)["input_ids"]
    tok.model_max_length = 6
    src = source(model, tok)
    assert tok.truncation_side == "left"
    tail = torch.tensor([ids[-6:]])
    torch.testing.assert_close(
        src.score_texts([text]), last_token_scores(model, tail, torch.ones_like(tail)), atol=1e-5, rtol=0
    )


def test_reward_model_non_finite_score_is_a_user_error(tiny_setup: TinySetup) -> None:
    model, tok = load_reward_model(str(tiny_setup.reward_model))
    with torch.no_grad():
        model.score.weight.fill_(math.nan)
    with pytest.raises(UserError, match="--reward_model_path produced a non-finite score for completion 0"):
        source(model, tok)(batch(2))


@pytest.mark.parametrize("spec", ["rloo.demo.toy", "rloo.demo"])
def test_a_module_without_its_function_says_how_to_name_it(spec: str) -> None:
    """``pkg.module`` alone (TRL's ``reward_funcs`` takes a callable, CLI users write the module): the dotted
    form reads it as ``pkg:module``, so the error must say a function is missing, not that ``pkg`` lacks an
    attribute (CPython ``Lib/importlib/__init__.py``: a submodule is an attribute only once imported)."""
    with pytest.raises(
        UserError, match=f"^--reward_funcs {spec} names a module, not a function: write '{spec}:function'"
    ):
        load_reward_function(spec)
