"""Rollouts from a running vLLM server (``--vllm_mode server``), behind the same ``Generator`` interface.

The server is vLLM's OpenAI-compatible one started by ``rloo vllm-serve`` (its own pod or a role of the
TrainJob, with its own GPUs and tensor parallelism): each training process sends its rollout's P*K
completions as P*K concurrent ``/v1/completions`` requests, token ids in and out, one seed per completion,
so the sampling is the colocated engine's (``vllm_backend.build_requests``: same keywords, same seeds, the
same conversion to ``Generated``). After each optimizer step the first process sends the policy's weights
(under LoRA with the adapter merged in) through ``POST /collective_rpc`` into the server's workers
(``vllm_weight_sync.WeightSync``), in chunks of safetensors bytes loaded in one reload, and drops the
server's prefix cache; the other processes wait for it, so no rollout samples from stale weights.

At start the server is checked: reachable, serving the extension, the policy's architecture and vocabulary, a
context that holds the longest prompt plus the response, log-probs after temperature (one-line errors).
A server that stops answering is retried for ``--vllm_server_timeout`` seconds; then every process raises
``GeneratorLost`` together and the trainer checkpoints the update's start and exits 75.
"""

from __future__ import annotations

import base64
import json
import logging
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from rloo.errors import ServiceUnavailable, UserError
from rloo.generation import Generated, GenerationSettings, SamplingParams
from rloo.training.vllm_backend import (
    Completion,
    Request,
    build_requests,
    completions_to_generated,
    engine_logprobs_usable,
    policy_weights,
    strip_left_padding,
)
from rloo.training.vllm_weight_sync import INFO_METHOD, STAGE_METHOD, WEIGHTS_METHOD

log = logging.getLogger(__name__)

CHUNK_BYTES = 64 << 20  # weights per /collective_rpc call: bounded request bodies, whatever the model
MAX_IN_FLIGHT = 64  # concurrent completion requests per process (the server batches them)
RETRY_S = (0.5, 1.0, 2.0, 4.0, 8.0)  # waits between tries, the last repeated until the timeout
TRANSIENT = (502, 503, 504)  # a proxy or a server still starting: retried until the timeout
SERVER_ERROR_TRIES = 3  # any other 5xx (a worker's exception) is tried this often


class GeneratorLost(ServiceUnavailable):
    """The rollout server stopped answering: the run checkpoints and exits 75 (a retry may find it back)."""


# ------------------------------------------------------------------------------------------------------
# requests and answers: pure
def completion_body(request: Request, model: str) -> dict[str, Any]:
    """One ``/v1/completions`` request: the colocated engine's ``SamplingParams`` keywords, token ids in
    and out (``return_token_ids``), nothing decoded that the trainer does not read."""
    body: dict[str, Any] = {"model": model, "prompt": request.prompt_token_ids, "return_token_ids": True}
    for key, value in request.sampling.items():
        if key == "detokenize" or value is None:  # text is the server's concern; None: not asked for
            continue
        body[key] = value
    return body


def parse_completion(answer: dict[str, Any], *, with_logprobs: bool) -> Completion:
    """A ``/v1/completions`` answer of one n=1 request -> its completion (token ids, sampled log-probs)."""
    (choice,) = answer["choices"]
    tokens = [int(t) for t in choice["token_ids"]]
    if not with_logprobs:
        return Completion(tokens)
    logprobs = [float(x) for x in choice["logprobs"]["token_logprobs"]]
    if len(logprobs) != len(tokens):
        raise ValueError(f"{len(logprobs)} log-probs for {len(tokens)} tokens in the server's answer")
    return Completion(tokens, logprobs)


def weight_chunks(weights: Iterable[tuple[str, torch.Tensor]], limit: int = CHUNK_BYTES) -> Iterator[bytes]:
    """Safetensors payloads of at most ``limit`` bytes of tensor data each (a larger tensor goes alone).

    Tied tensors go under each of their names, as the colocated push hands them over: vLLM's layer-wise
    reload puts a layer that got nothing back to its old tensors, which would untie a tied LM head from the
    new embeddings (vllm/model_executor/model_loader/reload/layerwise.py). Each is copied, so no two
    tensors of a payload share memory (safetensors refuses that)."""
    from safetensors.torch import save

    chunk: dict[str, torch.Tensor] = {}
    size = 0
    for name, tensor in weights:
        nbytes = tensor.numel() * tensor.element_size()
        if chunk and size + nbytes > limit:
            yield save(chunk)
            chunk, size = {}, 0
        chunk[name] = tensor.detach().to("cpu", copy=True).contiguous()  # its own storage: at most a chunk
        size += nbytes
    if chunk:
        yield save(chunk)


def check_served_model(
    info: dict[str, Any], *, url: str, architectures: list[str], vocab_size: int, needed_len: int
) -> None:
    """A one-line UserError unless the server serves the policy's model with a long enough context."""
    served = info.get("architectures") or []
    if architectures and served and served != architectures:
        raise UserError(
            f"the vLLM server at {url} serves a {'/'.join(served)} model, the policy is a "
            f"{'/'.join(architectures)}: start the server on the policy's starting checkpoint"
        )
    if int(info["vocab_size"]) != vocab_size:
        raise UserError(
            f"the vLLM server at {url} has a vocabulary of {info['vocab_size']} tokens, the policy "
            f"{vocab_size}: start the server on the policy's starting checkpoint"
        )
    if int(info["max_model_len"]) < needed_len:
        raise UserError(
            f"the vLLM server at {url} holds {info['max_model_len']} tokens per sequence, the longest prompt "
            f"plus --response_length needs {needed_len}: restart it with --max-model-len {needed_len} or more"
        )
    if info.get("logprobs_mode") not in (None, "", "processed_logprobs"):
        raise UserError(
            f"the vLLM server at {url} returns {info['logprobs_mode']}, the trainer needs log-probs after "
            "temperature: start it with 'rloo vllm-serve' (it sets --logprobs-mode processed_logprobs)"
        )


# ------------------------------------------------------------------------------------------------------
# HTTP
class VLLMServerClient:
    """The calls the trainer makes to the server; connection failures and 5xx answers are retried for
    ``timeout`` seconds, then raise GeneratorLost."""

    def __init__(self, base_url: str, *, timeout: float) -> None:
        self.base_url = base_url
        self.timeout = timeout
        self.headers = {"Content-Type": "application/json"}

    def _once(self, path: str, body: Any | None, post: bool) -> Any:
        method = "POST" if post or body is not None else "GET"
        data = None if method == "GET" else json.dumps(body or {}).encode()
        req = urllib.request.Request(self.base_url + path, data=data, headers=self.headers, method=method)
        with urllib.request.urlopen(req, timeout=max(self.timeout, 60.0)) as resp:
            return json.loads(resp.read() or b"null")

    def call(self, path: str, body: Any | None = None, *, post: bool = False) -> Any:
        """POST ``body`` (GET without one, unless ``post``) to ``path``; the decoded JSON answer."""
        deadline = time.monotonic() + self.timeout
        tries = 0
        while True:
            try:
                return self._once(path, body, post)
            except urllib.error.HTTPError as e:
                detail = e.read().decode(errors="replace")[:300].replace("\n", " ")
                if e.code < 500:
                    raise UserError(
                        f"the vLLM server at {self.base_url} refused {path} ({e.code}): {detail}"
                    ) from None
                why = f"HTTP {e.code}: {detail}"
                if e.code not in TRANSIENT and tries + 1 >= SERVER_ERROR_TRIES:  # a failure, not an outage
                    raise GeneratorLost(f"the vLLM server at {self.base_url} failed {path} ({why})") from None
            except (OSError, ValueError) as e:  # refused, reset, timed out, a half-written answer
                why = f"{type(e).__name__}: {e}"
            left = deadline - time.monotonic()
            if left <= 0:
                raise GeneratorLost(
                    f"the vLLM server at {self.base_url} did not answer {path} for {self.timeout:.0f} s "
                    f"({why}); start it with 'rloo vllm-serve' or check --vllm_server_base_url"
                )
            time.sleep(min(RETRY_S[min(tries, len(RETRY_S) - 1)], left))
            tries += 1

    def served_model(self) -> str:
        """The name the server serves its model under (``/v1/models``)."""
        models = self.call("/v1/models")
        return str(models["data"][0]["id"])

    def rpc(self, method: str, **kwargs: Any) -> Any:
        """A method of every server worker (the extension's); the first worker's answer."""
        answer = self.call("/collective_rpc", {"method": method, "kwargs": kwargs})
        return answer["results"][0]

    def model_info(self) -> dict[str, Any]:
        try:
            return dict(self.rpc(INFO_METHOD))
        except UserError as e:
            if isinstance(e, ServiceUnavailable):
                raise
            raise UserError(
                f"the vLLM server at {self.base_url} cannot take the policy's weights ({e}): start it with "
                "'rloo vllm-serve', which adds them (VLLM_SERVER_DEV_MODE=1 and the weight-sync extension)"
            ) from None

    def await_version(self, version: int | None) -> None:
        """Return once the server reports the weights of ``version`` (another process pushes them); a server
        that does not within the timeout is lost."""
        deadline = time.monotonic() + self.timeout
        while self.rpc(INFO_METHOD).get("version") != version:
            if time.monotonic() > deadline:
                raise GeneratorLost(
                    f"the vLLM server at {self.base_url} did not get the weights of optimizer step {version} "
                    f"from the first process in {self.timeout:.0f} s"
                )
            time.sleep(0.05)

    def complete(self, requests: list[Request], model: str, *, with_logprobs: bool) -> list[Completion]:
        """Every request's completion, in order; sent concurrently (the server batches them)."""
        if not requests:
            return []
        with ThreadPoolExecutor(max_workers=min(MAX_IN_FLIGHT, len(requests))) as pool:
            answers = list(
                pool.map(lambda r: self.call("/v1/completions", completion_body(r, model)), requests)
            )
        return [parse_completion(a, with_logprobs=with_logprobs) for a in answers]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int | None) -> int:
        """Send ``weights`` (checkpoint names) to the server's workers in chunks, load them in one reload,
        and drop the KV blocks computed with the old ones; the number of tensors loaded."""
        return self.load_payloads(weight_chunks(weights), version)

    def load_payloads(self, payloads: Iterable[bytes], version: int | None) -> int:
        """:meth:`load_weights` of weights already in :func:`weight_chunks`' payloads."""
        for payload in payloads:
            self.rpc(STAGE_METHOD, data=base64.b64encode(payload).decode())
        loaded = int(self.rpc(WEIGHTS_METHOD, version=version)["tensors"])
        reset = self.call("/reset_prefix_cache", post=True)
        if isinstance(reset, dict) and reset.get("success") is False:
            raise GeneratorLost(
                f"the vLLM server at {self.base_url} kept its prefix cache (requests in flight?)"
            )
        return loaded


# ------------------------------------------------------------------------------------------------------
# the generator
def agree_on_failure(accelerator: Any, failure: UserError | None, source: str) -> None:
    """Every process raises together, the same kind of error (a lone one would leave the others in a
    collective, and a checkpoint is taken by all or none): a refusal (2) wins over a lost ``source`` (75)."""
    if accelerator is None or accelerator.num_processes == 1:
        if failure is not None:
            raise failure
        return
    kind = 0 if failure is None else 2 if not isinstance(failure, GeneratorLost) else 1
    worst = int(accelerator.reduce(torch.tensor([kind], device=accelerator.device), reduction="max").item())
    if worst == 0:
        return
    if failure is not None and kind == worst:
        raise failure
    if worst == 1:
        raise GeneratorLost(f"{source} stopped answering another process")
    raise UserError(f"{source} refused another process's request (its error says why)")


class VLLMServerGenerator:
    """``Generator`` backed by a vLLM server that mirrors the training ``model`` (see the module's doc)."""

    should_stop: Callable[[], bool] | None = None
    weights_version: int | None = None  # the trainer's optimizer steps; pushed when it changed

    def __init__(self, client: VLLMServerClient, model: Any, *, accelerator: Any, served_model: str) -> None:
        # True while asynchronous generation runs generate on a worker beside the training collectives:
        # sync_weights (on the training thread) only copies the weights, generate sends them (the first
        # process; the others wait for the server to report them), and a failure is raised in this process
        # only, for the caller to agree on after joining the worker (agree_on_failure)
        self.on_worker = False
        self._staged: list[bytes] | None = None  # the first process's copy of the weights, not sent yet
        self._awaited: int | None = None  # the others: the version the server must report before they sample
        self.client = client
        self.model = model
        self.accelerator = accelerator
        self.served_model = served_model
        # unknown: the server may hold another run's weights, so the first rollout pushes them all the same
        self._pushed_version: int | None = -1

    def _agree(self, failure: UserError | None) -> None:
        agree_on_failure(self.accelerator, failure, f"the vLLM server at {self.client.base_url}")

    def push_weights(self) -> None:
        """The first process sends the changed weights; every process gathers (ZeRO-3) and waits."""
        first = self.accelerator is None or self.accelerator.is_main_process
        failure: UserError | None = None
        weights = policy_weights(self.model, self.accelerator)
        if first:
            try:
                sent = self.client.load_weights(weights, self.weights_version)
                log.debug("pushed %d tensors to the vLLM server (version %s)", sent, self.weights_version)
            except UserError as e:  # lost (75) or refused (2)
                failure = e
        for _ in weights:  # the rest of the collective gathers, on every process
            pass
        self._agree(failure)

    def sync_weights(self) -> None:
        """The policy's weights pushed when ``weights_version`` moved since the last push; on a worker
        (``on_worker``) copied now, for the next ``generate`` to send."""
        if self.weights_version is not None and self.weights_version == self._pushed_version:
            return
        if self.on_worker:
            self._stage()
        else:
            self.push_weights()
        self._pushed_version = self.weights_version

    def _stage(self) -> None:
        """The weights as the payloads the push sends, copied to host memory by the first process (every
        process runs the gathers); the others note the version to wait for."""
        first = self.accelerator is None or self.accelerator.is_main_process
        weights = policy_weights(self.model, self.accelerator)
        self._staged = list(weight_chunks(weights)) if first else None
        for _ in weights:  # the rest of the collective gathers, on every process
            pass
        self._awaited = None if first else self.weights_version

    def _send_staged(self) -> None:
        """The weights copied by :meth:`_stage` loaded into the server (first process), or waited for."""
        if self._staged is not None:
            payloads, self._staged = self._staged, None
            self.client.load_payloads(payloads, self._pushed_version)
        elif self._awaited is not None:
            version, self._awaited = self._awaited, None
            self.client.await_version(version)

    def generate(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        k: int,
        params: SamplingParams,
        seeds: torch.Tensor,
        *,
        return_logprobs: bool = False,
    ) -> Generated:
        self.sync_weights()
        requests = build_requests(
            strip_left_padding(prompt_ids, prompt_mask), k, params, seeds, return_logprobs=return_logprobs
        )
        with_logprobs = return_logprobs and engine_logprobs_usable(params)
        failure: UserError | None = None
        completions: list[Completion] = []
        try:
            self._send_staged()
            completions = self.client.complete(requests, self.served_model, with_logprobs=with_logprobs)
        except UserError as e:  # lost (75) or refused (2)
            failure = e
        if not self.on_worker:
            self._agree(failure)
        elif failure is not None:
            raise failure
        return completions_to_generated(
            completions, params, with_logprobs=with_logprobs, device=prompt_ids.device
        )


def make_server_generator(
    settings: GenerationSettings, model: Any, *, accelerator: Any, max_model_len: int
) -> VLLMServerGenerator:
    """A generator on the server at ``settings.vllm_server_url``, checked against the policy ``model``
    (prepared) and the longest prompt plus the response (``max_model_len``)."""
    url = settings.vllm_server_url
    assert url is not None, "server mode without a server URL"
    bare = accelerator.unwrap_model(model) if accelerator is not None else model
    config = bare.config
    client = VLLMServerClient(url, timeout=settings.vllm_server_timeout)
    served = client.served_model()  # waits for a server still starting, up to the timeout
    check_served_model(
        client.model_info(),
        url=url,
        architectures=list(getattr(config, "architectures", None) or []),
        vocab_size=int(config.vocab_size),
        needed_len=max_model_len,
    )
    log.info("rollouts: the vLLM server at %s (model %s)", url, served)
    return VLLMServerGenerator(client, model, accelerator=accelerator, served_model=served)
