"""Tools for agents' rollouts (rloo.agents.tools): schemas from plain functions through transformers' own
conversion, the model's tool calls read from a completion (the Hermes ``<tool_call>`` format that Qwen2.5's
template renders, round-tripped through a real chat template here), and the calls run so that no tool can
crash or stall a run."""

from __future__ import annotations

import json
import time

import pytest

from rloo.agents.tools import (
    ToolCall,
    as_text,
    load_tools,
    parse_tool_calls,
    run_tool_calls,
    tool_from_function,
)
from rloo.errors import UserError
from tests.agents import toy_tools

# The tool-calling part of Qwen2.5's chat template (its tool list in the system turn, each call of an
# assistant turn as a <tool_call> block of JSON, tool results as <tool_response> blocks in a user turn)
HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools><|im_end|>\n{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}<|im_start|>assistant\n{{ message.content or '' }}"
    "{%- for call in message.tool_calls or [] %}\n<tool_call>\n"
    '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}'
    "\n</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n"
    "</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}"
)


def test_a_functions_schema_is_what_the_chat_template_shows() -> None:
    tool = tool_from_function(toy_tools.multiply)
    assert tool.name == "multiply"
    assert tool.schema["function"]["description"] == "Multiply two integers."
    params = tool.schema["function"]["parameters"]
    assert params["properties"]["a"] == {"type": "integer", "description": "The first factor."}
    assert params["required"] == ["a", "b"]


def test_tools_load_by_import_path_and_bad_ones_are_one_line() -> None:
    tools = load_tools(["tests.agents.toy_tools:multiply", "tests.agents.toy_tools:lookup"])
    assert [t.name for t in tools] == ["multiply", "lookup"]
    for specs, message in [
        (
            ["tests.agents.toy_tools:undocumented"],
            r"^--tools tests.agents.toy_tools:undocumented: the chat template cannot describe it",
        ),
        (["tests.agents.toy_tools:nope"], r"has no attribute 'nope'"),
        (["no_such_pkg.mod:fn"], r"cannot import module 'no_such_pkg.mod'"),
        (["tests.agents.toy_tools:multiply"] * 2, r"are both named 'multiply'"),
    ]:
        with pytest.raises(UserError, match=message) as e:
            load_tools(specs)
        assert "\n" not in str(e.value)


def test_calls_rendered_by_a_real_chat_template_are_read_back(tiny_setup) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_setup.policy))
    tok.chat_template = HERMES_TEMPLATE
    calls = [
        {"type": "function", "function": {"name": "multiply", "arguments": {"a": 6, "b": 7}}},
        {"type": "function", "function": {"name": "lookup", "arguments": {"key": "x y"}}},
    ]
    text = tok.apply_chat_template(
        [
            {"role": "user", "content": "6 x 7?"},
            {"role": "assistant", "content": "Let me compute.", "tool_calls": calls},
        ],
        tools=[toy_tools.multiply, toy_tools.lookup],
        tokenize=False,
    )
    assert '"name": "multiply"' in text.split("</tools>")[0]  # the schema reached the template
    assistant = text.split("<|im_start|>assistant\n")[1]
    assert parse_tool_calls(assistant) == [
        ToolCall("multiply", {"a": 6, "b": 7}),
        ToolCall("lookup", {"key": "x y"}),
    ]
    assert parse_tool_calls("The answer is 42.") == []


@pytest.mark.parametrize(
    ("block", "error"),
    [
        ('{"name": "multiply", "arguments": {"a": 1,', "not valid JSON"),
        ('["multiply"]', "must be a JSON object"),
        ('{"arguments": {}}', "has no 'name'"),
        ('{"name": "multiply", "arguments": "{bad"}', "arguments are not valid JSON"),
        ('{"name": "multiply", "arguments": [1, 2]}', "must be a JSON object"),
    ],
)
def test_a_malformed_call_is_an_error_for_the_model_not_an_exception(block: str, error: str) -> None:
    (call,) = parse_tool_calls(f"<tool_call>\n{block}\n</tool_call>")
    assert call.error is not None and error in call.error
    (message,) = run_tool_calls([call], load_tools(["tests.agents.toy_tools:multiply"]), timeout=5)
    assert message.startswith("error: ") and error in message


def test_arguments_given_as_a_json_string_are_read() -> None:
    (call,) = parse_tool_calls(
        '<tool_call>{"name": "multiply", "arguments": "{\\"a\\": 2, \\"b\\": 3}"}</tool_call>'
    )
    assert call == ToolCall("multiply", {"a": 2, "b": 3})


def test_calls_run_concurrently_and_no_tool_crashes_or_stalls_the_batch() -> None:
    tools = load_tools(
        [f"tests.agents.toy_tools:{name}" for name in ("multiply", "lookup", "divide", "wait", "opaque")]
    )
    calls = [
        ToolCall("multiply", {"a": 6, "b": 7}),
        ToolCall("lookup", {"key": "abc"}),  # async
        ToolCall("divide", {"a": 1, "b": 0}),  # raises
        ToolCall("wait", {"seconds": 3}),  # hangs past the timeout
        ToolCall("opaque"),  # returns what JSON cannot hold
        ToolCall("nope", {}),
        ToolCall("multiply", {"a": 1}),  # a missing argument
    ]
    t0 = time.perf_counter()
    out = run_tool_calls(calls, tools, timeout=0.5)
    assert time.perf_counter() - t0 < 2.5  # the hanging tool did not hold the others (nor the caller)
    assert out[0] == "42"
    assert json.loads(out[1]) == {"key": "abc", "value": 3}
    assert out[2] == "error: divide raised ZeroDivisionError: division by zero"
    assert out[3] == "error: wait did not return within 0.5 s"
    assert out[4].startswith("<object object at")
    assert out[5] == "error: no tool named 'nope'; the tools are divide, lookup, multiply, opaque, wait"
    assert out[6] == "error: multiply: missing a required argument: 'b'"


def test_results_are_text_for_the_tool_message() -> None:
    assert as_text("plain") == "plain"
    assert as_text({"a": [1, 2]}) == '{"a": [1, 2]}'
    assert as_text(3.5) == "3.5"
