"""The pointwise judge: a score from 0 to 10 for one response to a prompt (GenRM / RULER style).

An answer that is not one number from 0 to 10 (lightly decorated: ``**7**``, ``7/10``, ``Score: 7``) is kept
as ``invalid``, with no score; a failed or unsent request is ``error`` / ``budget`` (:mod:`rloo.judging.client`).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from rloo.judging.client import BUDGET, INVALID, OK, JudgeClient
from rloo.judging.templates import fill

MAX_SCORE = 10.0
_SCORE = re.compile(
    r"^[\s\"'`*_\[(]*(?:score\s*[:=]?\s*)?(\d{1,2}(?:\.\d+)?)\s*(?:/\s*10)?[\s\"'`*_\])]*[.!]?[\s\"'`*_]*$",
    re.IGNORECASE,
)


def parse_score(text: str | None) -> float | None:
    """The number from 0 to 10 the answer is (lightly decorated), else None."""
    m = _SCORE.match(text or "")
    if m is None:
        return None
    score = float(m.group(1))
    return score if 0.0 <= score <= MAX_SCORE else None


def render_pointwise(template: str, prompt: str, response: str) -> str:
    return fill(template, {"{prompt}": prompt, "{response}": response})


@dataclass
class Grade:
    """One judge request for one response and what came of it."""

    status: str = BUDGET  # ok | invalid | error | budget
    score: float | None = None  # 0..10 when the answer was a number in range
    answer: str | None = None  # raw judge text
    attempts: int = 0
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class PointwiseJudge(JudgeClient):
    """Grades (prompt, response) pairs, one request each; see the module docstring."""

    async def _grade_one(self, client: Any, sem: asyncio.Semaphore, prompt: str, response: str) -> Grade:
        g = Grade()
        content = render_pointwise(self.s.template, prompt, response)
        async with sem:
            text = await self._ask(client, content, g)
        if text is not None:
            g.answer, g.score = text, parse_score(text)
            g.status, g.error = (INVALID, g.error) if g.score is None else (OK, None)
        self._finished(g)
        return g

    def grade(self, prompts: Sequence[str], responses: Sequence[str]) -> list[Grade]:
        """The grade of each (prompt, response)."""
        if len(prompts) != len(responses):
            raise ValueError("prompts and responses must have equal lengths")
        return self._run(
            lambda client, sem: [
                self._grade_one(client, sem, p, r) for p, r in zip(prompts, responses, strict=True)
            ]
        )
