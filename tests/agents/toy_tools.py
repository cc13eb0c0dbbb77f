"""Tools for the tests, as a user writes them: type hints and a Google-style docstring."""

from __future__ import annotations

import asyncio
import time


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return a * b


async def lookup(key: str) -> dict:
    """Look a key up in a small table.

    Args:
        key: The key to look up.
    """
    await asyncio.sleep(0)
    return {"key": key, "value": len(key)}


def divide(a: float, b: float) -> float:
    """Divide a by b.

    Args:
        a: The dividend.
        b: The divisor.
    """
    return a / b


def wait(seconds: float) -> str:
    """Sleep, then say so.

    Args:
        seconds: How long to sleep.
    """
    time.sleep(seconds)
    return "done"


def opaque() -> object:
    """Return something that is not JSON."""
    return object()


def undocumented(a, b):  # type: ignore[no-untyped-def]
    return a + b


def add(amount: int) -> int:
    """Add to nothing: a function named like a method of toy_envs.Counter.

    Args:
        amount: How much to add.
    """
    return amount
