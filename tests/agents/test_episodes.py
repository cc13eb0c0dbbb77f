"""Multi-turn episodes (rloo.agents.episodes): the loop of turns, tool calls and tool messages over the real tiny
tokenizer and a real chat template, the generator scripted (it is the trainer's own protocol; the real
generators run episodes in tests/agents/test_agent_training.py and tests/vllm_engine).

The tool messages' tokens are found as TRL 1.16 finds them (trl/trainer/grpo_trainer.py,
``_get_tool_suffix_ids``): a dummy conversation rendered with and without them."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from rloo.agents.environments import load_environment
from rloo.agents.episodes import EpisodeRunner, check_template, tool_suffix_ids
from rloo.agents.tools import load_tools
from rloo.demo.tiny import EOS_TOKEN, build_tokenizer
from rloo.errors import UserError
from rloo.generation import Generated, SamplingParams

# every message ends with the EOS token (the stop token of a turn); calls rendered as Hermes blocks
TEMPLATE = (
    "{% for m in messages %}{{ m.role + ': ' + (m.content or '') }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ {'name': c.function.name, 'arguments': c.function.arguments}"
    " | tojson }}</tool_call>{% endfor %}" + EOS_TOKEN + "{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Any:
    t = build_tokenizer(tmp_path_factory.mktemp("tok"), with_pad_token=True)
    t.chat_template = TEMPLATE
    return t


class Scripted:
    """A generator whose next turn is a function of the context's text; it records every call."""

    should_stop = None
    weights_version = None

    def __init__(self, tok: Any, script: Callable[[str, int], str]) -> None:
        self.tok, self.script, self.calls = tok, script, []  # type: list[tuple[int, list[int]]]

    def sync_weights(self) -> None:
        pass

    def generate(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        k: int,
        params: SamplingParams,
        seeds: torch.Tensor,
        *,
        return_logprobs: bool = False,
    ) -> Generated:
        rows = []
        for i in range(prompt_ids.size(0)):
            context = self.tok.decode(prompt_ids[i][prompt_mask[i].bool()].tolist())
            for j in range(k):
                ids = [*self.tok.encode(self.script(context, j)), self.tok.eos_token_id]
                rows.append(ids[: params.max_new_tokens])
        self.calls.append((k, seeds.tolist()))
        width = max(len(r) for r in rows)
        tokens = torch.full((len(rows), width), params.pad_token_id)
        for i, r in enumerate(rows):
            tokens[i, : len(r)] = torch.tensor(r)
        logprobs = torch.full(tokens.shape, -0.5) if return_logprobs else None
        return Generated(tokens=tokens, logprobs=logprobs)


def call(name: str, **arguments: Any) -> str:
    import json

    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def params(tok: Any, n: int = 200) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, stop_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)


def runner(tok: Any, **kw: Any) -> EpisodeRunner:
    base: dict[str, Any] = dict(
        tools=load_tools(["tests.agents.toy_tools:multiply", "tests.agents.toy_tools:wait"]),
        environment=None,
        max_iterations=None,
        tool_timeout=0.5,
        budget=200,
    )
    base.update(kw)
    return EpisodeRunner(tok, **base)


def prompt(tok: Any, text: str) -> list[int]:
    return tok.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, return_dict=False
    )


def test_tool_message_tokens_are_the_template_rendering_after_the_turn(tok: Any) -> None:
    suffix = tool_suffix_ids(tok, [{"role": "tool", "name": "multiply", "content": "42"}])
    assert tok.decode(suffix) == "tool: 42" + EOS_TOKEN + "assistant:"
    check_template(tok)  # the template keeps earlier turns and renders tool messages


def test_an_episode_is_the_sampled_turns_and_the_tool_messages_in_order(tok: Any) -> None:
    def script(context: str, j: int) -> str:
        if "tool: 42" in context:
            return " it is 42"
        return call("multiply", a=6, b=7) if j == 0 else " no idea"

    gen = Scripted(tok, script)
    seeds = torch.tensor([11, 12])
    out = runner(tok).run(gen, [prompt(tok, "six times seven?")], 2, params(tok), seeds, return_logprobs=True)
    ep = out.episodes
    assert ep is not None
    turn1 = [*tok.encode(call("multiply", a=6, b=7)), tok.eos_token_id]
    suffix = tool_suffix_ids(tok, [{"role": "tool", "name": "multiply", "content": "42"}])
    turn2 = [*tok.encode(" it is 42"), tok.eos_token_id]
    n = len(turn1) + len(suffix) + len(turn2)
    assert out.tokens[0, :n].tolist() == turn1 + suffix + turn2
    assert ep.policy_mask[0, :n].tolist() == [True] * len(turn1) + [False] * len(suffix) + [True] * len(turn2)
    assert not ep.policy_mask[0, n:].any()
    assert out.logprobs is not None and (out.logprobs[0, : len(turn1)] == -0.5).all()
    assert (out.logprobs[0, len(turn1) : len(turn1) + len(suffix)] == 0).all()  # not sampled
    # the second episode answered at once: one turn, no calls
    assert (
        ep.turns.tolist() == [2, 1] and ep.tool_calls.tolist() == [1, 0] and ep.tool_errors.tolist() == [0, 0]
    )
    assert ep.finished.tolist() == [True, True]
    assert [m["role"] for m in ep.messages[0]] == ["assistant", "tool", "assistant"]
    assert ep.messages[0][0]["tool_calls"][0]["function"] == {
        "name": "multiply",
        "arguments": {"a": 6, "b": 7},
    }
    assert ep.messages[0][1] == {"role": "tool", "name": "multiply", "content": "42"}
    # the second turn: one completion of the one episode that called, on the exact tokens so far, other seeds
    assert [k for k, _ in gen.calls] == [2, 1]
    assert gen.calls[1][1] != [11]


def test_iterations_budget_errors_and_hanging_tools_end_episodes_cleanly(tok: Any) -> None:
    always = Scripted(tok, lambda context, j: call("multiply", a=2, b=2))
    out = runner(tok, max_iterations=2).run(
        always, [prompt(tok, "go")], 1, params(tok), torch.tensor([1]), return_logprobs=False
    )
    assert out.episodes is not None
    assert out.episodes.turns.tolist() == [3] and out.episodes.tool_calls.tolist() == [
        2
    ]  # 2 rounds, then stop
    assert out.logprobs is None
    # a budget that the tool message would overflow ends the episode before it
    small = runner(tok, budget=len(tok.encode(call("multiply", a=2, b=2))) + 3)
    out = small.run(always, [prompt(tok, "go")], 1, params(tok), torch.tensor([1]), return_logprobs=False)
    assert out.episodes is not None and out.episodes.turns.tolist() == [1]
    assert [m["role"] for m in out.episodes.messages[0]] == ["assistant"]
    # a tool that raises, one that hangs, an unknown one: error messages to the model, counted
    bad = Scripted(
        tok,
        lambda context, j: (
            " done" if "tool:" in context else call("multiply", a=1) + call("wait", seconds=30) + call("nope")
        ),
    )
    out = runner(tok, budget=2000).run(
        bad, [prompt(tok, "go")], 1, params(tok, 2000), torch.tensor([1]), return_logprobs=False
    )
    assert out.episodes is not None
    assert out.episodes.tool_errors.tolist() == [3] and out.episodes.tool_calls.tolist() == [3]
    contents = [m["content"] for m in out.episodes.messages[0] if m["role"] == "tool"]
    assert contents[1] == "error: wait did not return within 0.5 s"
    # a turn cut by the budget is not finished and its calls are not run
    cut = runner(tok, budget=5).run(
        always, [prompt(tok, "go")], 1, params(tok), torch.tensor([1]), return_logprobs=False
    )
    assert (
        cut.episodes is not None
        and cut.episodes.finished.tolist() == [False]
        and cut.episodes.tool_calls.tolist() == [0]
    )
    assert cut.tokens.size(1) == 5


def test_an_environment_holds_state_across_turns_and_owns_the_reward(tok: Any) -> None:
    env = load_environment("tests.agents.toy_envs:Counter")

    def script(context: str, j: int) -> str:
        turns = context.count("tool:")
        return call("add", amount=3 + j) if turns < 2 else " done"

    gen = Scripted(tok, script)
    r = runner(tok, tools=[], environment=env)
    chat = [{"role": "user", "content": "count"}]
    out = r.run(
        gen,
        [prompt(tok, "count")],
        2,
        params(tok),
        torch.tensor([1, 2]),
        return_logprobs=False,
        prompts=[chat],
        rows=[{"target": 7}],
    )
    ep = out.episodes
    assert ep is not None
    # reset's text joins the prompt the episodes saw, rendered with the environment's tools
    assert ep.prompts[0] == [{"role": "user", "content": "count Reach 7."}]
    assert "count Reach 7." in tok.decode(ep.prompt_ids[0])
    # each episode on its own instance: episode 0 adds 3 twice, episode 1 adds 4 then 3 (a later turn is the
    # scripted generator's sample 0)
    assert [m["content"] for m in ep.messages[0] if m["role"] == "tool"] == ["3", "6"]
    assert [m["content"] for m in ep.messages[1] if m["role"] == "tool"] == ["4", "7"]
    assert ep.env_rewards == [-1.0, 0.0]


def test_templates_that_cannot_hold_episodes_are_refused_in_one_line(tok: Any, tmp_path: Path) -> None:
    plain = build_tokenizer(tmp_path / "plain")  # its "role: content" template has no end-of-turn token...
    plain.chat_template = "{% for m in messages %}{% if m.role != 'tool' %}{{ m.role }}: {{ m.content }}\n{% endif %}{% endfor %}"
    with pytest.raises(UserError, match="drops tool messages"):
        check_template(plain)
    plain.chat_template = None
    with pytest.raises(UserError, match="need a chat template"):
        check_template(plain)
    plain.chat_template = "{{ raise_exception('Conversation roles must alternate') }}"
    with pytest.raises(UserError, match=r"cannot render tool messages .*roles must alternate"):
        check_template(plain)
