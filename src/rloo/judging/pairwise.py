"""The pairwise judge: which of two responses to a prompt is better, a model's output or a reference.

Each (prompt, model output, reference) triple is judged twice, once in each order, to cancel position bias.
An answer that is not one letter A or B is kept as ``invalid``; a request that failed or was never sent is
``error`` / ``budget`` (:mod:`rloo.judging.client`). None of these is ever counted as a loss.

Verdicts are told from the model's side: ``"model"`` (the model's output was preferred), ``"reference"``,
or ``None`` (no usable answer).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from rloo.judging.client import BUDGET, INVALID, OK, JudgeClient
from rloo.judging.templates import fill

MODEL = "model"
REFERENCE = "reference"
ORDERS = ("model_first", "reference_first")
# The letter alone, optionally wrapped in quotes/markdown/brackets and followed by a period.
_ANSWER = re.compile(r"^[\s\"'`*_\[(]*(?:response\s+)?([AB])[\s\"'`*_\])]*[.!]?[\s\"'`*_]*$", re.IGNORECASE)


def parse_answer(text: str | None) -> str | None:
    """'A' or 'B' when the answer is exactly one of those letters (lightly decorated), else None."""
    if text is None:
        return None
    m = _ANSWER.match(text)
    return m.group(1).upper() if m else None


def render_prompt(template: str, prompt: str, response_a: str, response_b: str) -> str:
    return fill(template, {"{prompt}": prompt, "{response_a}": response_a, "{response_b}": response_b})


def pair_score(verdict_ab: str | None, verdict_ba: str | None) -> float | None:
    """MT-Bench style two-order score: 1 both orders prefer the model, 0 both prefer the reference, 0.5 when
    they disagree (position bias decided it, a tie). ``None`` when either order has no usable verdict: such a
    pair is counted as invalid, never as a loss."""
    for v in (verdict_ab, verdict_ba):
        if v not in (MODEL, REFERENCE, None):
            raise ValueError(f"verdict must be {MODEL!r}, {REFERENCE!r} or None (got {v!r})")
    if verdict_ab is None or verdict_ba is None:
        return None
    if verdict_ab == verdict_ba:
        return 1.0 if verdict_ab == MODEL else 0.0
    return 0.5


@dataclass
class Judgement:
    """One judge request (one order of one pair) and what came of it."""

    order: str  # "model_first" (model output is A) or "reference_first" (model output is B)
    status: str = BUDGET  # ok | invalid | error | budget
    verdict: str | None = None  # "model" | "reference" | None
    answer: str | None = None  # raw judge text
    attempts: int = 0
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class PairwiseJudge(JudgeClient):
    """Judges (prompt, model output, reference) triples in both orders; see the module docstring."""

    async def _judge_one(
        self, client: Any, sem: asyncio.Semaphore, prompt: str, output: str, reference: str, order: str
    ) -> Judgement:
        j = Judgement(order=order)
        a, b = (output, reference) if order == ORDERS[0] else (reference, output)
        content = render_prompt(self.s.template, prompt, a, b)
        async with sem:
            text = await self._ask(client, content, j)
        if text is not None:
            j.answer = text
            letter = parse_answer(text)
            if letter is None:
                j.status = INVALID
            else:
                j.status, j.error = OK, None
                model_letter = "A" if order == ORDERS[0] else "B"
                j.verdict = MODEL if letter == model_letter else REFERENCE
        self._finished(j)
        return j

    def judge(
        self, prompts: Sequence[str], outputs: Sequence[str], references: Sequence[str]
    ) -> list[tuple[Judgement, Judgement]]:
        """Both-order judgements of each (prompt, output, reference): ``[(model_first, reference_first)]``."""
        if not len(prompts) == len(outputs) == len(references):
            raise ValueError("prompts, outputs and references must have equal lengths")
        done = self._run(
            lambda client, sem: [
                self._judge_one(client, sem, p, o, r, order)
                for p, o, r in zip(prompts, outputs, references, strict=True)
                for order in ORDERS
            ]
        )
        return [(done[i], done[i + 1]) for i in range(0, len(done), 2)]
