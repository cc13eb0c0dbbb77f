"""Environments for agents' rollouts (rloo.agents.environments) with TRL's environment_factory contract
(trl/trainer/grpo_trainer.py 1.16: reset(**row) returning None or text appended to the last user message,
public methods as tools, get_reward() as one more reward source named after the class, instances pooled)."""

from __future__ import annotations

import pytest

from rloo.agents.environments import (
    EnvironmentPool,
    environment_rewards,
    load_environment,
    reset_all,
    with_observation,
)
from rloo.agents.tools import ToolCall, run_tool_calls
from rloo.errors import UserError
from tests.agents import toy_envs


def test_an_environment_is_probed_once_and_its_public_methods_are_its_tools() -> None:
    env = load_environment("tests.agents.toy_envs:Counter")
    assert (env.name, env.tool_names, env.owns_reward) == ("Counter", ["add"], True)
    (tool,) = env.tools(toy_envs.Counter())
    assert tool.schema["function"]["parameters"]["properties"]["amount"]["type"] == "integer"
    quiet = load_environment("tests.agents.toy_envs:Quiet")
    assert (quiet.tool_names, quiet.owns_reward) == (["ping"], False)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("tests.agents.toy_envs:NoReset", r"NoReset has no reset method; give it reset\(self, \*\*row\)"),
        ("tests.agents.toy_envs:BadTool", r"^--environment act: the chat template cannot describe it"),
        ("tests.agents.toy_envs:Nope", r"has no attribute 'Nope'"),
    ],
)
def test_an_environment_that_cannot_run_is_refused_in_one_line(spec: str, message: str) -> None:
    with pytest.raises(UserError, match=message) as e:
        load_environment(spec)
    assert "\n" not in str(e.value)


def test_instances_hold_their_state_across_turns_and_score_their_rollout() -> None:
    """Four rollouts, each its own instance (reused by the next batch, reset with its row); the tool calls of
    two turns change each instance's state, and get_reward reads it."""
    env = load_environment("tests.agents.toy_envs:Counter")
    pool = EnvironmentPool(env)
    made = toy_envs.Counter.made
    instances = pool.take(4)
    assert len({id(i) for i in instances}) == 4 and toy_envs.Counter.made == made + 4
    observations = reset_all(instances, [{"target": t, "prompt": "p"} for t in (3, 5, 7, 9)])
    assert observations == [" Reach 3.", " Reach 5.", " Reach 7.", " Reach 9."]
    for turn in (2, 1):  # two turns of one call each, on every rollout
        for inst in instances:
            assert run_tool_calls([ToolCall("add", {"amount": turn})], env.tools(inst), timeout=5) == [
                str(inst.total)
            ]
    assert environment_rewards(instances) == [0.0, -2.0, -4.0, -6.0]
    assert pool.take(2) == instances[:2] and toy_envs.Counter.made == made + 4  # reused, not made again


def test_resets_text_joins_the_last_user_message() -> None:
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "Count."}]
    joined = with_observation(messages, " Reach 3.")
    assert joined[-1] == {"role": "user", "content": "Count. Reach 3."} and joined[0] is messages[0]
    assert messages[-1]["content"] == "Count."  # the dataset's row is left as it was
    assert with_observation(messages, None) is messages
    parts = with_observation([{"role": "user", "content": [{"type": "text", "text": "a"}]}], "b")
    assert parts[-1]["content"] == [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]


def test_an_async_tool_of_an_environment_and_one_without_a_reward() -> None:
    env = load_environment("tests.agents.toy_envs:Quiet")
    (inst,) = EnvironmentPool(env).take(1)
    assert reset_all([inst], [{}]) == [None]
    assert run_tool_calls([ToolCall("ping")], env.tools(inst), timeout=5) == ["pong"]
    assert environment_rewards([inst]) == [None]


def test_an_environment_that_raises_is_one_line_naming_it() -> None:
    from rloo.agents.environments import environment_rewards, reset_all

    env = load_environment("tests.agents.toy_envs:Strict")
    inst = env.factory()
    with pytest.raises(UserError) as e:
        reset_all([inst], [{"prompt": "p"}])
    assert str(e.value) == (
        "--environment Strict: reset raised TypeError: Strict.reset() missing 1 required positional argument: "
        "'answer' (row columns: prompt); make reset accept the dataset's rows."
    )
    with pytest.raises(
        UserError, match=r"^--environment Strict: get_reward raised ValueError: no episode yet; "
    ):
        environment_rewards([inst])
