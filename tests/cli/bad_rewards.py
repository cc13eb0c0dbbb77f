"""Misbehaving reward functions for the bad-input CLI tests (imported by the ``rloo`` subprocess)."""

from __future__ import annotations

import math
from typing import Any


def wrong_length(completions: list[Any], **kwargs: Any) -> list[float]:
    return [1.0] * (len(completions) + 1)


def wrong_type(completions: list[Any], **kwargs: Any) -> list[Any]:
    return ["good"] * len(completions)


def not_a_list(completions: list[Any], **kwargs: Any) -> Any:
    return {"reward": 1.0}


def nan_reward(completions: list[Any], **kwargs: Any) -> list[float]:
    return [0.5] * (len(completions) - 1) + [math.nan]


def raising(completions: list[Any], **kwargs: Any) -> list[float]:
    raise KeyError("no_such_column")


def huge_reward(completions: list[Any], **kwargs: Any) -> list[float]:
    """Finite rewards (so accepted) big enough that the policy gradient overflows float32."""
    return [3e38 if i % 2 else 0.0 for i in range(len(completions))]
