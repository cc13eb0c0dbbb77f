"""A local OpenAI-compatible judge for the toy task, so the pipeline's evaluation runs with nothing downloaded.

The judge reads the two responses out of the judge prompt (the default template of :mod:`rloo.eval.config`)
and prefers the one :func:`rloo.demo.toy.letter_reward` scores higher: the toy task's own criterion, a degree
(the fraction of vowels), not a pass mark, so the win rates of a local run mean what they would mean with a
real judge on a real task. Equal scores answer ``A``, as a position-biased judge does when it cannot tell two
answers apart: the evaluation asks both orders, so such a pair comes out as a tie (half a win). Against the
graded references of :func:`rloo.demo.toy.write_toy_eval_dataset` (vowel fractions spread from 0 to 1) a
model's win rate is then about its own vowel fraction: an untrained model wins about a third of the pairs,
and two runs that learnt different amounts get different win rates.

Serves ``POST /v1/chat/completions`` and ``GET /v1/models`` on 127.0.0.1 from a background thread::

    with ToyJudge() as judge:
        print(judge.base_url)  # http://127.0.0.1:PORT/v1
"""

from __future__ import annotations

import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from rloo.demo.toy import letter_reward

MODEL = "toy-judge"
# The default template's section headings; a custom template without them gets an unparseable answer.
_SECTIONS = re.compile(r"## Response A\n\n(.*)\n\n## Response B\n\n(.*)\n\nWhich response", re.S)


def verdict(content: str) -> str:
    """``A`` or ``B`` for a judge prompt, by the toy reward of each response; a short refusal when the prompt
    does not have the default template's layout (the evaluation records that as an invalid answer)."""
    m = _SECTIONS.search(content)
    if not m:
        return "I cannot find two responses to compare."
    score_a, score_b = letter_reward([m.group(1), m.group(2)])
    assert score_a is not None and score_b is not None
    return "B" if score_b > score_a else "A"


class ToyJudge:
    """The judge server; a context manager (``start``/``stop``). ``requests``: chat requests answered."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.requests = 0
        self._lock = threading.Lock()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:  # the pipeline's own log is enough
                pass

            def _send(self, code: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                if self.path.rstrip("/").endswith("/models"):
                    return self._send(200, {"object": "list", "data": [_model_card()]})
                return self._send(404, {"error": {"message": f"no route {self.path}"}})

            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if not self.path.endswith("/chat/completions"):
                    return self._send(404, {"error": {"message": f"no route {self.path}"}})
                try:
                    req = json.loads(raw)
                    content = str(req["messages"][-1]["content"])
                except (ValueError, KeyError, IndexError, TypeError):
                    return self._send(400, {"error": {"message": "expected an OpenAI chat request"}})
                if req.get("model") != MODEL:
                    return self._send(404, {"error": {"message": f"model {req.get('model')!r} not found"}})
                with owner._lock:
                    owner.requests += 1
                return self._send(200, _completion(verdict(content)))

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        host, port = self._server.server_address[:2]
        assert isinstance(host, str)  # an AF_INET server (typeshed also allows a Unix socket's bytes)
        return f"http://{host}:{port}/v1"

    def start(self) -> ToyJudge:
        self._thread = threading.Thread(target=self._server.serve_forever, name="toy-judge", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> ToyJudge:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _model_card() -> dict[str, Any]:
    return {"id": MODEL, "object": "model", "created": 0, "owned_by": "rloo"}


def _completion(text: str) -> dict[str, Any]:
    return {
        "id": "toy-judge",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": MODEL,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 0, "completion_tokens": 1, "total_tokens": 1},
    }
