"""Tools an agent's rollout may call (``--tools pkg.module:fn``, TRL's ``tools=[...]``): plain Python functions,
sync or async, with type hints and a Google-style docstring.

- :func:`load_tools` resolves the specs and turns each function into the chat template's tool schema with
  transformers' own conversion (``transformers.utils.get_json_schema``, what ``apply_chat_template(tools=...)``
  does), so a function the template cannot describe is refused in one line before anything loads.
- :func:`parse_tool_calls` finds the calls in a completion: the tokenizer's own response parser where its
  template declares one (``tokenizer.parse_response``), else the ``<tool_call>{json}</tool_call>`` blocks of
  the Hermes format that Qwen2.5/Qwen3 and most tool-calling templates use.
- :func:`run_tool_calls` (and :func:`run_calls`, for calls with tools of their own) runs calls concurrently
  under one timeout. A tool that raises, hangs, is unknown, or gets bad arguments becomes an error message to
  the model, never a crashed run; a result that is not text is sent as JSON (or ``str``).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rloo.errors import UserError
from rloo.importing import load_callable

_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class Tool:
    """A callable tool and the schema the chat template shows the model."""

    name: str
    fn: Callable[..., Any]
    schema: dict[str, Any]


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: the tool's name and its arguments, or why the call could not be read."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None  # the call was malformed: this goes back to the model instead of a result


def tool_from_function(fn: Callable[..., Any], *, flag: str = "--tools", spec: str | None = None) -> Tool:
    """``fn`` with its schema; a one-line UserError when it is a class, or its docstring or type hints cannot
    describe it (``spec``: how the user named it)."""
    from transformers.utils import get_json_schema
    from transformers.utils.chat_template_utils import DocstringParsingException, TypeHintParsingException

    name = getattr(fn, "__name__", type(fn).__name__)
    if inspect.isclass(fn):
        raise UserError(
            f"{flag} {spec or name} is a class; a tool is a function. Give a class whose public methods are the "
            "tools as --environment pkg.module:Class."
        )
    try:
        schema = get_json_schema(fn)
    except (DocstringParsingException, TypeHintParsingException) as e:
        reason = " ".join(str(e).split())
        raise UserError(
            f"{flag} {spec or name}: the chat template cannot describe it ({reason}); give it type hints and a "
            "Google-style docstring with an Args: section."
        ) from None
    return Tool(name=name, fn=fn, schema=schema)


def load_tools(specs: Sequence[str], *, flag: str = "--tools") -> list[Tool]:
    """The tools named ``pkg.module:fn``, each with its schema; two tools of one name are refused."""
    tools = [
        tool_from_function(
            load_callable(spec, flag=flag, role="a tool the model may call"), flag=flag, spec=spec
        )
        for spec in specs
    ]
    seen: dict[str, str] = {}
    for spec, tool in zip(specs, tools, strict=True):
        if tool.name in seen:
            raise UserError(
                f"{flag} {seen[tool.name]} and {spec} are both named {tool.name!r}: the model calls tools by "
                "name; rename one."
            )
        seen[tool.name] = spec
    return tools


def parse_tool_calls(text: str, tokenizer: Any = None) -> list[ToolCall]:
    """The tool calls in a completion's text, in order. With a ``tokenizer`` whose template declares a
    response schema, its own parser reads them; otherwise the Hermes ``<tool_call>`` blocks. A block that is
    not a JSON object with a ``name`` is a call with an ``error``."""
    if tokenizer is not None and getattr(tokenizer, "response_schema", None):
        parsed = tokenizer.parse_response(text)
        return [_from_json(c.get("function", c)) for c in (parsed or {}).get("tool_calls") or []]
    return [_from_text(block) for block in _HERMES_CALL.findall(text)]


def _from_text(block: str) -> ToolCall:
    try:
        payload = json.loads(block)
    except json.JSONDecodeError as e:
        return ToolCall(name="", error=f"the tool call is not valid JSON ({e.msg} at character {e.pos})")
    if not isinstance(payload, dict):
        return ToolCall(name="", error="the tool call must be a JSON object with 'name' and 'arguments'")
    return _from_json(payload)


def _from_json(payload: dict[str, Any]) -> ToolCall:
    name = payload.get("name")
    arguments = payload.get("arguments", payload.get("parameters", {}))
    if isinstance(arguments, str):  # some templates emit the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return ToolCall(name=str(name or ""), error="the tool call's arguments are not valid JSON")
    if not isinstance(name, str) or not name:
        return ToolCall(name="", error="the tool call has no 'name'")
    if not isinstance(arguments, dict):
        return ToolCall(name=name, error="the tool call's 'arguments' must be a JSON object")
    return ToolCall(name=name, arguments=arguments)


def run_tool_calls(calls: Sequence[ToolCall], tools: Sequence[Tool], *, timeout: float) -> list[str]:
    """Each call's result as the text of a tool message, in the calls' order: :func:`run_calls` with one set of
    tools for every call."""
    by_name = {t.name: t for t in tools}
    return run_calls([(call, by_name) for call in calls], timeout=timeout)


def run_calls(jobs: Sequence[tuple[ToolCall, dict[str, Tool]]], *, timeout: float) -> list[str]:
    """Each call, with the tools it may use by name, run at once on its own thread (async tools on an event
    loop there); what has not returned ``timeout`` seconds after they all started is an ``error: ...``
    message, as is any failure. The threads are daemons: a tool that never returns holds neither the batch
    nor the process's exit."""
    results: list[str | None] = [None] * len(jobs)

    def work(i: int, call: ToolCall, by_name: dict[str, Tool]) -> None:
        results[i] = _call(call, by_name)

    threads = [
        threading.Thread(target=work, args=(i, call, by_name), name="rloo-tool", daemon=True)
        for i, (call, by_name) in enumerate(jobs)
    ]
    deadline = time.monotonic() + timeout
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    return [
        r if r is not None else f"error: {call.name} did not return within {timeout:g} s"
        for r, (call, _) in zip(list(results), jobs, strict=True)
    ]


def _call(call: ToolCall, by_name: dict[str, Tool]) -> str:
    if call.error is not None:
        return f"error: {call.error}"
    tool = by_name.get(call.name)
    if tool is None:
        return f"error: no tool named {call.name!r}; the tools are {', '.join(sorted(by_name)) or 'none'}"
    try:
        inspect.signature(tool.fn).bind(**call.arguments)
    except TypeError as e:
        return f"error: {call.name}: {e}"
    try:
        out = tool.fn(**call.arguments)
        if inspect.isawaitable(out):
            out = asyncio.run(_awaited(out))
    except Exception as e:  # the model sees what went wrong and may try again; the run goes on
        return f"error: {call.name} raised {type(e).__name__}: {e}"
    return as_text(out)


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


def as_text(value: Any) -> str:
    """A tool's result as the tool message's text: text as it is, else JSON, else ``str``."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(value)
