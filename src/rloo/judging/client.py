"""An LLM judge over any OpenAI-compatible chat API (OpenAI, a vLLM server, ``transformers serve``): what the
pairwise judge (:mod:`rloo.judging.pairwise`) and the pointwise one (:mod:`rloo.judging.pointwise`) share.

Requests run concurrently under a semaphore, are retried with exponential backoff on 429 / 5xx / timeouts /
connection errors, and are bounded by a request budget counting every HTTP attempt. A request that failed
is ``error``, one never sent for want of budget ``budget``; an answer the judge's kind cannot read is
``invalid``. An authentication failure, an unknown model or a server that is no chat API ends the batch
with a one-line :class:`~rloo.errors.UserError`: no request after it could succeed.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import re
from collections.abc import Callable, Coroutine
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol, TypeVar

from rloo.errors import ServiceUnavailable, UserError
from rloo.judging.endpoint import EVAL_LENGTH_FLAG, failure_hint, retryable_status

log = logging.getLogger(__name__)

OK, INVALID, ERROR, BUDGET = "ok", "invalid", "error", "budget"
_MAX_BACKOFF = 30.0
T = TypeVar("T", bound="Attempt")


class Attempt(Protocol):
    """What one judge request records of itself (a pairwise judgement, a pointwise grade)."""

    status: str
    answer: str | None
    attempts: int
    error: str | None


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
    # the flag that bounds the judged responses' length, named when the judge's context is too short
    length_flag: str = EVAL_LENGTH_FLAG


def settings_from(cfg: Any, template: str, **more: Any) -> JudgeSettings:
    """The judge settings of a stage's config (``rloo eval``'s, ``rloo train``'s: the same ``judge_*`` names),
    the API key read from the variable ``judge_api_key_env`` names; ``more``: other fields."""
    assert cfg.judge_base_url and cfg.judge_model  # the configs require them with a judge
    return JudgeSettings(
        base_url=cfg.judge_base_url,
        model=cfg.judge_model,
        api_key=api_key_from_env(cfg.judge_api_key_env, cfg.judge_base_url),
        template=template,
        concurrency=cfg.judge_concurrency,
        max_retries=cfg.judge_max_retries,
        request_budget=cfg.judge_request_budget,
        timeout=cfg.judge_timeout,
        backoff=cfg.judge_backoff,
        max_tokens=cfg.judge_max_tokens,
        **more,
    )


NO_KEY = "EMPTY"  # what the client sends when the key's variable is unset


def api_key_from_env(env_name: str, base_url: str) -> str:
    key = os.environ.get(env_name)
    if key:
        return key
    if "api.openai.com" in base_url:
        raise UserError(f"--judge_api_key_env {env_name}: the variable is not set; export the judge API key.")
    # Self-hosted OpenAI-compatible servers (vLLM, transformers serve) usually need no key; the client
    # insists on a non-empty one.
    return NO_KEY


@dataclass
class _Probe:
    """The preflight request's record."""

    status: str = BUDGET
    answer: str | None = None
    attempts: int = 0
    error: str | None = None


class JudgeClient:
    """Sends judge prompts and counts what came of them; see the module docstring. ``progress``: log a line
    per tenth of each batch (an evaluation's one long batch; training's small ones say nothing)."""

    def __init__(self, settings: JudgeSettings, *, progress: bool = True) -> None:
        self.s = settings
        self.stats = JudgeStats()
        self._budget_left = settings.request_budget
        self._fatal: UserError | None = None
        self._progress = progress
        self._done = self._total = 0  # progress of the current batch

    def _client(self) -> Any:
        from openai import AsyncOpenAI

        # The client's own retries are off: every HTTP attempt must go through our budget counter, and one
        # retry policy (ours) is easier to reason about than two stacked ones.
        return AsyncOpenAI(
            base_url=self.s.base_url, api_key=self.s.api_key, max_retries=0, timeout=self.s.timeout
        )

    @property
    def budget_spent(self) -> bool:
        return self._budget_left is not None and self._budget_left <= 0

    def _take_request(self) -> bool:
        if self._budget_left is None:
            self.stats.requests += 1
            return True
        if self._budget_left <= 0:
            return False
        self._budget_left -= 1
        self.stats.requests += 1
        return True

    async def _ask(self, client: Any, content: str, j: Attempt) -> str | None:
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
                unset = self.s.api_key == NO_KEY  # the variable was empty: the judge wants one
                self._fatal = UserError(
                    f"the judge at {self.s.base_url} rejected the API key (HTTP {e.status_code}); "
                    + (
                        "the variable --judge_api_key_env names is not set: export the judge's key in it."
                        if unset
                        else "check the key in --judge_api_key_env."
                    )
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

    def _finished(self, j: Attempt) -> None:
        """Count one request of the current batch."""
        self.stats.statuses[j.status] = self.stats.statuses.get(j.status, 0) + 1
        self._done += 1
        if self._progress and (self._done % max(1, self._total // 10) == 0 or self._done == self._total):
            log.info("judged %d/%d (%s)", self._done, self._total, self.stats.statuses)

    def _run(self, requests: Callable[[Any, asyncio.Semaphore], list[Coroutine[Any, Any, T]]]) -> list[T]:
        """The results of the coroutines ``requests(client, semaphore)`` makes, run concurrently (at most
        ``concurrency`` in flight: each holds the semaphore while it asks); the first UserError cancels the
        rest and is raised."""

        async def run_all() -> list[T]:
            sem = asyncio.Semaphore(self.s.concurrency)
            client = self._client()
            try:
                coros = requests(client, sem)
                self._done, self._total = 0, len(coros)
                tasks = [asyncio.ensure_future(c) for c in coros]
                try:
                    return list(await asyncio.gather(*tasks))
                except UserError:
                    for t in tasks:
                        t.cancel()
                    await asyncio.gather(*tasks, return_exceptions=True)
                    raise
            finally:
                await client.close()

        return asyncio.run(run_all())

    def preflight(self, content: str = "Answer with the letter A.") -> None:
        """One request before any generation, so a wrong URL, key or model fails in seconds. ``content``: a
        request as large as the largest to come (its prompt and reference rendered into the template), so
        that a judge whose context is too short says so now, not for every request later."""

        async def go() -> _Probe:
            client = self._client()
            try:
                j = _Probe()
                await self._ask(client, content, j)
                return j
            finally:
                await client.close()

        before = (self.stats.requests, self.stats.retries)
        j = asyncio.run(go())
        self.stats.preflight_requests += self.stats.requests - before[0]
        self.stats.requests, self.stats.retries = before
        if j.status == ERROR:
            hint = failure_hint(j.error, length_flag=self.s.length_flag)
            # Down, overloaded or still starting (the chart's vLLM judge loads its model for minutes): exit 75,
            # so a retried pipeline step tries again; a refused request (another 4xx) is the caller's to fix.
            if transient(j.error):
                raise ServiceUnavailable(
                    f"the judge at {self.s.base_url} is unreachable or failing ({j.error} after {j.attempts} "
                    f"attempt(s)): {hint}."
                )
            raise UserError(f"the judge at {self.s.base_url} refused the request ({j.error}): {hint}.")


def transient(error: str | None) -> bool:
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
