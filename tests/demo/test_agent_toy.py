"""Tests for rloo.demo.agent_toy: the chat template, the calculator tool, the dataset, the reward and the
warm-started model that sometimes calls the tool."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import get_json_schema

from rloo.agents.tools import parse_tool_calls
from rloo.demo.agent_toy import (
    AGENT_CHAT_TEMPLATE,
    TOOL_CALL_TOKENS,
    add,
    build_agent_sft_model,
    build_agent_tokenizer,
    tool_use_reward,
    write_agent_toy_dataset,
)
from rloo.demo.tiny import EOS_TOKEN, build_tokenizer

TRAIN = "data/train-00000-of-00001.parquet"
TEST = "data/test-00000-of-00001.parquet"
CALL = '<tool_call>{"name": "add", "arguments": {"a": 3, "b": 4}}</tool_call>'


def _call(a: Any = 3, b: Any = 4) -> dict[str, Any]:
    return {"type": "function", "function": {"name": "add", "arguments": {"a": a, "b": b}}}


def _ids(tokenizer: Any, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
    out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs)
    return list(out["input_ids"] if isinstance(out, dict) else out)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return build_agent_tokenizer(tmp_path_factory.mktemp("agent") / "tokenizer")


@pytest.fixture(scope="module")
def plain_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """rloo.demo.tiny's own tokenizer, given the agent template: the template needs none of the extra tokens."""
    tok = build_tokenizer(tmp_path_factory.mktemp("plain") / "tokenizer")
    tok.chat_template = AGENT_CHAT_TEMPLATE
    return tok


@pytest.mark.parametrize("which", ["tokenizer", "plain_tokenizer"])
@pytest.mark.parametrize("tool_name", ["add", "probe"])
def test_template_is_prefix_preserving(request: pytest.FixtureRequest, which: str, tool_name: str) -> None:
    # What a trainer does to find the tokens it appends after a model's turn (TRL's _get_tool_suffix_ids):
    # render a dummy turn with and without the tool message, cut the first at its last EOS, take the rest.
    tok = request.getfixturevalue(which)
    calls = [{"type": "function", "function": {"name": tool_name, "arguments": {}}}]
    dummy: list[dict[str, Any]] = [
        {"role": "user", "content": "dummy"},
        {"role": "assistant", "content": "", "tool_calls": calls},
    ]
    prefix = _ids(tok, dummy, add_generation_prompt=False)
    full = _ids(
        tok, [*dummy, {"role": "tool", "name": tool_name, "content": "7"}], add_generation_prompt=True
    )
    assert prefix[-1] == tok.eos_token_id  # nothing after the turn's EOS to cut
    assert full[: len(prefix)] == prefix
    assert tok.decode(full[len(prefix) :]) == f"tool: 7{EOS_TOKEN}assistant:"


def test_trl_accepts_the_template(tokenizer: Any) -> None:
    trl_templates = pytest.importorskip("trl.chat_template_utils")
    assert trl_templates.is_chat_template_prefix_preserving(tokenizer)
    assert trl_templates.supports_tool_calling(tokenizer)


def test_tool_schema_and_rendering(tokenizer: Any) -> None:
    schema = get_json_schema(add)
    assert schema["function"]["name"] == "add"
    assert list(schema["function"]["parameters"]["properties"]) == ["a", "b"]
    assert schema["function"]["parameters"]["required"] == ["a", "b"]
    assert add(3, 4) == 7
    question = [{"role": "user", "content": "add 3 and 4"}]
    text = tokenizer.apply_chat_template(question, tools=[schema], add_generation_prompt=True, tokenize=False)
    assert text == f"system: tools: add(a, b){EOS_TOKEN}user: add 3 and 4{EOS_TOKEN}assistant:"
    assert tokenizer.apply_chat_template(question, tokenize=False) == f"user: add 3 and 4{EOS_TOKEN}"
    # transformers turns a function into its schema itself; several tools share the line
    two = tokenizer.apply_chat_template(question, tools=[add, schema], tokenize=False)
    assert two.startswith(f"system: tools: add(a, b), add(a, b){EOS_TOKEN}")
    episode = [
        *question,
        {"role": "assistant", "content": "", "tool_calls": [_call()]},
        {"role": "tool", "name": "add", "content": "7"},
        {"role": "assistant", "content": "7"},
    ]
    assert tokenizer.apply_chat_template(episode, tokenize=False) == (
        f"user: add 3 and 4{EOS_TOKEN}assistant: {CALL}{EOS_TOKEN}tool: 7{EOS_TOKEN}assistant: 7{EOS_TOKEN}"
    )


def test_tool_call_tokens(tokenizer: Any) -> None:
    for token in TOOL_CALL_TOKENS:
        (token_id,) = tokenizer(token, add_special_tokens=False)["input_ids"]
        assert tokenizer.decode([token_id], skip_special_tokens=True) == token  # text, not a special token
    assert tokenizer.pad_token == "<|pad|>" and tokenizer.pad_token_id != tokenizer.eos_token_id
    (call,) = parse_tool_calls(tokenizer.decode(tokenizer(" " + CALL)["input_ids"]))
    assert (call.name, call.arguments, call.error) == ("add", {"a": 3, "b": 4}, None)


def test_assistant_mask_is_the_model_turns(tokenizer: Any) -> None:
    # the tokens a warm start trains on: each turn after "assistant:", its EOS included
    episode = [
        {"role": "user", "content": "add 3 and 4"},
        {"role": "assistant", "content": "", "tool_calls": [_call()]},
        {"role": "tool", "name": "add", "content": "7"},
        {"role": "assistant", "content": "7"},
    ]
    out = tokenizer.apply_chat_template(
        episode, tools=[get_json_schema(add)], return_dict=True, return_assistant_tokens_mask=True
    )
    ids, mask = out["input_ids"], out["assistant_masks"]
    trained = [t for t, m in zip(ids, mask, strict=True) if m]
    assert tokenizer.decode(trained) == f" {CALL}{EOS_TOKEN} 7{EOS_TOKEN}"


def test_a_sampled_turn_renders_as_sampled(tokenizer: Any) -> None:
    # a runner keeps the turn's decoded text (leading space and call included) and adds the parsed calls
    prompt = [{"role": "user", "content": "add 3 and 4"}]
    prompt_ids = _ids(tokenizer, prompt, add_generation_prompt=True)
    turn = tokenizer(" " + CALL)["input_ids"] + [tokenizer.eos_token_id]
    text = tokenizer.decode(turn[:-1])
    message = {"role": "assistant", "content": text, "tool_calls": [_call()]}
    assert _ids(tokenizer, [*prompt, message]) == prompt_ids + turn


def test_dataset_rows(tmp_path: Path) -> None:
    path = write_agent_toy_dataset(tmp_path / "ds", num_train=40, num_test=6, seed=1)
    assert path == tmp_path / "ds"
    assert sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file()) == [TEST, TRAIN]
    train, test = pq.read_table(path / TRAIN), pq.read_table(path / TEST)
    assert (train.num_rows, test.num_rows) == (40, 6)
    message = pa.struct([("role", pa.string()), ("content", pa.string())])
    assert train.schema == pa.schema([("prompt", pa.list_(message)), ("answer", pa.string())])
    for row in train.to_pylist() + test.to_pylist():
        ((role, content),) = [(m["role"], m["content"]) for m in row["prompt"]]
        verb, a, conj, b = content.split()
        assert (role, verb, conj) == ("user", "add", "and")
        assert 0 <= int(a) <= 9 and 0 <= int(b) <= 9
        assert row["answer"] == str(int(a) + int(b))
    assert len({r["answer"] for r in train.to_pylist()}) > 5
    again = write_agent_toy_dataset(tmp_path / "again", num_train=40, num_test=6, seed=1)
    assert pq.read_table(again / TRAIN).equals(train)
    with pytest.raises(ValueError):
        write_agent_toy_dataset(tmp_path / "bad", num_test=0)


def test_reward() -> None:
    def episode(*results: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = [{"role": "assistant", "content": f" {CALL}", "tool_calls": [_call()]}]
        out += [{"role": "tool", "name": "add", "content": r} for r in results]
        return [*out, {"role": "assistant", "content": " 7"}]

    completions: list[Any] = [
        episode("7"),  # the right sum
        episode("error: add raised TypeError: bad operand", "7"),  # a retry that got there
        episode("8"),  # a call with the wrong numbers
        episode("error: the tool call is not valid JSON"),  # only a failed call
        [{"role": "assistant", "content": " 7"}],  # answered without the tool, even rightly
        " 7",  # a single-turn completion
        [],
    ]
    assert tool_use_reward(completions, answer=["7"] * 7, prompts=None, trainer_state=None) == [
        1.0,
        1.0,
        0.5,
        0.0,
        0.0,
        0.0,
        0.0,
    ]
    with pytest.raises(ValueError):
        tool_use_reward([" 7"], answer=["7", "8"])


@pytest.fixture(scope="module")
def sft_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_agent_sft_model(tmp_path_factory.mktemp("sft") / "model", seed=0)


def test_sft_model_folder(sft_model: Path) -> None:
    tok = AutoTokenizer.from_pretrained(str(sft_model))
    assert tok.chat_template == AGENT_CHAT_TEMPLATE
    assert tok.pad_token == "<|pad|>" and tok.eos_token == EOS_TOKEN
    model = AutoModelForCausalLM.from_pretrained(str(sft_model))
    assert model.config.model_type == "qwen2"
    assert model.config.vocab_size == len(tok)


def test_sft_model_sometimes_calls_the_tool(sft_model: Path) -> None:
    tok: Any = AutoTokenizer.from_pretrained(str(sft_model))
    model = AutoModelForCausalLM.from_pretrained(str(sft_model)).eval()
    tools: list[Any] = [get_json_schema(add)]
    called = direct = 0
    for a, b in [(3, 4), (0, 9), (6, 2)]:
        question = [{"role": "user", "content": f"add {a} and {b}"}]
        inputs: Any = tok.apply_chat_template(
            question, tools=tools, add_generation_prompt=True, return_dict=True, return_tensors="pt"
        )
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(a * 10 + b)
            out = model.generate(
                **inputs,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=64,  # a call is 47 tokens with its EOS
                num_return_sequences=32,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id,
            )
        for row in out[:, inputs["input_ids"].shape[1] :].tolist():
            ended = tok.eos_token_id in row
            text = tok.decode(row[: row.index(tok.eos_token_id)] if ended else row)
            calls = parse_tool_calls(text)
            if text.lstrip().startswith("<tool_call>"):
                called += ended and len(calls) == 1 and calls[0].name == "add" and calls[0].error is None
            else:
                direct += 1
    assert called >= 1, "no well-formed call to add in 96 samples"
    assert direct >= 1, "every sample called the tool: nothing left for RL to improve"
