"""The agent options' one-line refusals (rloo.config.check_agents, check_reward_sources) and the stop token a
turn ends at."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from rloo.agents.environments import load_environment
from rloo.agents.episodes import EpisodeRunner
from rloo.config import ALIASES, RLOOConfig
from rloo.errors import UserError
from rloo.training.trainer import environment_source, stop_token_id


def cfg(**kw: Any) -> RLOOConfig:
    base: dict[str, Any] = {"model_name_or_path": "m", "dataset_name": "d", "output_dir": "o"}
    return RLOOConfig(**{**base, **kw})


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        (
            {"reward_funcs": ["a:b"], "max_tool_calling_iterations": 2},
            "--max_tool_calling_iterations applies to episodes with tools: add --tools or --environment, or drop "
            "--max_tool_calling_iterations.",
        ),
        (
            {"reward_funcs": ["a:b"], "tool_timeout": 5.0},
            "--tool_timeout applies to episodes with tools: add --tools or --environment, or drop --tool_timeout.",
        ),
        (
            {"reward_funcs": ["a:b"], "tools": ["a:f"], "async_generation": True},
            "--async_generation does not run multi-turn episodes yet (their tools and environments run with the "
            "update's weights): drop --async_generation, or --tools/--environment.",
        ),
        (
            {"reward_funcs": ["a:b"], "environment": "a:E", "filter_groups": True},
            "--filter_groups does not resample multi-turn episodes yet: drop --filter_groups, or "
            "--tools/--environment.",
        ),
        (
            {"reward_funcs": ["a:b"], "environment": "a:E", "reward_weights": [1.0, 1.0, 1.0]},
            "--reward_weights has 3 values but there are 1 reward sources (reward model first, then each "
            "--reward_funcs entry, then the --environment's get_reward): give one weight per source.",
        ),
    ],
)
def test_refused_in_one_line(kw: dict[str, Any], message: str) -> None:
    with pytest.raises(UserError) as e:
        cfg(**kw)
    assert str(e.value) == message


def test_an_environment_may_be_the_only_reward_source_and_take_the_last_weight() -> None:
    assert cfg(environment="a:E").environment == "a:E"
    assert cfg(environment="a:E", reward_funcs=["a:b"], reward_weights=[1.0, 2.0]).reward_weights == [
        1.0,
        2.0,
    ]
    assert ALIASES["environment_factory"] == "environment"  # TRL's name


def test_an_environment_without_get_reward_needs_another_source() -> None:
    runner = EpisodeRunner.__new__(EpisodeRunner)  # the environment is all environment_source reads
    runner.environment = load_environment("tests.agents.toy_envs:Quiet")
    with pytest.raises(
        UserError, match="--environment Quiet has no get_reward method and no other reward source"
    ):
        environment_source(runner, others=0)
    assert environment_source(runner, others=1) == []


def test_a_turn_ends_at_eos_with_tools_unless_told_otherwise(tmp_path: Path) -> None:
    class Tok:
        eos_token_id = 7

    assert stop_token_id(cfg(reward_funcs=["a:b"]), Tok()) is None
    assert stop_token_id(cfg(reward_funcs=["a:b"], tools=["a:f"]), Tok()) == 7
    assert stop_token_id(cfg(reward_funcs=["a:b"], tools=["a:f"], stop_token_id=3), Tok()) == 3


def test_the_evaluation_declares_training_s_agent_settings_alike() -> None:
    """``rloo eval`` takes the episode settings under training's names, defaults and rules, so the pipeline
    hands training's values over unchanged (rloo.stages.validate.AGENT_SETTINGS)."""
    import dataclasses
    import typing

    from rloo.eval.config import EvalConfig
    from rloo.stages.validate import AGENT_SETTINGS

    train = {f.name: f for f in dataclasses.fields(RLOOConfig)}
    evaluate = {f.name: f for f in dataclasses.fields(EvalConfig)}
    train_types, eval_types = typing.get_type_hints(RLOOConfig), typing.get_type_hints(EvalConfig)
    for name in AGENT_SETTINGS:
        assert eval_types[name] == train_types[name], name
        assert default(evaluate[name]) == default(train[name]), name


def default(f: Any) -> Any:
    import dataclasses

    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def test_a_class_as_a_tool_a_function_as_an_environment_and_a_name_given_twice_are_refused(
    tmp_path: Path,
) -> None:
    from rloo.agents.episodes import EpisodeRunner
    from rloo.agents.tools import load_tools
    from rloo.demo.tiny import EOS_TOKEN, build_tokenizer

    with pytest.raises(UserError) as e:
        load_tools(["tests.agents.toy_envs:Counter"])
    assert str(e.value) == (
        "--tools tests.agents.toy_envs:Counter is a class; a tool is a function. Give a class whose public methods "
        "are the tools as --environment pkg.module:Class."
    )
    with pytest.raises(UserError, match=r"^--environment tests.agents.toy_tools:multiply is a function; "):
        load_environment("tests.agents.toy_tools:multiply")
    with pytest.raises(
        UserError, match=r"^--tools tests.agents.toy_tools:undocumented: the chat template cannot"
    ):
        load_tools(["tests.agents.toy_tools:undocumented"])
    tok = build_tokenizer(tmp_path / "tok", with_pad_token=True)
    tok.chat_template = "{% for m in messages %}{{ m.role }}: {{ m.content }}" + EOS_TOKEN + "{% endfor %}"
    with pytest.raises(UserError) as e:
        EpisodeRunner(
            tok,
            tools=load_tools(["tests.agents.toy_tools:add"]),
            environment=load_environment("tests.agents.toy_envs:Counter"),
            max_iterations=None,
            tool_timeout=1.0,
            budget=10,
        )
    assert str(e.value) == (
        "--tools and --environment Counter both give a tool named 'add': the model calls tools by name; rename "
        "one, or drop it from --tools."
    )


def test_eval_refuses_episode_settings_without_tools() -> None:
    from rloo.eval.config import EvalConfig

    with pytest.raises(UserError) as e:
        EvalConfig(
            model_name_or_path="m", dataset_name="d", judge_base_url="http://127.0.0.1:1/v1", judge_model="j",
            max_tool_calling_iterations=2,
        )  # fmt: skip
    assert str(e.value) == (
        "--max_tool_calling_iterations applies to episodes with tools: add --tools or --environment, or drop "
        "--max_tool_calling_iterations."
    )
