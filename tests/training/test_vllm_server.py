"""Server mode's pure parts (``rloo.training.vllm_server``) and its refusals, without vLLM.

The request body is checked field by field against vLLM's ``CompletionRequest``
(vllm/entrypoints/openai/completion/protocol.py) where vLLM is installed (tests/training/test_vllm_real_api.py
and tests/vllm_engine/test_server_mode.py run it against a real server); the answer's shape is the one
vllm/entrypoints/openai/completion/serving.py builds (``choices[i].token_ids`` with ``return_token_ids``,
``logprobs.token_logprobs``).
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load

from rloo.config import RLOOConfig
from rloo.errors import UserError
from rloo.generation import SamplingParams
from rloo.training import vllm_server as vs
from rloo.training.vllm_backend import build_requests
from tests.fixtures import recipes, zygote
from tests.fixtures.servers import free_port

REQUIRED = {"model_name_or_path": "/models/policy", "dataset_name": "/data/prompts", "reward_funcs": ["m:f"]}
PARAMS = SamplingParams(
    max_new_tokens=4, temperature=0.7, top_k=0, top_p=1.0, pad_token_id=0, stop_token_id=2
)


def test_a_request_body_is_the_engines_sampling_params_with_token_ids_in_and_out() -> None:
    (request,) = build_requests([[5, 6, 7]], 1, PARAMS, torch.tensor([[123]]), return_logprobs=True)
    body = vs.completion_body(request, "policy")
    assert body["model"] == "policy" and body["prompt"] == [5, 6, 7] and body["return_token_ids"] is True
    assert body["seed"] == 123 and body["n"] == 1 and body["max_tokens"] == 4
    assert body["temperature"] == 0.7 and body["top_k"] == -1 and body["stop_token_ids"] == [2]
    assert body["ignore_eos"] is True and body["logprobs"] == 0
    assert "detokenize" not in body  # not a field of the completions API: the server would only warn
    (plain,) = build_requests([[5]], 1, PARAMS, torch.tensor([[1]]))
    assert "logprobs" not in vs.completion_body(plain, "policy")  # None: not asked for


def test_an_answer_gives_the_token_ids_and_the_sampled_log_probs() -> None:
    answer = {"choices": [{"token_ids": [9, 2], "logprobs": {"token_logprobs": [-0.5, -1.25]}}]}
    got = vs.parse_completion(answer, with_logprobs=True)
    assert got.token_ids == [9, 2] and got.logprobs == [-0.5, -1.25]
    assert vs.parse_completion(answer, with_logprobs=False).logprobs is None
    short = {"choices": [{"token_ids": [9, 2], "logprobs": {"token_logprobs": [-0.5]}}]}
    with pytest.raises(ValueError, match="1 log-probs for 2 tokens"):
        vs.parse_completion(short, with_logprobs=True)


def test_weights_go_in_bounded_chunks_and_come_back_whole() -> None:
    weights = [(f"w{i}", torch.full((256,), float(i))) for i in range(10)]  # 1 KiB each
    chunks = list(vs.weight_chunks(weights, limit=3 * 1024))
    assert len(chunks) == 4  # 3 + 3 + 3 + 1
    back = {k: v for c in chunks for k, v in load(c).items()}
    assert sorted(back) == sorted(n for n, _ in weights)
    assert all(torch.equal(back[n], t) for n, t in weights)
    big = list(vs.weight_chunks([("big", torch.zeros(2048))], limit=1024))  # larger than the limit: alone
    assert len(big) == 1
    embed = torch.ones(4, 2)
    (tied,) = vs.weight_chunks([("embed.weight", embed), ("lm_head.weight", embed), ("row", embed[1])])
    assert sorted(load(tied)) == ["embed.weight", "lm_head.weight", "row"]  # tied: under both names


INFO = {"architectures": ["Qwen2ForCausalLM"], "vocab_size": 300, "max_model_len": 512, "logprobs_mode": ""}


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"architectures": ["LlamaForCausalLM"]}, "serves a LlamaForCausalLM model"),
        ({"vocab_size": 301}, "vocabulary of 301 tokens"),
        ({"max_model_len": 100}, "--max-model-len 200"),
        ({"logprobs_mode": "raw_logprobs"}, "rloo vllm-serve"),
    ],
)
def test_a_server_that_serves_something_else_is_refused_in_one_line(
    change: dict[str, Any], says: str
) -> None:
    vs.check_served_model(INFO, url="u", architectures=["Qwen2ForCausalLM"], vocab_size=300, needed_len=200)
    with pytest.raises(UserError, match=says) as e:
        vs.check_served_model(
            {**INFO, **change}, url="u", architectures=["Qwen2ForCausalLM"], vocab_size=300, needed_len=200
        )
    assert "\n" not in str(e.value) and e.value.exit_code == 2


def test_the_server_url_comes_from_the_base_url_or_host_and_port() -> None:
    server = {**REQUIRED, "use_vllm": True, "vllm_mode": "server"}
    assert RLOOConfig(**server, vllm_server_port=9000).vllm_server_url == "http://0.0.0.0:9000"
    url = RLOOConfig(**server, vllm_server_base_url="http://svc:8000/v1/").vllm_server_url
    assert url == "http://svc:8000"


class _Flaky:
    """A server that fails its first ``failures`` requests with ``code``, then answers ``/v1/models``."""

    def __init__(self, failures: int, code: int) -> None:
        self.failures, self.code, self.seen = failures, code, 0
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                owner.seen += 1
                ok = owner.seen > owner.failures
                data = json.dumps({"data": [{"id": "policy"}]} if ok else {"error": "busy"}).encode()
                self.send_response(200 if ok else owner.code)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()


@pytest.fixture
def flaky(request: pytest.FixtureRequest) -> Iterator[_Flaky]:
    server = _Flaky(*request.param)
    yield server
    server.httpd.shutdown()


@pytest.mark.parametrize("flaky", [(2, 503)], indirect=True)
def test_a_server_error_is_retried_until_it_answers(flaky: _Flaky) -> None:
    assert vs.VLLMServerClient(flaky.url, timeout=30).served_model() == "policy"
    assert flaky.seen == 3


@pytest.mark.parametrize("flaky", [(1, 404)], indirect=True)
def test_a_refusal_is_not_retried(flaky: _Flaky) -> None:
    with pytest.raises(UserError, match=r"refused /v1/models \(404\)") as e:
        vs.VLLMServerClient(flaky.url, timeout=30).served_model()
    assert e.value.exit_code == 2 and flaky.seen == 1


def test_a_server_out_of_reach_is_75_after_the_timeout() -> None:
    client = vs.VLLMServerClient(f"http://127.0.0.1:{free_port()}", timeout=1.5)
    with pytest.raises(vs.GeneratorLost, match=r"did not answer /v1/models for 2 s") as e:
        client.served_model()
    assert e.value.exit_code == 75


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"vllm_mode": "server"}, "--vllm_mode server generates with vLLM: add --use_vllm."),
        ({"vllm_server_port": 9000}, "--vllm_server_port points at a rollout server"),
        (
            {"use_vllm": True, "vllm_mode": "server", "vllm_server_base_url": "localhost:8000"},
            "--vllm_server_base_url localhost:8000 is not a URL: give http://host:port",
        ),
        (
            {"use_vllm": True, "vllm_mode": "server", "vllm_enable_sleep_mode": True},
            "--vllm_enable_sleep_mode sets up a colocated engine",
        ),
    ],
)
def test_server_flags_that_do_not_fit_together_are_refused(fields: dict[str, Any], says: str) -> None:
    with pytest.raises(UserError, match=re.escape(says)):
        RLOOConfig(**REQUIRED, **fields)
    RLOOConfig(**REQUIRED, use_vllm=True, vllm_mode="server", vllm_server_port=9000)  # together they fit


def test_a_run_whose_server_never_answers_exits_75_in_one_line(
    tiny_setup, toy_dataset: Path, tmp_path: Path
) -> None:
    """Before the first update: nothing to checkpoint, and the same command may work once the server is
    up (a pipeline step retries on 75)."""
    out = tmp_path / "out"
    flags = recipes.argv(tiny_setup, toy_dataset, out, use_vllm=True, vllm_mode="server")
    flags += ["--vllm_server_base_url", f"http://127.0.0.1:{free_port()}", "--vllm_server_timeout", "1"]
    proc = zygote.run(["-m", "rloo.cli", "train", *flags], env=recipes.subprocess_env(), cwd=tmp_path)
    assert proc.returncode == 75, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("rloo train: error: the vLLM server at http://127.0.0.1:") and "1 s" in last
    assert not list(out.glob("checkpoint-*"))
