"""A small OpenAI-compatible chat server whose answers are scripted by markers in the judged responses.

It reads the two responses out of the default (pairwise) judge template and answers:
- the letter of the response containing ``GOOD`` (``A`` when both or neither do: a position-biased judge);
  with ``grade`` (a function of a response's text), the letter of the higher-graded one (``A`` on a tie);
- ``I like both of them`` (unparseable) when a response contains ``MALFORMED``;

and the one response of the default pointwise template: ``SCORE<text>`` in it answers ``<text>`` (``SCORE7``:
``7``), ``MALFORMED`` the unparseable line; else, with ``grade``, ``round(10 * grade(response))``, else ``5``.
Besides:
- ``E429xN`` / ``E500xN`` / ``STALLxN``: the first N requests with that exact body get HTTP 429 / 500 / no
  answer for ``stall_seconds`` (longer than the client's timeout);
- HTTP 401 for a key other than ``API_KEY`` and 404 for a model other than ``MODEL``;
- with ``context_chars``, HTTP 400 with vLLM's context-length message for a longer request;
- ``GET /models``: ``MODEL``'s card, with ``max_model_len`` when given (as vLLM's
  vllm/entrypoints/openai/models/serving.py, show_available_models, lists it).
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import Counter
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

API_KEY = "sk-test"
MODEL = "judge"


def _pointwise_response(content: str) -> str | None:
    m = re.search(r"## Response\n\n(.*)\n\nHow good is the response", content, re.S)
    return m.group(1) if m else None


def _pointwise_answer(response: str, grade: Callable[[str], float] | None) -> str:
    scripted = re.search(r"SCORE(\S+)", response)
    if scripted:
        return scripted.group(1)
    if "MALFORMED" in response:
        return "I like both of them"
    return str(round(10 * grade(response))) if grade is not None else "5"


def _responses(content: str) -> tuple[str, str]:
    m = re.search(r"## Response A\n\n(.*)\n\n## Response B\n\n(.*)\n\nWhich response", content, re.S)
    return (m.group(1), m.group(2)) if m else ("", "")


class ScriptedJudge:
    def __init__(
        self,
        stall_seconds: float = 3.0,
        context_chars: int | None = None,
        max_model_len: int | None = None,
        grade: Callable[[str], float] | None = None,
    ) -> None:
        self.grade = grade
        self.stall_seconds = stall_seconds
        self.context_chars = context_chars
        self.max_model_len = max_model_len
        self.seen: Counter[str] = Counter()  # request body -> times received
        self.requests = 0
        self.lock = threading.Lock()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:  # keep pytest output clean
                pass

            def _send(self, code: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                if self.headers.get("Authorization") != f"Bearer {API_KEY}":
                    return self._send(401, {"error": {"message": "bad key", "type": "invalid_api_key"}})
                if not self.path.rstrip("/").endswith("/v1/models"):
                    return self._send(404, {"error": {"message": "no such route"}})
                card: dict[str, Any] = {"id": MODEL, "object": "model", "created": 0, "owned_by": "test"}
                if owner.max_model_len is not None:
                    card["max_model_len"] = owner.max_model_len
                self._send(200, {"object": "list", "data": [card]})

            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with owner.lock:
                    owner.requests += 1
                    owner.seen[raw.decode()] += 1
                    nth = owner.seen[raw.decode()]
                if self.headers.get("Authorization") != f"Bearer {API_KEY}":
                    return self._send(401, {"error": {"message": "bad key", "type": "invalid_api_key"}})
                if not self.path.endswith("/v1/chat/completions"):
                    return self._send(404, {"error": {"message": "no such route"}})
                req = json.loads(raw)
                if req.get("model") != MODEL:
                    return self._send(404, {"error": {"message": f"model {req.get('model')} not found"}})
                content = req["messages"][-1]["content"]
                if owner.context_chars is not None and len(content) > owner.context_chars:
                    message = (
                        f"This model's maximum context length is {owner.context_chars} tokens. However, your "
                        f"prompt contains at least {len(content)} input tokens."
                    )
                    return self._send(400, {"object": "error", "message": message, "code": 400})
                a, b = _responses(content)
                for kind in ("E429", "E500", "STALL"):
                    m = re.search(kind + r"x(\d+)", content)
                    if m and nth <= int(m.group(1)):
                        if kind == "E429":
                            return self._send(429, {"error": {"message": "slow down"}}, {"retry-after": "0"})
                        if kind == "E500":
                            return self._send(500, {"error": {"message": "boom"}})
                        time.sleep(owner.stall_seconds)
                        return self._send(500, {"error": {"message": "late"}})
                pointwise = _pointwise_response(content)
                if pointwise is not None:
                    answer = _pointwise_answer(pointwise, owner.grade)
                elif "MALFORMED" in a or "MALFORMED" in b:
                    answer = "I like both of them"
                elif owner.grade is not None:
                    answer = "B" if owner.grade(b) > owner.grade(a) else "A"
                elif "GOOD" in b and "GOOD" not in a:
                    answer = "B"
                else:
                    answer = "A"
                self._send(
                    200,
                    {
                        "id": "x",
                        "object": "chat.completion",
                        "created": 0,
                        "model": MODEL,
                        "choices": [
                            {
                                "index": 0,
                                "finish_reason": "stop",
                                "message": {"role": "assistant", "content": answer},
                            }
                        ],
                    },
                )

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        # a stalled request's client has hung up by the time we answer: that broken pipe is expected
        self.server.handle_error = lambda request, client_address: None  # type: ignore[method-assign]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def __enter__(self) -> ScriptedJudge:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.shutdown()
        self.server.server_close()
