"""Environments an agent's rollout acts in (``--environment pkg.module:Class``, TRL's ``environment_factory``),
with TRL's contract so that its users' classes move over unchanged (trl/trainer/grpo_trainer.py, 1.16):

- the factory (a class, or any callable) makes one instance per rollout; instances are pooled and reused,
  each ``reset(**row)`` with its dataset row before a rollout. ``reset`` returns None, or text appended to the
  prompt's last user message;
- the public methods of the class (not ``_``-prefixed, not ``reset`` nor ``get_reward``) are the rollout's
  tools, described to the model like ``--tools`` functions (type hints and a docstring);
- ``get_reward()`` (no argument, sync or async), when the class defines it, scores a finished rollout from
  the environment's state: one more reward source, named after the class, weight 1.

:func:`load_environment` probes one instance at start, so a class without ``reset`` or with a method the
template cannot describe is refused in one line before anything loads.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from rloo.agents.tools import Tool, tool_from_function
from rloo.errors import UserError
from rloo.importing import load_callable

_NOT_TOOLS = ("reset", "get_reward")


def tool_method_names(cls: type) -> list[str]:
    """The methods of ``cls`` that are tools: public functions on the class (properties are not evaluated)."""
    return [
        name
        for name, _ in inspect.getmembers(cls, predicate=inspect.isfunction)
        if name not in _NOT_TOOLS and not name.startswith("_")
    ]


@dataclass(frozen=True)
class Environment:
    """An environment's factory and what its probe instance showed: its tools' schemas (by name, in order) and
    whether it owns a reward."""

    name: str  # the class's name: the reward source's name when it owns one
    factory: Callable[[], Any]
    schemas: dict[str, dict[str, Any]]
    owns_reward: bool

    @property
    def tool_names(self) -> list[str]:
        return list(self.schemas)

    def tools(self, instance: Any) -> list[Tool]:
        """The tools of one instance: its bound methods, with the schemas read once from the probe."""
        return [Tool(name=n, fn=getattr(instance, n), schema=s) for n, s in self.schemas.items()]


def load_environment(spec: str, *, flag: str = "--environment") -> Environment:
    """The environment ``pkg.module:Class``, probed once: it must have a callable ``reset``, and each tool method
    a schema the chat template can show."""
    factory = load_callable(spec, flag=flag, role="the class of the rollouts' environment")
    if inspect.isfunction(factory):
        raise UserError(
            f"{flag} {spec} is a function; an environment is a class (reset, its methods the tools). Give a "
            "function the model may call as --tools pkg.module:fn."
        )
    try:
        probe = factory()
    except Exception as e:
        raise UserError(f"{flag} {spec}: making an instance failed ({type(e).__name__}: {e}).") from None
    cls = type(probe)
    if not callable(getattr(probe, "reset", None)):
        raise UserError(
            f"{flag} {spec}: {cls.__name__} has no reset method; give it reset(self, **row), called with each "
            "rollout's dataset row (it may return text to append to the prompt)."
        )
    # every tool method describable, or one line now
    tools = [tool_from_function(getattr(probe, n), flag=flag) for n in tool_method_names(cls)]
    return Environment(
        name=cls.__name__,
        factory=factory,
        schemas={t.name: t.schema for t in tools},
        owns_reward=callable(getattr(probe, "get_reward", None)),
    )


class EnvironmentPool:
    """Instances of one environment, made once and reset for each rollout (TRL's pool: construct once, reset
    often); a batch takes as many as it has rollouts."""

    def __init__(self, env: Environment) -> None:
        self.env = env
        self._instances: list[Any] = []

    def take(self, n: int) -> list[Any]:
        while len(self._instances) < n:
            self._instances.append(self.env.factory())
        return self._instances[:n]


def reset_all(instances: Sequence[Any], rows: Sequence[dict[str, Any]]) -> list[Any]:
    """Each instance reset with its rollout's row; what each ``reset`` returned (None or text). An exception is
    one line naming the class and the row."""
    out = []
    for inst, row in zip(instances, rows, strict=True):
        try:
            out.append(inst.reset(**row))
        except Exception as e:
            raise UserError(
                f"--environment {type(inst).__name__}: reset raised {type(e).__name__}: {e} (row columns: "
                f"{', '.join(sorted(row)) or 'none'}); make reset accept the dataset's rows."
            ) from None
    return out


def with_observation(messages: list[dict[str, Any]], observation: Any) -> list[dict[str, Any]]:
    """The prompt's messages with ``reset``'s text appended to the last one (a new list: the dataset's row is
    left as it is); None leaves them as they are."""
    if observation is None:
        return messages
    last = messages[-1]
    content = last["content"]
    if isinstance(observation, str) and isinstance(content, list):
        observation = [{"type": "text", "text": observation}]
    elif isinstance(observation, list) and isinstance(content, str):
        content = [{"type": "text", "text": content}]
    return [*messages[:-1], {**last, "content": content + observation}]


def environment_rewards(instances: Sequence[Any]) -> list[float | None]:
    """Each finished rollout's ``get_reward()`` (awaited when async); None where the instance has none."""
    out: list[float | None] = []
    for inst in instances:
        get = getattr(inst, "get_reward", None)
        if get is None:
            out.append(None)
            continue
        try:
            value = get()
            if inspect.isawaitable(value):
                value = asyncio.run(_awaited(value))
        except Exception as e:
            raise UserError(
                f"--environment {type(inst).__name__}: get_reward raised {type(e).__name__}: {e}; return a float, "
                "or None when the episode cannot be scored."
            ) from None
        out.append(None if value is None else float(value))
    return out


async def _awaited(awaitable: Any) -> Any:
    return await awaitable
