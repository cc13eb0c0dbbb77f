"""A tool-calling task written the way TRL's GRPO users write one: a tool function, an environment class and a
reward function. Nothing here imports rloo or TRL; ``rloo train`` names them by import path
(``--tools calculator:add``, ``--environment calculator:CalculatorEnv``, ``--reward_funcs
calculator:correct_sum``), where a TRL script passes the objects (``tools=[add]``,
``environment_factory=CalculatorEnv``, ``reward_funcs=[correct_sum]``).

The dataset's rows hold a chat ``prompt`` ("add 3 and 4") and the ``answer`` ("7").
"""

from __future__ import annotations

from typing import Any


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.

    Returns:
        The sum of a and b.
    """
    return a + b


class CalculatorEnv:
    """One instance per episode: it remembers every result the model got, and scores the episode by them."""

    def __init__(self) -> None:
        self.answer = ""
        self.results: list[int] = []

    def reset(self, **row: Any) -> None:
        """A new episode on ``row``: nothing is appended to the prompt."""
        self.answer, self.results = str(row["answer"]), []

    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: The first number.
            b: The second number.

        Returns:
            The sum of a and b.
        """
        self.results.append(a + b)
        return a + b

    def get_reward(self) -> float:
        """1 when the right sum was computed, 0.5 for a wrong one, 0 without a call."""
        if self.answer in map(str, self.results):
            return 1.0
        return 0.5 if self.results else 0.0


def correct_sum(completions: list[Any], answer: list[str], **kwargs: Any) -> list[float]:
    """1 when a tool result of the episode is the answer, 0.5 for another result, 0 without one; ``completions``
    are the episodes' messages (TRL's conversational format: assistant turns and tool results)."""
    scores = []
    for messages, want in zip(completions, answer, strict=True):
        results = [m["content"] for m in messages if m.get("role") == "tool"]
        ok = [r for r in results if not r.startswith("error")]
        scores.append(1.0 if want in ok else 0.5 if ok else 0.0)
    return scores
