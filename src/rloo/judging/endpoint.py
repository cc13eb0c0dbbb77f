"""The judge's endpoint: a base URL the client can call, what a failed request means, and (for the pipeline's
validate step, before any GPU is requested) a server that answers, serves the judge model and has context
enough. Shared by the evaluation's judge and training's judge reward (:mod:`rloo.judging.client`).

Standard library only: the validate step's image has no OpenAI client (its extras are tracking and kfp).
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from typing import Any
from urllib.parse import urlsplit

from rloo.errors import ServiceUnavailable, UserError

# openai-python retries these statuses (src/openai/_base_client.py, _should_retry): they may heal by themselves
RETRYABLE_STATUS = frozenset({408, 409, 429})
# How a server says a request does not fit the model's context: vLLM ("This model's maximum context length is
# N tokens. However, you requested ...", vllm/renderers/params.py), OpenAI (code context_length_exceeded)
_CONTEXT_REFUSAL = re.compile(
    r"context[ _]length|maximum context|max_model_len|too many tokens", re.IGNORECASE
)
# OpenAI's rule of thumb for English text: about 4 characters a token. Only a floor is estimated with it.
CHARS_PER_TOKEN = 4


def retryable_status(code: int) -> bool:
    """An HTTP status worth retrying: 408/409/429 and every 5xx."""
    return code in RETRYABLE_STATUS or code >= 500


def check_base_url(url: str, flag: str = "--judge_base_url") -> None:
    """A one-line UserError unless ``url`` is an http(s) URL with a host (and a numeric port, if any): a
    malformed one fails every request the same way, which no retry heals."""
    parsed = urlsplit(url)
    problem = ""
    if any(c.isspace() for c in url):
        problem = "it contains whitespace"
    elif parsed.scheme not in ("http", "https") or not url.lower().startswith(f"{parsed.scheme}://"):
        problem = "it does not start with http:// or https://"
    elif not parsed.hostname:
        problem = "it names no host"
    else:
        try:
            parsed.port  # noqa: B018 - urllib parses the port on access
        except ValueError:
            problem = "its port is not a number from 0 to 65535"
    if problem:
        # a host (and port) without its scheme, as in 'judge:8000/v1': the fix is to prefix it
        bare_host = re.match(r"[A-Za-z0-9.\-]+(:\d+)?(/|$)", url) and not url.lower().startswith("http")
        example = f"http://{url}" if bare_host else None
        raise UserError(
            f"{flag} {url!r} is not an http(s) URL ({problem}): give the judge server's OpenAI-compatible base "
            f"URL, e.g. {example or 'http://judge:8000/v1'}."
        )


# The flag that bounds the judged responses' length in `rloo eval` (training's is --response_length)
EVAL_LENGTH_FLAG = "--max_new_tokens (the pipeline's eval_max_new_tokens)"


def failure_hint(
    error: str | None,
    message: str = "",
    *,
    url_flag: str = "--judge_base_url",
    length_flag: str = EVAL_LENGTH_FLAG,
) -> str:
    """What to do about a judge request that failed with ``error`` (``HTTP 400``, ``APIConnectionError``...)
    and the server's own ``message``: the hint that fits the status. ``length_flag``: the flag that bounds
    the length of the judged responses."""
    m = re.match(r"HTTP (\d+)", error or "")
    status = int(m[1]) if m else None
    if status == 400 and _CONTEXT_REFUSAL.search(f"{error} {message}"):
        return (
            f"the judge's context is too short for the request: lower {length_flag} or --judge_max_tokens, or "
            "raise the judge server's --max-model-len (the chart's judge.maxModelLen)"
        )
    if status in (401, 403):
        return "check the API key (the variable --judge_api_key_env names; the pipeline's judge_secret)"
    if status == 404:
        return f"check --judge_model (the name the server lists at /models) and the path of {url_flag} (usually ends in /v1)"
    if status is None or retryable_status(status):
        return f"check that the judge server is up and {url_flag} points at it"
    return "the judge refused the request as sent: check --judge_model and the judge server's options"


def _call(url: str, api_key: str, timeout: float, body: dict[str, Any] | None = None) -> Any:
    """The JSON answer of a GET (or, with ``body``, a POST) to ``url``; urllib's errors as they are."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        url,
        data=data,
        headers={
            "Authorization": f"Bearer {api_key}",
            "Accept": "application/json",
            **({"Content-Type": "application/json"} if data else {}),
        },
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read().decode("utf-8", errors="replace"))


def _server_message(error: urllib.error.HTTPError) -> str:
    """An OpenAI-style error body's message in one line, else the start of the body."""
    try:
        text = error.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
    try:
        body = json.loads(text)
        inner = body.get("error", body) if isinstance(body, dict) else body
        # OpenAI's {"error": {"message"}}, vLLM's {"message"}, FastAPI's {"detail"} (transformers serve)
        text = str(inner.get("message") or inner.get("detail") or inner if isinstance(inner, dict) else inner)
    except ValueError:
        pass
    return " ".join(text.split())[:200]


def request_floor_tokens(template: str, max_new_tokens: int, judge_max_tokens: int) -> int:
    """Tokens every judge request of an evaluation needs at least, whatever its dataset: the judge template
    (estimated), a model output of up to ``max_new_tokens`` and the verdict's ``judge_max_tokens``. The
    prompt and the reference come on top; ``rloo eval`` checks the largest one before it generates."""
    return len(template) // CHARS_PER_TOKEN + max_new_tokens + judge_max_tokens


def check_judge_server(
    base_url: str,
    model: str,
    *,
    api_key: str,
    min_context_tokens: int | None = None,
    timeout: float = 10.0,
    names: tuple[str, str] = ("judge_base_url", "judge_model"),
) -> None:
    """The judge server answers, accepts the key, serves ``model`` and, where its model card says (vLLM's
    ``max_model_len``), has at least ``min_context_tokens`` of context. ``GET /models`` first; a model it does
    not list, or a listing it cannot give, is settled by asking for one token (``transformers serve`` lists
    only the Hugging Face cache, failing where there is none, and loads a model on its first request). One
    line naming the parameters (``names``) otherwise: exit 75 where the server may come up (unreachable,
    408/409/429, 5xx), 2 where the same values never work."""
    url_name = names[0]
    check_base_url(base_url, url_name)
    where = f"the judge at {base_url}"
    api_root = base_url.rstrip("/")
    cards = _model_cards(where, api_root, api_key, timeout, names)
    card = next((c for c in cards or [] if str(c.get("id")) == model), None)
    if card is None:
        _ask_for_one_token(where, api_root, model, api_key, names, _not_served(where, model, cards, names))
        return
    context = card.get("max_model_len")
    if min_context_tokens and isinstance(context, int) and context < min_context_tokens:
        raise UserError(
            f"{where} serves {model!r} with a context of {context} tokens (max_model_len), and every judge "
            f"request of this evaluation needs at least about {min_context_tokens} before its prompt and "
            "reference: raise the judge server's --max-model-len (the chart's judge.maxModelLen) or lower "
            "eval_max_new_tokens."
        )


# A model loaded on first use may take a while to answer its first request
FIRST_ANSWER_TIMEOUT_S = 120.0


def _not_served(where: str, model: str, cards: list[dict[str, Any]] | None, names: tuple[str, str]) -> str:
    """Why a 404 to a chat request for ``model`` is: a name the server does not serve, or (no model list
    either) a api_root URL whose path is not the API's."""
    url_name, model_name = names
    if cards is None:
        return (
            f"{where} answers 404 to GET /models and to a chat request for {model!r}: check the path of "
            f"{url_name} (usually ends in /v1) and {model_name}."
        )
    served = [str(c.get("id")) for c in cards]
    shown = ", ".join(repr(s) for s in served[:5]) + (" ..." if len(served) > 5 else "")
    return (
        f"{where} does not serve {model_name} {model!r} (it lists {shown or 'no model'}): set {model_name} to "
        f"a name the server lists (vLLM: --served-model-name, the chart's judge.servedModelName), or check "
        f"{url_name}."
    )


def _ask_for_one_token(
    where: str, api_root: str, model: str, api_key: str, names: tuple[str, str], not_served: str
) -> None:
    """One chat request for one token: what a server that lists no such model says of it."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Answer with the letter A."}],
        "max_tokens": 1,
        "temperature": 0.0,
    }
    _asked(
        where,
        "POST /chat/completions",
        names,
        lambda: _call(f"{api_root}/chat/completions", api_key, FIRST_ANSWER_TIMEOUT_S, body),
        not_found=not_served,
    )


def _model_cards(
    where: str, api_root: str, api_key: str, timeout: float, names: tuple[str, str]
) -> list[dict[str, Any]] | None:
    """The model cards ``GET /models`` lists; None where the server gives no list (404, 5xx, not JSON): the
    chat request settles it then. A server out of reach, or one refusing the key, fails here."""
    try:
        answer = _call(f"{api_root}/models", api_key, timeout)
    except urllib.error.HTTPError as e:
        if e.code in (401, 403):
            raise _refusal(where, "GET /models", e, names) from None
        return None
    except (urllib.error.URLError, OSError) as e:  # refused, no such host, timed out
        raise _unreachable(where, "GET /models", e) from None
    except ValueError:
        return None
    cards = answer.get("data") if isinstance(answer, dict) else None
    return [c for c in cards if isinstance(c, dict)] if isinstance(cards, list) else None


def _asked(where: str, what: str, names: tuple[str, str], call: Any, *, not_found: str | None = None) -> Any:
    """``call()``'s answer; its failure as the one line that fits it."""
    try:
        return call()
    except urllib.error.HTTPError as e:
        if e.code == 404 and not_found:
            raise UserError(not_found) from None
        raise _refusal(where, what, e, names) from None
    except (urllib.error.URLError, OSError) as e:  # refused, no such host, timed out
        raise _unreachable(where, what, e) from None
    except ValueError:
        raise UserError(
            f"{where} does not answer {what} with JSON: check {names[0]} (an OpenAI-compatible base URL, "
            "usually ending in /v1)."
        ) from None


def _refusal(where: str, what: str, e: urllib.error.HTTPError, names: tuple[str, str]) -> UserError:
    """An HTTP error answer as one line with the hint of its status; 75 where a retry may heal it."""
    said = _server_message(e)
    hint = failure_hint(f"HTTP {e.code}", said, url_flag=names[0]).replace("--judge_model", names[1])
    line = f"{where} answered HTTP {e.code} to {what}{f' ({said})' if said else ''}: {hint}."
    return ServiceUnavailable(_before_gpus(line)) if retryable_status(e.code) else UserError(line)


def _unreachable(where: str, what: str, e: OSError) -> ServiceUnavailable:
    reason = " ".join(str(getattr(e, "reason", e)).split())[:120]
    return ServiceUnavailable(_before_gpus(f"{where} is unreachable ({what}: {reason})"))


def _before_gpus(line: str) -> str:
    return (
        f"{line.rstrip('.')}; the evaluation would fail after training: start the judge (a vLLM judge loads its model for "
        "minutes) or fix judge_base_url, then submit the run again; judge_check=false skips this check."
    )
