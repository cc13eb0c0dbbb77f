"""Pairwise LLM judge over any OpenAI-compatible chat API (OpenAI, a vLLM server, ``transformers serve``).

Each (prompt, model output, reference) pair is judged twice, once in each order, to cancel position bias.
Requests run concurrently under a semaphore, are retried with exponential backoff on 429 / 5xx / timeouts /
connection errors, and are bounded by a request budget counting every HTTP attempt. An answer that is not
one letter A or B is kept as ``invalid``; a request that failed or was never sent is ``error`` / ``budget``.
None of these is ever counted as a loss.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from rloo.errors import ServiceUnavailable, UserError
from rloo.eval.endpoint import failure_hint, retryable_status
from rloo.eval.stats import MODEL, REFERENCE

log = logging.getLogger(__name__)

OK, INVALID, ERROR, BUDGET = "ok", "invalid", "error", "budget"
ORDERS = ("model_first", "reference_first")
_MAX_BACKOFF = 30.0
# The letter alone, optionally wrapped in quotes/markdown/brackets and followed by a period.
_ANSWER = re.compile(r"^[\s\"'`*_\[(]*(?:response\s+)?([AB])[\s\"'`*_\])]*[.!]?[\s\"'`*_]*$", re.IGNORECASE)


def parse_answer(text: str | None) -> str | None:
    """'A' or 'B' when the answer is exactly one of those letters (lightly decorated), else None."""
    if text is None:
        return None
    m = _ANSWER.match(text)
    return m.group(1).upper() if m else None


def render_prompt(template: str, prompt: str, response_a: str, response_b: str) -> str:
    # str.replace, not str.format: prompts and responses may contain braces
    return (
        template.replace("{prompt}", prompt)
        .replace("{response_a}", response_a)
        .replace("{response_b}", response_b)
    )


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


@dataclass
class JudgeStats:
    requests: int = 0  # HTTP attempts for judgements, retries included
    retries: int = 0
    # the connectivity check before generation: counted apart, so requests matches the judgements' statuses
    preflight_requests: int = 0
    statuses: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class JudgeSettings:
    base_url: str
    model: str
    api_key: str
    template: str
    concurrency: int = 8
    max_retries: int = 5
    request_budget: int | None = None
    timeout: float = 60.0
    backoff: float = 1.0
    max_tokens: int = 16


def api_key_from_env(env_name: str, base_url: str) -> str:
    key = os.environ.get(env_name)
    if key:
        return key
    if "api.openai.com" in base_url:
        raise UserError(f"--judge_api_key_env {env_name}: the variable is not set; export the judge API key.")
    # Self-hosted OpenAI-compatible servers (vLLM, transformers serve) usually need no key; the client
    # insists on a non-empty one.
    return "EMPTY"


class PairwiseJudge:
    """Judges (prompt, model output, reference) triples in both orders; see the module docstring."""

    def __init__(self, settings: JudgeSettings) -> None:
        self.s = settings
        self.stats = JudgeStats()
        self._budget_left = settings.request_budget
        self._fatal: UserError | None = None
        self._done = self._total = 0  # progress of the current batch

    def _client(self) -> Any:
        from openai import AsyncOpenAI

        # The client's own retries are off: every HTTP attempt must go through our budget counter, and one
        # retry policy (ours) is easier to reason about than two stacked ones.
        return AsyncOpenAI(
            base_url=self.s.base_url, api_key=self.s.api_key, max_retries=0, timeout=self.s.timeout
        )

    def _take_request(self) -> bool:
        if self._budget_left is None:
            self.stats.requests += 1
            return True
        if self._budget_left <= 0:
            return False
        self._budget_left -= 1
        self.stats.requests += 1
        return True

    async def _ask(self, client: Any, content: str, j: Judgement) -> str | None:
        """The judge's text, or None with ``j.status``/``j.error`` set. Raises UserError on fatal errors."""
        import openai

        for attempt in range(self.s.max_retries + 1):
            if self._fatal is not None:
                j.status, j.error = ERROR, "aborted"
                return None
            if not self._take_request():
                j.status = BUDGET
                return None
            j.attempts += 1
            try:
                # The raw response keeps the body: a 200 that is not a chat completion (an empty body, a
                # proxy's HTML page) must be reported as what it is, not as a JSONDecodeError traceback.
                raw = await client.chat.completions.with_raw_response.create(
                    model=self.s.model,
                    messages=[{"role": "user", "content": content}],
                    temperature=0.0,
                    max_tokens=self.s.max_tokens,
                )
                try:
                    choices = raw.parse().choices or []
                    return (choices[0].message.content or "") if choices else ""
                except (ValueError, AttributeError, TypeError, IndexError):
                    self._fatal = UserError(
                        f"the judge at {self.s.base_url} answered HTTP {raw.status_code} with "
                        f"{_describe_body(raw.http_response)}, not an OpenAI chat completion; check "
                        "--judge_base_url (usually ends in /v1) and that it points at the judge itself."
                    )
                    raise self._fatal from None
            except (openai.AuthenticationError, openai.PermissionDeniedError) as e:
                self._fatal = UserError(
                    f"the judge at {self.s.base_url} rejected the API key (HTTP {e.status_code}); check the "
                    "key in --judge_api_key_env."
                )
                raise self._fatal from None
            except openai.NotFoundError:
                self._fatal = UserError(
                    f"the judge at {self.s.base_url} does not know model {self.s.model!r} or has no "
                    "/chat/completions (HTTP 404); check --judge_model and --judge_base_url (usually ends in /v1)."
                )
                raise self._fatal from None
            except openai.APIStatusError as e:
                j.error = f"HTTP {e.status_code}"
                if not retryable_status(e.status_code):
                    # the server's own reason ("maximum context length is 512 tokens ..."): what to fix
                    j.error += f": {_server_message(e)}"
                    j.status = ERROR
                    return None
                delay = _retry_after(e.response)
            except (openai.APITimeoutError, openai.APIConnectionError) as e:
                j.error = type(e).__name__
                delay = None
            if attempt < self.s.max_retries:
                self.stats.retries += 1
                backoff = min(_MAX_BACKOFF, self.s.backoff * 2**attempt) * (0.5 + random.random() / 2)
                await asyncio.sleep(min(_MAX_BACKOFF, delay) if delay is not None else backoff)
        j.status = ERROR
        return None

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
        self.stats.statuses[j.status] = self.stats.statuses.get(j.status, 0) + 1
        self._done += 1
        if self._done % max(1, self._total // 10) == 0 or self._done == self._total:
            log.info("judged %d/%d (%s)", self._done, self._total, self.stats.statuses)
        return j

    async def _judge_all(
        self, prompts: Sequence[str], outputs: Sequence[str], references: Sequence[str]
    ) -> list[tuple[Judgement, Judgement]]:
        sem = asyncio.Semaphore(self.s.concurrency)
        self._done, self._total = 0, 2 * len(prompts)
        client = self._client()
        try:
            tasks = [
                asyncio.ensure_future(self._judge_one(client, sem, p, o, r, order))
                for p, o, r in zip(prompts, outputs, references, strict=True)
                for order in ORDERS
            ]
            try:
                done = await asyncio.gather(*tasks)
            except UserError:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise
        finally:
            await client.close()
        return [(done[i], done[i + 1]) for i in range(0, len(done), 2)]

    def judge(
        self, prompts: Sequence[str], outputs: Sequence[str], references: Sequence[str]
    ) -> list[tuple[Judgement, Judgement]]:
        """Both-order judgements of each (prompt, output, reference): ``[(model_first, reference_first)]``."""
        if not len(prompts) == len(outputs) == len(references):
            raise ValueError("prompts, outputs and references must have equal lengths")
        return asyncio.run(self._judge_all(prompts, outputs, references))

    def preflight(self, content: str = "Answer with the letter A.") -> None:
        """One request before any generation, so a wrong URL, key or model fails in seconds. ``content``: a
        request as large as the evaluation's largest (its prompt and reference rendered into the template),
        so that a judge whose context is too short says so now, not for every pair later."""

        async def go() -> Judgement:
            client = self._client()
            try:
                j = Judgement(order="preflight")
                await self._ask(client, content, j)
                return j
            finally:
                await client.close()

        before = (self.stats.requests, self.stats.retries)
        j = asyncio.run(go())
        self.stats.preflight_requests += self.stats.requests - before[0]
        self.stats.requests, self.stats.retries = before
        if j.status == ERROR:
            # Down, overloaded or still starting (the chart's vLLM judge loads its model for minutes): exit 75,
            # so a retried pipeline step tries again; a refused request (another 4xx) is the caller's to fix.
            if _transient(j.error):
                raise ServiceUnavailable(
                    f"the judge at {self.s.base_url} is unreachable or failing ({j.error} after {j.attempts} "
                    f"attempt(s)): {failure_hint(j.error)}."
                )
            raise UserError(
                f"the judge at {self.s.base_url} refused the request ({j.error}): {failure_hint(j.error)}."
            )


def _transient(error: str | None) -> bool:
    """Whether a judge request's last error may heal by itself: no connection, a timeout, 408/409/429, 5xx."""
    if error in ("APIConnectionError", "APITimeoutError"):
        return True
    m = re.match(r"HTTP (\d+)", error or "")
    return m is not None and retryable_status(int(m[1]))


def _server_message(e: Any) -> str:
    """The reason an OpenAI-compatible server gave for refusing a request, in one line."""
    body = getattr(e, "body", None)
    if isinstance(body, dict):
        inner = body.get("error", body)
        message = inner.get("message") if isinstance(inner, dict) else inner
        if message:
            return " ".join(str(message).split())[:300]
    return " ".join(str(getattr(e, "message", "") or e).split())[:300]


def usable_verdicts_problem(label: str, judged: list[tuple[Judgement, Judgement]]) -> UserError | None:
    """Why the pairs of one model cannot measure anything, or None. The rule: at least half of the pairs
    must have two usable verdicts (both orders answered with A or B); below that the win rate says more about
    the judge than about the model. The error names the commonest judge failure, the server's own words, and
    is a temporary one (exit 75) when that failure may heal by itself."""
    n = len(judged)
    usable = sum(1 for a, b in judged if a.status == OK and b.status == OK)
    if n == 0 or 2 * usable >= n:
        return None
    errors: dict[str, int] = {}
    invalid = unasked = 0
    example = ""
    for pair in judged:
        for j in pair:
            if j.status == ERROR:
                errors[j.error or "error"] = errors.get(j.error or "error", 0) + 1
            if j.status == INVALID:
                invalid += 1
                example = example or " ".join((j.answer or "").split())[:80]
            unasked += j.status == BUDGET
    parts = [
        f"{count} request(s) failed with {error!r}"
        for error, count in sorted(errors.items(), key=lambda kv: -kv[1])[:2]
    ]
    if invalid:
        parts.append(f"{invalid} answer(s) were not a single A or B (e.g. {example!r})")
    if unasked:
        parts.append(f"{unasked} request(s) not sent: --judge_request_budget ran out")
    message = (
        f"only {usable} of {n} {label} pairs got two usable verdicts, fewer than half, so no win rate is "
        f"measured: {'; '.join(parts)}; fix the judge (--judge_base_url, --judge_model, its context length, "
        "--judge_template) and run the evaluation again."
    )
    top = max(errors, key=lambda k: errors[k]) if errors else None
    if top is not None and _transient(top) and errors[top] >= invalid + unasked:
        return ServiceUnavailable(message)
    return UserError(message)


def _describe_body(response: Any) -> str:
    """The body of an HTTP answer in a few words for an error line: 'an empty body' or its first 120 chars."""
    try:
        text = response.text
    except Exception:  # a body that cannot even be decoded
        return "an unreadable body"
    text = " ".join(text.split())
    if not text:
        return "an empty body"
    return f"{text[:120]!r}" + (" ..." if len(text) > 120 else "")


def _retry_after(response: Any) -> float | None:
    try:
        value = response.headers.get("retry-after")
        return max(0.0, float(value)) if value is not None else None
    except (AttributeError, TypeError, ValueError):
        return None
