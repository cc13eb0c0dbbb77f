"""Colocated vLLM generation behind the same ``Generator`` interface as ``TransformersGenerator``.

Every process of the run keeps its own vLLM engine on its own GPU (TRL's "colocate" mode): the engine
loads the starting checkpoint once, then receives the policy's weights before each generation, so it always
samples from the policy being trained. With ``enable_sleep_mode`` the engine releases its weights and KV
cache (sleep level 2) between generations, leaving the GPU memory to the optimisation phase.

What ``generate`` promises matches ``TransformersGenerator``:

- completions come back prompt-major (row ``p*K + j`` is sample ``j`` of prompt ``p``), right-padded with
  the pad id to exactly ``max_new_tokens`` columns;
- only the stop token ends a completion (the model's EOS does not, unless it is the stop token), and with
  no stop token every completion is exactly ``max_new_tokens`` long;
- each completion is its own request seeded with its counter-based seed (``generation.row_seeds``).

What does *not* hold by default: that a completion is independent of how prompts are batched. The seed fixes
the random draws, but vLLM's logits are not batch-invariant (kernels reduce in an order that depends on the
batch), so with other neighbours a token near a tie can come out differently, and a run is not bit-for-bit
reproducible across layouts. ``vllm_batch_invariant`` sets ``VLLM_BATCH_INVARIANT=1`` (vLLM's batch-invariant
kernels: same logits whatever the batch, at some speed cost, on GPUs and models vLLM supports for it).
Seeded requests are also slower than unseeded ones in vLLM's older model runner (a per-request generator).

Everything that does not touch the engine (padding, request building, output conversion, weight names,
process-group variables, engine arguments) is a pure function here, tested without vLLM; where vLLM is
installed, tests check every keyword against its real ``SamplingParams``/``EngineArgs``.
``VLLMGenerator`` is a thin shell around them that only runs on a GPU (tests marked ``gpu``). The supported
releases are the ``vllm`` extra's (0.27-0.30: ``reload_weights`` through ``collective_rpc``,
``logprobs_mode``, sleep-mode tags, the in-process ``external_launcher`` executor).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import socket
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rloo.errors import UserError
from rloo.generation import (
    Generated,
    GenerationSettings,
    Generator,
    SamplingParams,
    TransformersGenerator,
)
from rloo.training import deepspeed_utils, precision
from rloo.vllm_support import CPU, cpu_engine_kwargs, require_vllm_here

__all__ = [
    "Completion",
    "Request",
    "VLLMGenerator",
    "WeightPushError",
    "build_requests",
    "completions_to_generated",
    "create_colocated_llm",
    "distributed_env",
    "engine_dtype",
    "engine_env",
    "engine_kwargs",
    "engine_logprobs_usable",
    "extract_completion",
    "make_generator",
    "make_vllm_generator",
    "named_weights",
    "policy_weights",
    "push_weights",
    "require_vllm",
    "sampling_kwargs",
    "strip_left_padding",
    "vllm_available",
    "vllm_weight_name",
]

log = logging.getLogger(__name__)

# Name segments that wrappers add to parameter names but a checkpoint does not have (torch.compile,
# activation checkpointing, FSDP); DDP adds a leading "module.". vLLM's load_weights expects checkpoint names.
_WRAPPER_SEGMENTS = frozenset({"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"})


# ------------------------------------------------------------------------------------------------------
# availability
def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def require_vllm() -> str:
    """The platform vLLM runs on here ("cuda" or "cpu"), or a one-line UserError (not installed, or the
    CUDA build without a GPU)."""
    return require_vllm_here("--use_vllm", "drop --use_vllm to generate with transformers")


# ------------------------------------------------------------------------------------------------------
# requests
@dataclass(frozen=True)
class Request:
    """One completion to sample: its prompt tokens and the keyword arguments of vLLM's SamplingParams."""

    prompt_token_ids: list[int]
    sampling: dict[str, Any]


def strip_left_padding(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> list[list[int]]:
    """(P, L) padded ids and mask -> P token lists holding the real tokens only."""
    ids, mask = prompt_ids.cpu(), prompt_mask.cpu().bool()
    return [row[m].tolist() for row, m in zip(ids, mask, strict=True)]


def engine_logprobs_usable(params: SamplingParams) -> bool:
    """Whether the engine's sampled-token log-probs mean what ``Generated.logprobs`` promises.

    ``Generated.logprobs`` are log-softmax of logits / temperature over the whole vocabulary (what the
    trainer's own forward computes). vLLM's processed log-probs are taken after top-k/top-p masking, i.e.
    renormalised over the kept tokens, so they only agree when neither is active. Otherwise none are
    returned and the trainer recomputes them with a forward pass.
    """
    return not params.greedy and params.top_k == 0 and params.top_p >= 1.0


def sampling_kwargs(params: SamplingParams, seed: int, *, return_logprobs: bool) -> dict[str, Any]:
    """vLLM SamplingParams keyword arguments for one completion."""
    return {
        "n": 1,
        "max_tokens": params.max_new_tokens,
        # vLLM samples greedily at temperature 0
        "temperature": 0.0 if params.greedy else params.temperature,
        # -1 disables top-k in every vLLM version (0 only in recent ones)
        "top_k": params.top_k if params.top_k > 0 else -1,
        "top_p": params.top_p,
        "seed": int(seed),
        # Only the stop token ends a completion, as in TransformersGenerator: the model's EOS is sampled and
        # kept like any token. (min_tokens would instead mask EOS out of the distribution and bias sampling.)
        "ignore_eos": True,
        "stop_token_ids": [] if params.stop_token_id is None else [int(params.stop_token_id)],
        "detokenize": False,  # the trainer decodes what it needs itself
        "skip_special_tokens": False,
        # 0 = the sampled token's log-prob only
        "logprobs": 0 if return_logprobs else None,
    }


def build_requests(
    prompts: Sequence[list[int]],
    k: int,
    params: SamplingParams,
    seeds: torch.Tensor,
    *,
    return_logprobs: bool = False,
) -> list[Request]:
    """P prompts x K samples -> P*K requests, prompt-major, request ``p*K + j`` seeded with ``seeds[p*K + j]``.

    One request per completion rather than ``n=K`` per prompt: vLLM derives the seeds of a prompt's K
    samples from one request seed, so a completion's randomness would depend on its position within the
    request. vLLM's prefix cache still computes each prompt's KV once for its K requests.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1 (got {k})")
    if seeds.numel() != len(prompts) * k:
        raise ValueError(f"expected {len(prompts) * k} seeds (P={len(prompts)} x K={k}), got {seeds.numel()}")
    flat = seeds.reshape(-1).tolist()
    logprobs = return_logprobs and engine_logprobs_usable(params)
    return [
        Request(list(prompt), sampling_kwargs(params, flat[p * k + j], return_logprobs=logprobs))
        for p, prompt in enumerate(prompts)
        for j in range(k)
    ]


# ------------------------------------------------------------------------------------------------------
# outputs
@dataclass(frozen=True)
class Completion:
    token_ids: list[int]
    logprobs: list[float] | None = None  # the sampled tokens' log-probs, one per token


def extract_completion(request_output: Any, *, with_logprobs: bool) -> Completion:
    """A vLLM ``RequestOutput`` of one n=1 request -> its completion (tokens, optional log-probs)."""
    out = request_output.outputs[0]
    tokens = [int(t) for t in out.token_ids]
    if not with_logprobs or out.logprobs is None:
        return Completion(tokens)
    # each position maps token id -> Logprob; the sampled token is always among them
    logprobs = [float(step[tok].logprob) for step, tok in zip(out.logprobs, tokens, strict=True)]
    return Completion(tokens, logprobs)


def completions_to_generated(
    completions: Sequence[Completion],
    params: SamplingParams,
    *,
    with_logprobs: bool,
    device: torch.device | str | None = None,
) -> Generated:
    """Completions -> ``Generated``: tokens (B, max_new_tokens) right-padded with the pad id, log-probs 0 there.

    Tokens after the stop token are dropped, like TransformersGenerator's output (the engine stops there
    anyway; this guards against an engine that returns more).
    """
    width = params.max_new_tokens
    tokens = torch.full((len(completions), width), params.pad_token_id, dtype=torch.long)
    logprobs = torch.zeros((len(completions), width), dtype=torch.float32) if with_logprobs else None
    for i, c in enumerate(completions):
        ids = c.token_ids[:width]
        if params.stop_token_id is not None and params.stop_token_id in ids:
            ids = ids[: ids.index(params.stop_token_id) + 1]
        tokens[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        if logprobs is not None:
            if c.logprobs is None:
                raise ValueError("the engine returned no log-probs although they were asked for")
            logprobs[i, : len(ids)] = torch.tensor(c.logprobs[: len(ids)], dtype=torch.float32)
    return Generated(tokens=tokens.to(device), logprobs=None if logprobs is None else logprobs.to(device))


# ------------------------------------------------------------------------------------------------------
# weights
def vllm_weight_name(name: str) -> str:
    """A training parameter name -> the checkpoint name vLLM's ``load_weights`` expects."""
    # Whole segments only: "module" also ends "_checkpoint_wrapped_module", and a model may have a
    # submodule called "module" deeper down, so only a leading one (DDP's) is dropped.
    parts = [part for part in name.split(".") if part not in _WRAPPER_SEGMENTS]
    while len(parts) > 1 and parts[0] == "module":
        parts = parts[1:]
    return ".".join(parts)


def named_weights(model: Any, accelerator: Any = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, full tensor) for every parameter of the bare model, one module at a time.

    vLLM's ``reload_weights`` loads layer-wise: it keeps the tensors it is handed until a layer is
    complete, after this iterator has moved on. Without ZeRO-3 the parameters stay put, so they are handed
    over as they are. Under ZeRO-3 a gathered parameter is freed (re-partitioned) when its gather ends, so
    each module's own parameters are gathered together and handed over as clones: at most a few layers'
    worth of copies exist at once, never a full copy next to the engine. The gather is a collective, so
    every rank must run this iterator to the end.
    """
    bare = accelerator.unwrap_model(model) if accelerator is not None else model
    zero3 = accelerator is not None and deepspeed_utils.is_zero3(accelerator)
    for module_name, module in bare.named_modules():
        params = list(module.named_parameters(recurse=False))
        if not params:
            continue
        prefix = f"{module_name}." if module_name else ""
        if not zero3:
            for name, param in params:
                yield vllm_weight_name(prefix + name), param.data
            continue
        with deepspeed_utils.gathered([p for _, p in params], accelerator):
            copies = [(vllm_weight_name(prefix + name), param.data.clone()) for name, param in params]
        yield from copies


def policy_weights(model: Any, accelerator: Any = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, tensor) of the whole policy as an engine loads it: under LoRA the base model with the
    adapter merged in (the merge undone once the iterator is exhausted), else :func:`named_weights`. Every
    process must run it to the end (ZeRO-3 gathers)."""
    from rloo.training.lora import is_peft_model, merged_weights

    bare = accelerator.unwrap_model(model) if accelerator is not None else model
    if is_peft_model(bare):  # the engine holds the base model: hand it the adapter merged in
        with merged_weights(bare) as weights:
            yield from ((vllm_weight_name(n), t) for n, t in weights)
        return
    yield from named_weights(model, accelerator)


class WeightPushError(RuntimeError):
    """The engine did not take the policy's weights (it would sample from stale ones)."""


def push_weights(llm: Any, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Load ``weights`` (checkpoint names) into the engine through vLLM's public ``reload_weights``.

    ``reload_weights`` runs the model's own ``load_weights`` inside vLLM's layer-wise reload, which applies
    the post-processing of a fresh load (quantized and MLA models repack their weights there), unlike
    ``model.load_weights`` reached through the executor's private attributes. Under ``external_launcher``
    ``collective_rpc`` runs in this process, so the iterator is consumed here, lazily. Never ``reload_weights``
    without an iterator: that reloads the starting checkpoint from disk, undoing training.
    """
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights)})
    # KV blocks computed with the old weights must not be reused; False means some were still in use and
    # the cache was not cleared (a request in flight), and generation would mix old and new weights.
    if llm.reset_prefix_cache() is False:
        raise WeightPushError("vLLM did not reset its prefix cache after a weight push (requests in flight?)")


# ------------------------------------------------------------------------------------------------------
# engine creation
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def distributed_env(
    *, rank: int, local_rank: int, world_size: int, environ: dict[str, str] | None = None
) -> dict[str, str]:
    """The process-group variables vLLM's ``external_launcher`` executor reads, filled where missing.

    Under ``accelerate launch`` they are already set (and must be kept: they describe the training job);
    in a plain single-process run they are not, and a free local port is picked.
    """
    env = dict(os.environ if environ is None else environ)
    out = {"RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(world_size)}
    out["MASTER_ADDR"] = env.get("MASTER_ADDR") or "127.0.0.1"
    out["MASTER_PORT"] = env.get("MASTER_PORT") or str(_free_port())
    return out


def engine_kwargs(
    *,
    model_path: str,
    gpu_memory_utilization: float,
    enable_sleep_mode: bool,
    dtype: str,
    seed: int,
    max_model_len: int | None,
    max_num_seqs: int,
    trust_remote_code: bool = False,
) -> dict[str, Any]:
    """Keyword arguments of ``vllm.LLM`` for a colocated engine (each one a field of ``EngineArgs``).

    ``dtype`` is the training precision, never "auto": vLLM's "auto" runs fp32 checkpoints in bf16, and the
    engine's log-probs (used as the rollout's "old" log-probs and for the KL penalty) would come from
    another precision than the trainer's. ``max_num_seqs`` is this rank's rollout size (prompts x K): one
    generate call never has more sequences in flight, and vLLM's default (up to 1024 on large GPUs) makes it
    capture CUDA graphs and profile memory for batches that never come.
    """
    if dtype == "auto":
        raise ValueError("pass the training dtype: 'auto' lets vLLM downcast fp32 checkpoints")
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1 (got {max_num_seqs})")
    kwargs: dict[str, Any] = {
        "model": model_path,
        "tensor_parallel_size": 1,
        "gpu_memory_utilization": gpu_memory_utilization,
        "enable_sleep_mode": enable_sleep_mode,
        "dtype": dtype,
        "seed": seed,
        # In-process executor sharing the training job's process group: every rank runs its own engine and
        # the model is reachable from this process for weight updates.
        "distributed_executor_backend": "external_launcher",
        # Log-probs after temperature scaling, as the trainer computes them (see engine_logprobs_usable).
        "logprobs_mode": "processed_logprobs",
        "enable_prefix_caching": True,  # the K requests of a prompt share its KV cache
        # The engine's memory profiler sizes activations from this; its large default starves the KV cache.
        "max_num_batched_tokens": 4096,
        "max_num_seqs": max_num_seqs,
        "trust_remote_code": trust_remote_code,
    }
    if max_model_len is not None:
        kwargs["max_model_len"] = max_model_len
    return kwargs


def engine_env(*, batch_invariant: bool) -> dict[str, str]:
    """Environment variables vLLM reads when the engine starts (set before it is created)."""
    # VLLM_BATCH_INVARIANT: batch-invariant kernels, so a completion does not depend on its batch neighbours
    return {"VLLM_BATCH_INVARIANT": "1" if batch_invariant else "0"}


def create_colocated_llm(
    accelerator: Any,
    *,
    batch_invariant: bool = False,
    platform_kwargs: dict[str, Any] | None = None,
    **kwargs: Any,
) -> Any:
    """Start this rank's engine (``kwargs`` as for ``engine_kwargs``; ``platform_kwargs`` added to them)."""
    from vllm import LLM

    os.environ.update(
        distributed_env(
            rank=accelerator.process_index,
            local_rank=accelerator.local_process_index,
            world_size=accelerator.num_processes,
        )
    )
    os.environ.update(engine_env(batch_invariant=batch_invariant))
    # vLLM sizes its budget from the free memory it sees; blocks PyTorch's caching allocator holds but
    # does not use (model loading, reference model) are not free to it, and it refuses to start below the
    # budget. Its sleep-mode allocator cannot reuse PyTorch's cached blocks either.
    _empty_cache()
    # vLLM's CPU worker sets this process's thread count for its own kernels; the trainer shares the process
    threads = torch.get_num_threads()
    llm = LLM(**engine_kwargs(**kwargs), **(platform_kwargs or {}))
    torch.set_num_threads(threads)
    # Engine start-up is uneven across ranks; training collectives right after it would time out.
    accelerator.wait_for_everyone()
    return llm


# ------------------------------------------------------------------------------------------------------
# the engine-touching shell
class VLLMGenerator:
    """``Generator`` backed by a colocated vLLM engine (``llm``) that mirrors the training ``model``.

    ``model`` is the prepared policy (DDP / DeepSpeed engine / bare module); its weights are pushed into
    the engine at the start of every ``generate`` call: with sleep level 2 the engine has dropped them,
    and otherwise it is the simplest way to never sample from stale weights (a device-to-device copy of
    the model, small next to a rollout).
    """

    # part of the Generator protocol; vLLM generates a rollout in one call, so there is no step to stop at
    should_stop: Callable[[], bool] | None = None
    # The policy's weights as of the trainer's optimizer steps (it sets this before generating): the engine
    # is pushed only when they changed since its last push (--max_num_gen_batches samples several times
    # between two steps). None: unknown, push every time.
    weights_version: int | None = None

    def __init__(
        self,
        llm: Any,
        model: Any,
        *,
        accelerator: Any = None,
        enable_sleep_mode: bool = False,
        sampling_params_cls: Any = None,
    ) -> None:
        self.llm = llm
        self.model = model
        self.accelerator = accelerator
        self.enable_sleep_mode = enable_sleep_mode
        if sampling_params_cls is None:
            from vllm import SamplingParams

            sampling_params_cls = SamplingParams
        self._sampling_params_cls = sampling_params_cls
        self._pushed_version: int | None = None
        if enable_sleep_mode:
            self.sleep()  # free the memory until the first rollout

    # -- weights and memory -------------------------------------------------------------------------------
    def _wake_up(self, tag: str) -> None:
        # vLLM's sleep-mode allocator maps its own memory: blocks cached by PyTorch after the optimisation
        # phase are invisible to it, and waking up next to them can run out of memory.
        _empty_cache()
        self.llm.wake_up(tags=[tag])

    def push_weights(self) -> None:
        """Copy the policy's current weights into the engine and drop KV blocks computed with the old ones."""
        if self.enable_sleep_mode:
            self._wake_up("weights")
        push_weights(self.llm, policy_weights(self.model, self.accelerator))

    def sleep(self) -> None:
        # level 2 discards the weights too (level 1 would keep a CPU copy): they are pushed again anyway.
        # What level 2 discards is rebuilt by reload_weights (a full load with post-processing), not by
        # load_weights alone (upstream: "sleep level 2 causes gibberish outputs" with the new model runner).
        self.llm.sleep(level=2)

    def sync_weights(self) -> None:
        """The policy's weights pushed when ``weights_version`` moved since the last push (always in sleep
        mode, which discards them after each generation)."""
        if (
            self.enable_sleep_mode
            or self.weights_version is None
            or self.weights_version != self._pushed_version
        ):
            self.push_weights()
            self._pushed_version = self.weights_version

    # -- generation ---------------------------------------------------------------------------------------
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
        requests = build_requests(
            strip_left_padding(prompt_ids, prompt_mask), k, params, seeds, return_logprobs=return_logprobs
        )
        with_logprobs = return_logprobs and engine_logprobs_usable(params)
        self.sync_weights()
        if self.enable_sleep_mode:
            self._wake_up("kv_cache")
        try:
            outputs = self.llm.generate(
                [{"prompt_token_ids": r.prompt_token_ids} for r in requests],
                sampling_params=[self._sampling_params_cls(**r.sampling) for r in requests],
                use_tqdm=False,
            )
        finally:
            if self.enable_sleep_mode:
                self.sleep()
        completions = [extract_completion(o, with_logprobs=with_logprobs) for o in outputs]
        return completions_to_generated(
            completions, params, with_logprobs=with_logprobs, device=prompt_ids.device
        )


# ------------------------------------------------------------------------------------------------------
# choosing a backend
def _empty_cache() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def engine_dtype(settings: GenerationSettings) -> str:
    """The engine's dtype: the precision the trainer's forwards run in (fp32 without bf16/fp16)."""
    if settings.bf16:
        return "bfloat16"
    if settings.fp16:
        return "float16"
    return "float32"


def make_vllm_generator(
    settings: GenerationSettings,
    model: Any,
    *,
    accelerator: Any,
    max_num_seqs: int,
    max_model_len: int | None = None,
) -> VLLMGenerator:
    """This rank's colocated engine, started from ``settings.model_path``, behind a ``VLLMGenerator``.

    ``model`` is the prepared policy, whose weights are pushed into the engine before each rollout.
    ``max_num_seqs`` is the most completions one ``generate`` call asks for; ``max_model_len`` (longest
    prompt + response_length) bounds the KV cache per sequence (without it vLLM reserves the model's full
    context length; a CPU engine needs it). Raises UserError when vLLM cannot run here.
    """
    platform = require_vllm()
    dtype = engine_dtype(settings)
    fraction = settings.vllm_gpu_memory_utilization
    platform_kwargs: dict[str, Any] = {}
    engine_sleeps = settings.vllm_enable_sleep_mode
    if platform == CPU:
        if max_model_len is None:  # the trainer always knows it (longest prompt + response_length)
            raise ValueError("a CPU engine is sized from max_model_len: pass it")
        # vLLM's CPU build has no sleep mode (it refuses the flag, and its worker ignores sleep/wake_up
        # calls), and reads the memory fraction as one of the total RAM: size the KV cache from the need.
        if engine_sleeps:
            log.info("--vllm_enable_sleep_mode: vLLM on CPU has no sleep mode; the engine keeps its memory")
        engine_sleeps = False
        platform_kwargs = cpu_engine_kwargs(
            model_path=settings.model_path,
            dtype=dtype,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            fraction=fraction,
            flag="--vllm_gpu_memory_utilization",
            trust_remote_code=settings.trust_remote_code,
        )
    llm = create_colocated_llm(
        accelerator,
        model_path=settings.model_path,
        gpu_memory_utilization=fraction,
        enable_sleep_mode=engine_sleeps,
        dtype=dtype,
        seed=settings.seed,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        trust_remote_code=settings.trust_remote_code,
        batch_invariant=settings.vllm_batch_invariant,
        platform_kwargs=platform_kwargs,
    )
    # the generator keeps its sleep/wake sequence on CPU too: vLLM's CPU worker accepts and ignores it
    return VLLMGenerator(
        llm, model, accelerator=accelerator, enable_sleep_mode=settings.vllm_enable_sleep_mode
    )


def make_generator(
    settings: GenerationSettings,
    model: Any,
    *,
    accelerator: Any,
    batch_size: int,
    autocast: Any = None,
    max_model_len: int | None = None,
    max_num_seqs: int | None = None,
) -> Generator:
    """The generation backend ``settings`` ask for: vLLM when ``settings.use_vllm``, else transformers.

    ``model`` is the prepared policy; ``batch_size`` the completions per sampling batch of the built-in
    generator. ``max_model_len`` and ``max_num_seqs`` (default: ``batch_size``) size the vLLM engine, see
    :func:`make_vllm_generator`. Raises UserError when ``use_vllm`` is set but vLLM cannot run here.
    """
    if settings.use_vllm:
        return make_vllm_generator(
            settings,
            model,
            accelerator=accelerator,
            max_num_seqs=max_num_seqs or batch_size,
            max_model_len=max_model_len,
        )
    # decoding from ZeRO-3 shards makes every forward a collective: the ranks must decode in lockstep
    synced = deepspeed_utils.generation_needs_synced_steps(
        accelerator, gather=settings.ds3_gather_for_generation
    )
    policy = accelerator.unwrap_model(model)
    copy_dtype = precision.rollout_copy_dtype(settings.generation_dtype, accelerator, policy)
    if settings.async_generation and copy_dtype is None:
        # generating beside the optimization: from a copy that the optimizer steps do not change under it
        if deepspeed_utils.is_deepspeed(accelerator):
            raise UserError(
                "--async_generation with the built-in generator samples from a copy of the policy, which "
                "DeepSpeed holds itself: generate with --use_vllm --vllm_mode server, or drop --async_generation."
            )
        copy_dtype = next(p.dtype for p in policy.parameters() if p.is_floating_point())
    return TransformersGenerator.from_settings(
        policy, settings, batch_size=batch_size, autocast=autocast, synced_steps=synced, copy_dtype=copy_dtype
    )
