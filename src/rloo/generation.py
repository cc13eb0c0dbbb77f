"""Rollout generation behind one small interface.

``TransformersGenerator`` is the built-in backend: one prefill per *prompt*, whose KV cache then serves
its K samples (held once and read once per step by shared-prefix attention, ``rloo.prefix_attention``,
where the model family allows; else repeated K times), followed by a lean sampling loop with no logits
processors or stopping-criteria machinery.

Sampling randomness is counter-based: completion ``k`` of the prompt with global index ``g`` at update
``u`` draws its uniforms from ``hash(seed, u, g, k, t)`` (and, for the exponential race over the
vocabulary, one per token id from ``hash(seed, u, g, k, t, v)``). The samples therefore do not depend on
how prompts are batched or spread over processes, only on the run seed and on what is being sampled.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from rloo import prefix_attention, rollout_fusion

log = logging.getLogger(__name__)

_MASK32 = 0xFFFFFFFF
# The reference divides logits by T + 1e-7 when scoring; log-probs everywhere use the same divisor.
TEMPERATURE_EPS = 1e-7


def scoring_temperature(temperature: float) -> float:
    """The divisor of the logits when scoring samples: ``temperature + 1e-7``, the reference's. At
    temperature 1 that divisor rounds to 1 + 1.2e-7 in float32, a change of at most one unit in the last
    place, so it is 1 exactly and the division (a full pass over a (b, T, V) tensor and another in its
    backward) is skipped."""
    return 1.0 if temperature == 1.0 else temperature + TEMPERATURE_EPS


def scale_logits(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``logits / scoring_temperature(temperature)``."""
    if temperature == 1.0:
        return logits
    return logits / scoring_temperature(temperature)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    # "lowbias32" integer hash (Wellons). int64 arithmetic wraps, and only the low 32 bits are kept.
    x = x & _MASK32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def row_seeds(seed: int, update: int, prompt_index: torch.Tensor, k: int) -> torch.Tensor:
    """(P,) global prompt indices -> (P*K,) 32-bit seeds, prompt-major (row p*K + j is sample j of p)."""
    base = _mix32(
        torch.tensor(seed, dtype=torch.int64) ^ _mix32(torch.tensor(update * 0x9E3779B1, dtype=torch.int64))
    )
    g = _mix32(base ^ _mix32(prompt_index.to(torch.int64) * 0x85EBCA6B))  # (P,)
    j = torch.arange(k, dtype=torch.int64, device=prompt_index.device)
    return _mix32(g[:, None] ^ _mix32(j[None, :] + 0x27D4EB2F)).reshape(-1)  # (P*K,)


def uniforms(seeds: torch.Tensor, step: int) -> torch.Tensor:
    """(B,) seeds -> (B,) float64 uniforms in [0, 1) for sampling step ``step``."""
    h = _mix32(seeds ^ _mix32(torch.full_like(seeds, step) + 0x165667B1))
    return (h.to(torch.float64) + 0.5) / 4294967296.0


def sample_tokens(
    logits: torch.Tensor, u: torch.Tensor, *, temperature: float, top_k: int = 0, top_p: float = 1.0
) -> torch.Tensor:
    """One token per row from softmax(logits / temperature), truncated to ``top_k`` / ``top_p``: logits
    (B, V), u (B,) the rows' uniforms of this step (``uniforms``) -> (B,) ids. Untruncated (the default)
    on a GPU it is an exponential race over the vocabulary, one pass; else inverse-CDF sampling."""
    scaled = logits.float() if temperature == 1.0 else logits.float() / temperature  # (B, V)
    # The race pays where it runs compiled (a GPU): one fused pass. Eagerly its hash is a dozen (B, V)
    # kernels, 9x the inverse CDF's time on a CPU at 50k tokens, so CPUs keep the inverse CDF. Either
    # draws from the same distribution, reproducibly and per row; a seed's tokens differ between the two.
    if scaled.is_cuda and (not top_k or top_k >= scaled.size(-1)) and top_p >= 1.0:
        return exponential_race(scaled, u)
    return inverse_cdf_tokens(scaled, u, top_k=top_k, top_p=top_p)


def race_uniforms(u: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(B,) a step's uniforms from ``uniforms`` -> (B, V) float32 uniforms in (0, 1), one per vocabulary
    entry, from the same hash keyed by (row seed, step, token id): a row's draws depend on nothing else.
    A ``uniforms`` value is its 32-bit hash scaled, ``(h + 0.5) / 2**32``, exact in float64, so the hash
    comes back as ``floor(u * 2**32)``."""
    row = (u.to(torch.float64) * 4294967296.0).to(torch.int64)  # (B,) the row's step hash
    token = _mix32(torch.arange(vocab_size, dtype=torch.int64, device=u.device) + 0x3C6EF372)  # (V,)
    h = _mix32(row[:, None] ^ token[None, :])  # (B, V)
    # 24 bits: exact in float32 and never 0 or 1 (whose -log would be inf or 0, whose log -inf)
    return ((h >> 8).to(torch.float32) + 0.5) / 16777216.0


def exponential_race(scaled: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Gumbel-max sampling: scaled logits (B, V), u (B,) -> (B,) ids. Token v draws E_v = -log(u_v) ~
    Exp(1) and argmax(scaled - log E) is distributed as softmax(scaled) (the first of the exponential
    clocks E_v / p_v to ring), with no softmax, cumulative sum or search over the vocabulary.

    One pass only once compiled: eagerly the hash is a dozen (B, V) int64 kernels, more traffic than the
    inverse CDF's. A compiled decode step inlines it; an eager one on a GPU calls it compiled on its own."""
    if scaled.is_cuda and not torch.compiler.is_compiling() and not _RACE_EAGER:
        try:
            return _compiled_race()(scaled, u)
        except Exception as e:  # no working compiler here (e.g. no Triton): the same draws, eagerly
            _RACE_EAGER.append(True)
            log.warning(
                "sampling runs uncompiled (%s: %s): same tokens, more memory traffic", type(e).__name__, e
            )
    return _race(scaled, u)


# set once compiling the race failed on this machine: later steps run it eagerly without trying again
_RACE_EAGER: list[bool] = []


def _race(scaled: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    race = -torch.log(-torch.log(race_uniforms(u, scaled.size(-1))))  # (B, V) Gumbel noise
    return (scaled + race).argmax(-1)  # (B,)


@functools.cache
def _compiled_race() -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    # dynamic: the last chunk of a rollout (fewer rows) and other vocabularies reuse the kernel
    return torch.compile(_race, dynamic=True, fullgraph=True)


def inverse_cdf_tokens(scaled: torch.Tensor, u: torch.Tensor, *, top_k: int, top_p: float) -> torch.Tensor:
    """Inverse-CDF sampling of one token per row from softmax(scaled) truncated to the ``top_k`` most
    likely tokens and the smallest prefix of mass ``top_p``: scaled logits (B, V), u (B,) -> (B,) ids."""
    probs = torch.softmax(scaled, dim=-1)  # (B, V)
    if top_k and top_k < probs.size(-1):
        kth = torch.topk(probs, top_k, dim=-1).values[:, -1:]  # (B, 1)
        probs = torch.where(probs < kth, torch.zeros_like(probs), probs)
    if top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (always at least the top token)
        drop = (sorted_p.cumsum(-1) - sorted_p) >= top_p * sorted_p.sum(-1, keepdim=True)
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    cdf = probs.cumsum(-1)  # (B, V)
    target = (u.to(cdf.device, torch.float64) * cdf[:, -1].double()).to(cdf.dtype).unsqueeze(-1)  # (B, 1)
    idx = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    # guard the float edge where target == total mass, and never pick a zero-probability token
    idx = idx.clamp(max=probs.size(-1) - 1)
    # Unconditional where, not `if bad.any()`: that test would wait on the device at every token.
    bad = probs.gather(-1, idx[:, None]).squeeze(-1) <= 0
    return torch.where(bad, probs.argmax(-1), idx)


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 0.7
    top_k: int = 0
    top_p: float = 1.0
    stop_token_id: int | None = None  # stop early once every row has produced it (tokens after are pad)
    pad_token_id: int = 0
    greedy: bool = False


@dataclass(frozen=True)
class GenerationSettings:
    """How a training run generates its rollouts: the training config's generation fields
    (``RLOOConfig.generation_settings()``), given to the generator factories whole and typed so that each
    default is declared once, on the config field. No field has a default here, for the same reason.

    The factories: :meth:`TransformersGenerator.from_settings` and the vLLM engine's
    ``rloo.training.vllm_backend.make_vllm_generator``, chosen by ``make_generator`` there.
    """

    use_vllm: bool  # a colocated vLLM engine; else the built-in TransformersGenerator
    # -- the built-in generator
    cache_implementation: str  # "dynamic" or "static" (see TransformersGenerator)
    compile_generation: bool  # torch.compile the static decode step
    generation_dtype: (
        str  # "auto", "policy", "bfloat16" or "float16": the weights sampled from (rollout_copy)
    )
    ds3_gather_for_generation: bool  # ZeRO-3: gather the policy per rollout; else decode from the shards
    # -- the vLLM engine
    model_path: str  # the checkpoint the engine starts from (the policy's starting point)
    bf16: bool  # the training precision, which the engine runs in too
    fp16: bool
    seed: int
    trust_remote_code: bool
    vllm_gpu_memory_utilization: float
    vllm_enable_sleep_mode: bool
    vllm_batch_invariant: bool
    # -- a vLLM server (--vllm_mode server): its root URL, None for a colocated engine
    vllm_server_url: str | None
    vllm_server_timeout: float
    # the generator runs beside the optimization (--async_generation): the built-in one samples from a copy
    async_generation: bool


class GenerationInterrupted(Exception):
    """Generation stopped early because ``should_stop`` said so (a pending preemption)."""


@dataclass
class Generated:
    """What a backend returns: prompt-major completions, right-padded with pad ids."""

    tokens: torch.Tensor  # (P*K, T)
    # (P*K, T) float32 log-probs of the sampled tokens at the sampling temperature, if asked for.
    # Only good enough for reward shaping (the KL penalty): the PPO ratio needs a training forward.
    logprobs: torch.Tensor | None = None
    # multi-turn episodes: an rloo.agents.episodes.Episodes (which tokens are the model's, the messages, tool
    # statistics); Any here, as rloo.agents builds on this module
    episodes: Any = None


class Generator(Protocol):
    """A generation backend (the transformers one below; vLLM later plugs in here)."""

    # polled between sampling steps where the backend can stop early (a pending preemption); None: never
    should_stop: Callable[[], bool] | None
    # the trainer's count of optimizer steps so far: a backend holding its own copy of the weights (vLLM)
    # refreshes it only when this changed; None: unknown, refresh every time
    weights_version: int | None

    def sync_weights(self) -> None:
        """Bring the backend's own copy of the weights (vLLM's, a rollout copy) to ``weights_version`` when it
        moved; ``generate`` calls it first. Asynchronous generation calls it on the training thread before
        generating on another, so the weights are read before the optimization changes them."""
        ...

    def generate(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        k: int,
        params: SamplingParams,
        seeds: torch.Tensor,
        *,
        return_logprobs: bool = False,
    ) -> Generated: ...


def left_pad(
    seqs: list[list[int]], pad_id: int, device: torch.device | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token lists -> ids (N, L) and attention mask (N, L)."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        if s:
            ids[i, width - len(s) :] = torch.tensor(s, dtype=torch.long)
            mask[i, width - len(s) :] = 1
    return ids.to(device), mask.to(device)


class TransformersGenerator:
    """KV-cached sampling with any transformers causal LM, prefilling each prompt once for its K samples."""

    def __init__(
        self,
        model: Any,
        *,
        batch_size: int,
        autocast: Any = None,
        synced_steps: bool = False,
        cache_implementation: str = "dynamic",
        compile_decode: bool = False,
        whole_step: bool = True,
        source: Any = None,
    ) -> None:
        self.model = model
        # the live policy when ``model`` is a rollout copy of it (``rollout_copy``): the copy is refreshed
        # from it before a generation whenever ``weights_version`` moved; None: ``model`` is the policy
        self.source = source
        self._synced_version: int | None = None
        self.batch_size = batch_size  # completions per sampling batch
        # a copy holds its weights in the compute dtype already: autocast would only add casts
        self.autocast = None if source is not None else autocast
        # "static": decode into a KV cache preallocated to prompt + response length, with shapes that do
        # not change from step to step (what CUDA graphs need); "dynamic": the cache grows by a token a step
        self.cache_implementation = cache_implementation
        # compile the static decode step (torch.compile "reduce-overhead": CUDA graphs on a GPU)
        self.compile_decode = compile_decode
        # the static decode step holds sampling, the token's write and the mask's update too (one graph per
        # step, driven by a step counter on the device); False: only the model's forward (the A/B baseline)
        self.whole_step = whole_step
        self._compiled: dict[bool, Any] = {}
        # a compiled generator's static decode buffers by shape, kept across calls: the same addresses
        # every call, so its recorded step is not recorded again for each chunk or update
        self._buffers: dict[tuple[Any, ...], _StaticBuffers] = {}
        # every decode step runs even when all rows have stopped: with ZeRO-3 shards each forward is a
        # collective, and a rank that stopped early would leave the others waiting
        self.synced_steps = synced_steps
        # polled between decode steps: a pending SIGTERM stops a long generation within one step
        self.should_stop: Callable[[], bool] | None = None
        # the trainer's optimizer-step count: a rollout copy is refreshed when it moved (None: every call)
        self.weights_version: int | None = None

    @classmethod
    def from_settings(
        cls,
        model: Any,
        settings: GenerationSettings,
        *,
        batch_size: int,
        autocast: Any = None,
        synced_steps: bool = False,
        copy_dtype: torch.dtype | None = None,
    ) -> TransformersGenerator:
        """The rollout generator of a training run: ``model`` is the bare policy (unwrapped), ``synced_steps``
        whether ranks must decode in lockstep (ZeRO-3 from shards; the trainer knows, see
        ``rloo.training.deepspeed_utils.generation_needs_synced_steps``), ``copy_dtype`` the dtype of a
        rollout copy to sample from (``settings.generation_dtype`` resolved by the caller), None: the policy."""
        return cls(
            rollout_copy(model, copy_dtype) if copy_dtype is not None else model,
            batch_size=batch_size,
            autocast=autocast,
            synced_steps=synced_steps,
            cache_implementation=settings.cache_implementation,
            compile_decode=settings.compile_generation,
            source=model if copy_dtype is not None else None,
        )

    def describe(self) -> str:
        """What this generator samples with, in one phrase for the run's log."""
        if self.source is not None:
            dtype = str(next(self.model.parameters()).dtype).removeprefix("torch.")
            fused = any(rollout_fusion.is_fused(m) for m in self.model.modules())
            projections = ", q/k/v and gate/up fused" if fused else ""
            weights = f"a {dtype} copy of the policy (refreshed from it before each rollout{projections})"
        else:
            weights = "the policy's weights" + (" under autocast" if self.autocast is not None else "")
        if prefix_attention.supports(self.model, 2):
            prompt = "each prompt's keys and values held once and read once per step for its K samples"
        else:
            prompt = "each prompt's keys and values repeated for its K samples"
        cache = f"a dynamic KV cache ({prompt})"
        if self.cache_implementation == "static":
            step = "one compiled graph per step" if self.compile_decode else "an uncompiled step"
            cache = f"a static KV cache ({prompt}), {step}"
        return f"built-in generator from {weights}, {cache}"

    def sync_weights(self) -> None:
        """A rollout copy refreshed from the policy when ``weights_version`` moved (the policy itself: no-op)."""
        if self.source is not None and (
            self.weights_version is None or self.weights_version != self._synced_version
        ):
            sync_rollout_copy(self.model, self.source)
            self._synced_version = self.weights_version

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
        prompts_per_chunk = max(1, self.batch_size // k)
        # inference_mode dispatches cheaper than no_grad (outputs are cloned out of it below), but decoding
        # from ZeRO-3 shards (synced steps) gathers parameters in here: a small (persistent) one gathered
        # first here would stay an inference tensor, which the training forward cannot save for backward.
        # The static path runs under no_grad too: its buffers outlive the call and are written in place.
        static = self.cache_implementation == "static"
        no_grad = torch.no_grad if self.synced_steps or static else torch.inference_mode
        with no_grad():
            chunks = [
                self._generate_chunk(
                    prompt_ids[i : i + prompts_per_chunk],
                    prompt_mask[i : i + prompts_per_chunk],
                    k,
                    params,
                    seeds[i * k : (i + prompts_per_chunk) * k],
                    return_logprobs,
                )
                for i in range(0, prompt_ids.size(0), prompts_per_chunk)
            ]
        width = max(c.tokens.size(1) for c in chunks)

        def cat(parts: list[torch.Tensor], value: float) -> torch.Tensor:
            return torch.cat([torch.nn.functional.pad(x, (0, width - x.size(1)), value=value) for x in parts])

        tokens = cat([c.tokens for c in chunks], params.pad_token_id)
        logprobs = cat([c.logprobs for c in chunks], 0.0) if return_logprobs else None  # type: ignore[misc]
        return Generated(tokens=_normal(tokens), logprobs=None if logprobs is None else _normal(logprobs))

    def _generate_chunk(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        k: int,
        params: SamplingParams,
        seeds: torch.Tensor,
        return_logprobs: bool,
    ) -> Generated:
        from rloo.forward import prefill

        model = self.model
        ctx = self.autocast or contextlib.nullcontext  # a factory: autocast contexts are not re-entrant
        device = prompt_ids.device
        steps = params.max_new_tokens
        # (B, T) all of this chunk's uniforms in one vectorised hash rather than one call per step
        u = torch.stack([uniforms(seeds.to(device), t) for t in range(steps)], dim=1)
        out, position_ids = prefill(model, prompt_ids, prompt_mask, ctx)  # (P, L) positions
        cache = out.past_key_values
        logits = out.logits[:, -1].repeat_interleave(k, dim=0)  # (B, V)
        pos = position_ids[:, -1:].repeat_interleave(k, dim=0)  # (B, 1)
        mask = prompt_mask.repeat_interleave(k, dim=0)  # (B, L)
        if prefix_attention.supports(model, k):
            # one prefill serves all K samples of a prompt, and its KV is read once per step for all K
            with prefix_attention.attending_shared_prefix(model):
                if self.cache_implementation == "static":
                    return self._decode_static(cache, logits, pos, mask, u, params, return_logprobs, group=k)
                shared = prefix_attention.SharedPrefixCache(cache, prompt_mask, k, steps)
                return self._decode_dynamic(shared, logits, pos, mask, u, params, return_logprobs)
        cache.batch_repeat_interleave(k)  # one prefill serves all K samples of a prompt: K copies of its KV
        if self.cache_implementation == "static":
            return self._decode_static(cache, logits, pos, mask, u, params, return_logprobs)
        return self._decode_dynamic(cache, logits, pos, mask, u, params, return_logprobs)

    def _emit(
        self,
        logits: torch.Tensor,
        u_t: torch.Tensor,
        params: SamplingParams,
        t: int,
        tokens: torch.Tensor,
        logprobs: torch.Tensor | None,
        done: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Choose every row's token at step ``t`` (B,), write it (and its log-prob if asked) and return it
        with the updated ``done``: rows past their stop token emit padding."""
        nxt, logprob, done = choose_tokens(logits, u_t, params, done, with_logprob=logprobs is not None)
        if logprobs is not None and logprob is not None:
            logprobs[:, t] = logprob
        tokens[:, t] = nxt
        return nxt, done

    def _decode_dynamic(
        self,
        cache: Any,
        logits: torch.Tensor,
        pos: torch.Tensor,
        mask: torch.Tensor,
        u: torch.Tensor,
        params: SamplingParams,
        return_logprobs: bool,
    ) -> Generated:
        model = self.model
        ctx = self.autocast or contextlib.nullcontext
        device = logits.device
        steps = params.max_new_tokens
        n = mask.size(0)
        step_kwargs = self._dynamic_step_kwargs(cache, mask, steps)
        tokens = torch.full((n, steps), params.pad_token_id, dtype=torch.long, device=device)
        logprobs = torch.zeros((n, steps), dtype=torch.float32, device=device) if return_logprobs else None
        done = torch.zeros(n, dtype=torch.bool, device=device)
        for t in range(steps):
            nxt, done = self._emit(logits, u[:, t], params, t, tokens, logprobs, done)
            all_done = params.stop_token_id is not None and not self.synced_steps and bool(done.all())
            if t + 1 == steps or all_done:
                break
            if self.should_stop is not None and self.should_stop():
                raise GenerationInterrupted
            pos = pos + 1
            with ctx():
                out = model(input_ids=nxt[:, None], position_ids=pos, **step_kwargs(t))
            logits = out.logits[:, -1]
        return Generated(tokens=tokens, logprobs=logprobs)

    def _dynamic_step_kwargs(
        self, cache: Any, mask: torch.Tensor, steps: int
    ) -> Callable[[int], dict[str, Any]]:
        """Decode step t's attention and cache arguments, for a prompt mask (B, L) and ``steps`` tokens."""
        n, width = mask.shape
        if isinstance(cache, prefix_attention.SharedPrefixCache):
            # the same at every step: the cache grows itself, and its attention masks by its own masks
            shared = prefix_attention.step_kwargs(cache, n, mask.device)
            return lambda t: shared
        # (B, L+T) preallocated: each step attends to a growing prefix view, no per-step concatenation
        attn = torch.ones((n, width + steps), dtype=mask.dtype, device=mask.device)
        attn[:, :width] = mask
        # With SDPA attention, hand the model a ready (B, 1, 1, L+T) bool mask: transformers passes 4D
        # masks through untouched, which saves rebuilding one from the 2D mask at every decode step.
        if getattr(self.model.config, "_attn_implementation", None) == "sdpa":
            step_mask = attn.bool()[:, None, None, :]  # (B, 1, 1, L+T)
        else:
            step_mask = attn
        return lambda t: {
            "attention_mask": step_mask[..., : width + t + 1],
            "past_key_values": cache,
            "use_cache": True,
        }

    def _decode_static(
        self,
        dynamic: Any,
        logits: torch.Tensor,
        pos: torch.Tensor,
        mask: torch.Tensor,
        u: torch.Tensor,
        params: SamplingParams,
        return_logprobs: bool,
        group: int = 1,
    ) -> Generated:
        """The decode loop over a preallocated cache: every step feeds the model tensors of one shape at
        one address, kept across calls (the whole (B, S) mask with the future masked, positions and ids
        updated in place; S is prompt + response length rounded up to ``CACHE_BUCKET``), so a compiled
        step is recorded once and replayed as a CUDA graph. With ``whole_step`` the step also samples,
        writes the token and opens the mask, indexed by a step counter on the device; the host reads the
        device only every ``STOP_CHECK_EVERY`` steps, to stop once every row has finished.

        ``group`` > 1: ``dynamic`` holds each prompt once (not repeated), and the steps attend with shared-
        prefix attention (``rloo.prefix_attention``) over its prompt part held once per group of ``group``
        rows; the caller has switched the model's attention to it."""
        ctx = self.autocast or contextlib.nullcontext
        steps = params.max_new_tokens
        n, width = mask.shape
        buf = self._static_buffers(dynamic, n, width, steps, return_logprobs, logits.device, group)
        buf.load(dynamic, mask, pos, u, params.pad_token_id)
        # token 0 comes from the prefill's logits, outside the graph; every later step runs the model on the
        # previous token, then chooses this one
        nxt, logprob, done = choose_tokens(logits, u[:, 0], params, buf.done, with_logprob=return_logprobs)
        buf.first(nxt, logprob, done, width)
        step = self._step_fn()
        for t in range(1, steps):
            check = params.stop_token_id is not None and not self.synced_steps and t % STOP_CHECK_EVERY == 0
            if check and bool(buf.done.all()):
                break
            if self.should_stop is not None and self.should_stop():
                raise GenerationInterrupted
            with ctx():
                if self.whole_step:
                    step(buf, params)
                else:
                    buf.open_input(t, width)
                    logits = step(buf.ids, buf.attn, buf.pos, buf.cache)
                    nxt, logprob, done = choose_tokens(
                        logits, u[:, t], params, buf.done, with_logprob=return_logprobs
                    )
                    buf.write(t, nxt, logprob, done)
        tokens = buf.tokens.clone()
        return Generated(tokens=tokens, logprobs=buf.logprobs.clone() if buf.logprobs is not None else None)

    def _static_buffers(
        self,
        dynamic: Any,
        n: int,
        width: int,
        steps: int,
        with_logprobs: bool,
        device: torch.device,
        group: int = 1,
    ) -> _StaticBuffers:
        # the cache holds keys and values in the dtype attention computes in: autocast's, else the model's
        with (self.autocast or contextlib.nullcontext)():
            autocast = torch.is_autocast_enabled(device.type)
            dtype = torch.get_autocast_dtype(device.type) if autocast else dynamic.layers[0].keys.dtype
        # the slots of the prompt and response (of the prompt only, when it is held apart from the response),
        # rounded up: prompts of other widths reuse the buffers
        length = width if group > 1 else width + steps
        size = -(-length // CACHE_BUCKET) * CACHE_BUCKET
        key = (n, size, steps, with_logprobs, dtype, device, group)
        buf = self._buffers.pop(key, None)  # re-inserted last: the least recently used goes first
        if buf is None:
            while len(self._buffers) >= MAX_STATIC_BUFFERS:
                self._buffers.pop(next(iter(self._buffers)))
            buf = _StaticBuffers(self.model, dynamic, n, size, steps, with_logprobs, dtype, group)
        # kept across calls only for a compiled step, whose recorded graph needs the same addresses; else
        # the cache is freed with the call, as the dynamic one is, not held through the optimisation
        if self.compile_decode:
            self._buffers[key] = buf
        return buf

    def _step_fn(self) -> Callable[..., Any]:
        model = self.model
        whole = self.whole_step

        def forward(ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, cache: Any) -> torch.Tensor:
            # a shared-prefix cache also goes to the attention function, which reads its prompt part
            shared = isinstance(cache, prefix_attention.StaticSharedPrefixCache)
            extra = {"shared_prefix": cache} if shared else {}
            out = model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=pos,
                past_key_values=cache,
                use_cache=True,
                **extra,
            )
            return out.logits[:, -1]  # (B, V)

        def whole_step(buf: _StaticBuffers, params: SamplingParams) -> None:
            buf.open_input_at_counter()
            logits = forward(buf.ids, buf.attn, buf.pos, buf.cache)  # (B, V)
            u_t = buf.u.index_select(1, buf.t).squeeze(1)  # (B,)
            nxt, logprob, done = choose_tokens(
                logits, u_t, params, buf.done, with_logprob=buf.logprobs is not None
            )
            buf.write_at_counter(nxt, logprob, done)

        fn = whole_step if whole else forward
        if not self.compile_decode:
            return fn
        if whole not in self._compiled:
            # "reduce-overhead" records the step as a CUDA graph: one launch per token instead of one per
            # kernel, which is what decode at small batch is bound by
            self._compiled[whole] = torch.compile(fn, mode="reduce-overhead", dynamic=False)
        return self._compiled[whole]


def choose_tokens(
    logits: torch.Tensor, u_t: torch.Tensor, params: SamplingParams, done: torch.Tensor, *, with_logprob: bool
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """One decode step's choice for every row: logits (B, V), uniforms (B,) -> the tokens (B,), their
    log-probs at the sampling temperature (B,) if asked, and ``done`` updated: rows past their stop token
    emit padding. No host sync: it runs inside a CUDA graph too."""
    if params.greedy:
        nxt = logits.argmax(-1)
    else:
        nxt = sample_tokens(
            logits, u_t, temperature=params.temperature, top_k=params.top_k, top_p=params.top_p
        )
    logprob = None
    if with_logprob:
        scaled = scale_logits(logits.float(), params.temperature)  # (B, V)
        logprob = scaled.gather(-1, nxt[:, None]).squeeze(-1) - scaled.logsumexp(-1)  # (B,)
    if params.stop_token_id is not None:
        nxt = torch.where(done, torch.full_like(nxt, params.pad_token_id), nxt)
        done = done | (nxt == params.stop_token_id)
    return nxt, logprob, done


# The static loop reads ``done`` from the device this often (a host sync), to stop early.
STOP_CHECK_EVERY = 16
# Static caches are sized to prompt + response length rounded up to a multiple of this, so that prompts of
# other widths (each rollout's longest differs) decode in the same buffers and the same recorded graph.
CACHE_BUCKET = 64
# Shapes of static buffers a compiled generator keeps, each a KV cache of one chunk (a rollout's full
# chunk and its last, smaller one); more shapes (an evaluation's) evict the least recently used.
MAX_STATIC_BUFFERS = 2


class _StaticBuffers:
    """Everything a static decode step reads and writes, allocated once per shape and reused: the KV cache
    (in the compute dtype, see ``_allocate_static_layer``), the (B, 1, 1, S) or (B, S) attention mask, the
    step's ids and positions, the outputs, and the step counter ``t`` with the cache slot ``slot`` that
    the step's input token is written to (0-dim device tensors, so a recorded graph indexes with them).
    ``shared``: the cache is a ``prefix_attention.StaticSharedPrefixCache`` (the prompt part once per
    group of K rows, its own masks), ``attn`` a placeholder and ``slot`` a response slot."""

    def __init__(
        self,
        model: Any,
        dynamic: Any,
        n: int,
        size: int,
        steps: int,
        with_logprobs: bool,
        dtype: torch.dtype,
        group: int = 1,
    ) -> None:
        device = dynamic.layers[0].keys.device
        self.t = torch.zeros(1, dtype=torch.long, device=device)  # (1,) the step being chosen
        self.slot = torch.zeros(1, dtype=torch.long, device=device)  # (1,) cache slot of the step's input
        # group > 1: the prompt part held once per group of rows, ``size`` prompt slots, ``steps`` response
        # slots (``slot`` counts the response's); else one cache of ``size`` slots for prompt and response
        self.shared = group > 1
        self.cache: Any
        if self.shared:
            self.cache = prefix_attention.StaticSharedPrefixCache(
                dynamic, group, size, steps, dtype, self.slot
            )
            self.sdpa = False
            # a 4D placeholder, passed through untouched: the attention function masks by the cache's masks
            self.attn = torch.ones((n, 1, 1, 1), dtype=torch.bool, device=device)
        else:
            self.cache = _static_cache(model, dynamic, size, dtype)
            self.sdpa = getattr(model.config, "_attn_implementation", None) == "sdpa"
            # SDPA takes a (B, 1, 1, S) bool mask as it is (no per-step rebuild); other attentions a 2D one
            shape = (n, 1, 1, size) if self.sdpa else (n, size)
            self.attn = torch.zeros(shape, dtype=torch.bool if self.sdpa else torch.long, device=device)
        self.ids = torch.zeros((n, 1), dtype=torch.long, device=device)  # (B, 1) the step's input
        self.pos = torch.zeros((n, 1), dtype=torch.long, device=device)  # (B, 1)
        self.u = torch.zeros((n, steps), dtype=torch.float64, device=device)  # (B, T)
        self.tokens = torch.zeros((n, steps), dtype=torch.long, device=device)  # (B, T)
        self.logprobs = torch.zeros((n, steps), dtype=torch.float32, device=device) if with_logprobs else None
        self.done = torch.zeros(n, dtype=torch.bool, device=device)  # (B,)
        for x in (self.attn, self.ids, self.pos, self.u, self.tokens, self.done, self.t, self.slot):
            torch._dynamo.mark_static_address(x)
        if self.logprobs is not None:
            torch._dynamo.mark_static_address(self.logprobs)

    def load(self, dynamic: Any, mask: torch.Tensor, pos: torch.Tensor, u: torch.Tensor, pad_id: int) -> None:
        """A new chunk: its prefilled cache (B, H, L, D) into slots [0, L), its mask, positions and uniforms.
        Slots past L hold an earlier chunk's values until overwritten; the mask hides them. Shared: the
        prefilled cache is (P, H, L, D), the (B, L) mask prompt-major, its every K-th row the prompt's."""
        if self.shared:
            self.cache.load(dynamic, mask[:: self.cache.k])
        else:
            self._load_cache(dynamic, mask)
        self.pos.copy_(pos)
        self.u.copy_(u)
        self.tokens.fill_(pad_id)
        if self.logprobs is not None:
            self.logprobs.zero_()
        self.done.zero_()

    def _load_cache(self, dynamic: Any, mask: torch.Tensor) -> None:
        width = mask.size(1)
        for src, dst in zip(dynamic.layers, self.cache.layers, strict=True):
            length = src.keys.size(2)
            dst.keys[:, :, :length].copy_(src.keys)
            dst.values[:, :, :length].copy_(src.values)
            dst.cumulative_length.fill_(length)
        self.attn.zero_()
        if self.sdpa:
            self.attn[:, 0, 0, :width] = mask.bool()
        else:
            self.attn[:, :width] = mask

    def open_input(self, t: int, width: int) -> None:
        """Step ``t``'s input (token t-1) visible to the step that writes it (host-indexed)."""
        if self.shared:
            self.slot.fill_(t - 1)  # response slot t-1
            self.cache.open_slot()
        else:
            self.attn[..., width + t - 1] = 1  # cache slot L+t-1

    def open_input_at_counter(self) -> None:
        """:meth:`open_input` at the device counter ``slot``, where this step's forward writes its input."""
        if self.shared:
            self.cache.open_slot()
        else:
            self.attn.index_fill_(-1, self.slot, True)

    def first(self, nxt: torch.Tensor, logprob: torch.Tensor | None, done: torch.Tensor, width: int) -> None:
        """Token 0 (chosen from the prefill's logits) written; the counters set for step 1."""
        self.write(0, nxt, logprob, done)
        self.t.fill_(1)
        self.slot.fill_(0 if self.shared else width)

    def write(self, t: int, nxt: torch.Tensor, logprob: torch.Tensor | None, done: torch.Tensor) -> None:
        """Step ``t``'s tokens (B,) recorded and made the next step's input (host-indexed)."""
        self.tokens[:, t] = nxt
        if logprob is not None and self.logprobs is not None:
            self.logprobs[:, t] = logprob
        self.done.copy_(done)
        self.ids.copy_(nxt[:, None])
        self.pos.add_(1)  # the position of the token just written: the next step's input

    def write_at_counter(self, nxt: torch.Tensor, logprob: torch.Tensor | None, done: torch.Tensor) -> None:
        """:meth:`write` at the device counter ``t``, then both counters advanced: no host index, so the
        whole step replays as one graph."""
        self.tokens.index_copy_(1, self.t, nxt[:, None])
        if logprob is not None and self.logprobs is not None:
            self.logprobs.index_copy_(1, self.t, logprob[:, None])
        self.done.copy_(done)
        self.ids.copy_(nxt[:, None])
        self.pos.add_(1)
        self.t.add_(1)
        self.slot.add_(1)


def _static_cache(model: Any, dynamic: Any, size: int, dtype: torch.dtype) -> Any:
    """A transformers StaticCache of ``size`` slots in ``dtype``, for the layers of the prefilled cache."""
    from transformers import StaticCache

    # Any: transformers types its layers as a union that includes linear-attention and dummy layers
    cache: Any = StaticCache(config=model.config, max_cache_len=size)
    if len(cache.layers) != len(dynamic.layers) or not all(
        hasattr(layer, "cumulative_length") for layer in cache.layers
    ):
        raise RuntimeError(
            "cache_implementation='static' needs a transformers version whose StaticCache layers keep a "
            "cumulative_length (5.x); use cache_implementation='dynamic' here"
        )
    for src, dst in zip(dynamic.layers, cache.layers, strict=True):
        if getattr(dst, "sliding_window", None):
            raise RuntimeError("cache_implementation='static' does not support sliding-window layers yet")
        _allocate_static_layer(dst, src.keys, src.values, dtype)
    return cache


def _allocate_static_layer(dst: Any, keys: torch.Tensor, values: torch.Tensor, dtype: torch.dtype) -> None:
    """Allocate a StaticCache layer for keys and values shaped like ``keys`` and ``values`` (B, H, ., D), in
    ``dtype``, and make its writes cast to it. Under bf16 autocast an fp32 model's keys come out fp32 (the
    rotary embedding promotes) and its values bf16, and transformers' cache takes the keys' dtype for both
    (the values' first write then fails: ``index_copy_(): ... Float and BFloat16``). Attention casts both
    to the compute dtype anyway, so a cache in that dtype holds exactly what attention reads, at half the
    bytes, with no cast of the whole cache at every step."""
    dst.lazy_initialization(keys.to(dtype), values.to(dtype))  # (B, H, S, D) zeros, static addresses marked
    write = type(dst).update

    def update(key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return write(dst, key_states.to(dtype), value_states.to(dtype), *args, **kwargs)

    dst.update = update


def rollout_copy(model: Any, dtype: torch.dtype, *, fuse: bool = True) -> Any:
    """A copy of ``model`` to sample from, with its floating-point parameters in ``dtype``, in eval mode and
    without gradients. Buffers keep their dtype: the rotary embedding's ``inv_freq`` is fp32 in a model
    loaded in bf16 too, and rounded to bf16 it would shift every position's phase (by ~0.5 rad at position
    500 for Qwen2.5's base). Built parameter by parameter: the full-precision model is never duplicated on
    the device first. Refresh it after an optimizer step with :func:`sync_rollout_copy`.

    Why: sampling from an fp32 policy under bf16 autocast casts every weight at every decode step and
    keeps an fp32 KV cache; this copy costs 2 bytes per parameter once.

    ``fuse``: q/k/v and gate/up of Qwen2/Llama layers computed by one matmul each
    (``rloo.rollout_fusion``); the copy's parameters stay the policy's, as views into the fused weights."""
    import copy

    memo: dict[int, Any] = {}
    with torch.no_grad():
        for p in model.parameters():
            memo[id(p)] = torch.nn.Parameter(
                # copy=True: in the policy's own dtype ``to`` would hand back the same storage, which the
                # optimizer steps then change under a generation running beside them (--async_generation)
                p.detach().to(dtype, copy=True) if p.is_floating_point() else p.detach().clone(),
                requires_grad=False,
            )
        for b in model.buffers():
            memo[id(b)] = b.detach().clone()
    clone = copy.deepcopy(model, memo)
    clone.eval().requires_grad_(False)
    if fuse:
        with torch.no_grad():
            rollout_fusion.fuse_projections(clone)
    return clone


def sync_rollout_copy(copy: Any, model: Any) -> None:
    """Copy ``model``'s current parameters into its rollout copy, in place (cast to the copy's dtype; the
    copy's tensors keep their addresses, so recorded graphs stay valid)."""
    dst = list(copy.parameters())
    src = list(model.parameters())
    if len(dst) != len(src):
        raise RuntimeError(f"rollout copy has {len(dst)} parameters, the policy {len(src)}: rebuild the copy")
    with torch.no_grad():
        torch._foreach_copy_(dst, [p.detach() for p in src])


def _normal(t: torch.Tensor) -> torch.Tensor:
    # Inference tensors cannot take part in autograd later (the ids feed the training forward).
    with torch.inference_mode(False):
        return t.clone()
