"""Environments for the tests, written as for TRL's ``environment_factory``."""

from __future__ import annotations

import asyncio


class Counter:
    """State across turns: the model must reach the row's target by adding; the reward is how close it got."""

    made = 0

    def __init__(self) -> None:
        Counter.made += 1
        self.total = 0
        self.target = 0

    def reset(self, target: int = 10, **row: object) -> str:
        self.total, self.target = 0, target
        return f" Reach {target}."

    def add(self, amount: int) -> int:
        """Add to the running total.

        Args:
            amount: How much to add.
        """
        self.total += amount
        return self.total

    def _private(self) -> None:
        raise AssertionError("not a tool")

    @property
    def done(self) -> bool:  # a property: never evaluated to list the tools
        raise AssertionError("evaluated")

    def get_reward(self) -> float:
        return -abs(self.target - self.total)


class Quiet:
    """No reward of its own, nothing appended to the prompt, an async tool."""

    def reset(self, **row: object) -> None:
        return None

    async def ping(self) -> str:
        """Answer pong."""
        await asyncio.sleep(0)
        return "pong"


class NoReset:
    def step(self, action: str) -> str:
        """Act.

        Args:
            action: What to do.
        """
        return action


class BadTool:
    def reset(self, **row: object) -> None:
        return None

    def act(self, what):  # type: ignore[no-untyped-def]
        return what


class Strict:
    """A reset that needs a column the rows may lack, and a reward that fails."""

    def reset(self, answer: str, **row: object) -> None:
        self.answer = answer

    def get_reward(self) -> float:
        raise ValueError("no episode yet")
