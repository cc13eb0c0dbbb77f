"""The Hugging Face Hub as a source of models and datasets: its failures as one line each.

A Hub that cannot be reached (connection refused, timeouts, 5xx or 429 through huggingface_hub's own retry
cycle) is a :class:`rloo.errors.ServiceUnavailable`: exit 75, a retried step may succeed. A repo that does
not exist, is gated, or is not in the local cache under ``HF_HUB_OFFLINE`` is a :class:`UserError` (2).

huggingface_hub retries each request itself (``utils/_http.py``: 5 retries, 1 s doubling to 8 s), and
transformers asks for ``config.json`` twice when a tokenizer loads. :func:`check_hub_model` asks once, before
any loader does, so an unreachable Hub costs one retry cycle and one line instead of a cycle per attempt.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator

from rloo.errors import ServiceUnavailable, UserError

log = logging.getLogger(__name__)

# What a user changes when the Hub is out of reach, named in every such line.
HUB_HINT = (
    "retry later, set HF_HUB_OFFLINE=1 to use only this machine's Hub cache, or point HF_ENDPOINT at a "
    "reachable mirror"
)
# HTTP statuses huggingface_hub retries (_DEFAULT_RETRY_ON_STATUS_CODES): still failing after its retries,
# the Hub is down or throttling, not refusing the request
_TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})


def hub_endpoint() -> str:
    """The Hub this process talks to: ``HF_ENDPOINT`` as huggingface_hub read it."""
    from huggingface_hub import constants

    return str(constants.ENDPOINT)


def hub_offline() -> bool:
    """Whether huggingface_hub is in offline mode (``HF_HUB_OFFLINE``/``TRANSFORMERS_OFFLINE``)."""
    from huggingface_hub import constants

    return bool(constants.is_offline_mode())


def _chain(e: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    cur: BaseException | None = e
    while cur is not None and len(out) < 10:
        out.append(cur)
        cur = cur.__cause__ or cur.__context__
    return out


def _status(e: BaseException) -> int | None:
    response = getattr(e, "response", None)
    status = getattr(response, "status_code", None)
    return status if isinstance(status, int) else None


def _is_unreachable(e: BaseException) -> bool:
    """A connection that failed or timed out (httpx, which huggingface_hub uses, or requests/urllib3 below
    datasets and older clients), never a refusal by the server."""
    import httpx2
    from huggingface_hub.errors import OfflineModeIsEnabled

    if isinstance(e, OfflineModeIsEnabled):
        return False  # a ConnectionError subclass, but the user asked for it
    if isinstance(e, (httpx2.TimeoutException, httpx2.NetworkError, httpx2.RemoteProtocolError)):
        return True
    if isinstance(e, (ConnectionError, TimeoutError)):
        return True
    return type(e).__name__ in {"ConnectError", "ConnectTimeout", "ReadTimeout", "MaxRetryError"}


def hub_error(e: BaseException, what: str) -> UserError | None:
    """The one-line error for a Hub failure behind ``e`` (its cause chain is searched), prefixed with ``what``
    (such as ``--model_name_or_path org/name``); None when ``e`` is no Hub failure."""
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    chain = _chain(e)
    for err in chain:
        if isinstance(err, GatedRepoError):
            return UserError(f"{what}: gated on the Hugging Face Hub; accept its terms and set HF_TOKEN.")
        if isinstance(err, RevisionNotFoundError):
            return UserError(
                f"{what}: the Hugging Face Hub has no such revision of it; give one that exists."
            )
        if isinstance(err, RepositoryNotFoundError):
            return UserError(
                f"{what}: not found on the Hugging Face Hub at {hub_endpoint()} (a private repo needs HF_TOKEN); "
                "check the id, or give a local directory or an s3:// prefix."
            )
    # offline, huggingface_hub raises LocalEntryNotFoundError without a cause (file_download.py,
    # _raise_on_head_call_error with local_files_only)
    offline_miss = hub_offline() and any(isinstance(err, LocalEntryNotFoundError) for err in chain)
    for err in chain:
        if isinstance(err, OfflineModeIsEnabled) or offline_miss:
            return UserError(
                f"{what}: not in this machine's Hub cache, and HF_HUB_OFFLINE is set: download it first "
                "('hf download'), unset HF_HUB_OFFLINE, or give a local directory or an s3:// prefix."
            )
    for err in chain:
        status = _status(err) if isinstance(err, HfHubHTTPError) else None
        if _is_unreachable(err) or status in _TRANSIENT_STATUS:
            why = f"HTTP {status}" if status is not None else type(err).__name__
            return ServiceUnavailable(
                f"{what}: the Hugging Face Hub at {hub_endpoint()} is unreachable ({why}); {HUB_HINT}."
            )
    return None


@contextlib.contextmanager
def hub_errors(what: str) -> Iterator[None]:
    """Re-raise a Hub failure inside as its one line (:func:`hub_error`); anything else passes unchanged."""
    try:
        yield
    except UserError:
        raise
    except Exception as e:
        err = hub_error(e, what)
        if err is None:
            raise
        raise err from None


@functools.lru_cache(maxsize=32)
def check_hub_model(what: str, repo_id: str, revision: str | None = None) -> None:
    """Ask the Hub for ``config.json`` of model ``repo_id`` once per process, before transformers does: one
    line (:func:`hub_error`) for an unreachable Hub (75) or an unknown or gated repo (2). A Hub out of reach
    whose model is in this machine's cache passes with a warning (the loaders fall back to the cache).
    Skipped in offline mode, where the loaders read the cache only."""
    if hub_offline():
        return  # the loaders read the cache only; a model not in it is hub_error's one line
    from huggingface_hub import get_hf_file_metadata, hf_hub_url, try_to_load_from_cache
    from huggingface_hub.errors import EntryNotFoundError

    url = hf_hub_url(repo_id, "config.json", revision=revision)
    try:
        get_hf_file_metadata(url, retry_on_errors=True)  # huggingface_hub's own retry cycle, once
    except EntryNotFoundError:
        return  # no config.json: the loader says what is missing
    except Exception as e:
        err = hub_error(e, what)
        if err is None:
            raise
        cached = try_to_load_from_cache(repo_id, "config.json", revision=revision)
        if isinstance(err, ServiceUnavailable) and isinstance(cached, str):
            log.warning("%s: the Hub is unreachable: reading this machine's cached copy (%s)", what, HUB_HINT)
            return
        raise err from None
