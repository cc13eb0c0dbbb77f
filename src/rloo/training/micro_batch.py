"""How many completions one forward/backward holds: ``--micro_batch_size``, or a choice from free memory.

The optimizer's arithmetic is the classic trainer's: an optimizer step averages the loss over
``per_device_train_batch_size x gradient_accumulation_steps`` completions per rank (the local mini-batch).
How that mini-batch is cut into forward/backward passes is a memory decision alone: ``--micro_batch_size``
sets it without touching the batch arithmetic (the loss of each of the mini-batch's ``n`` equal
micro-batches is divided by ``n``), so a run that fits three times TRL's micro-batch can take it and keep
TRL's optimizer steps. ``auto`` picks the largest divisor of the mini-batch (whole prompt groups
preferred, so each prompt's rows stay together) whose activations fit the device's free memory, estimated
from the model's shape (:func:`activation_bytes`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rloo.config import RLOOConfig
from rloo.errors import UserError
from rloo.training import deepspeed_utils, precision
from rloo.training.collectives import Collectives

__all__ = [
    "AUTO",
    "MEMORY_HEADROOM",
    "AutoChoice",
    "MicroBatchPlan",
    "activation_bytes",
    "apply_micro_batches",
    "auto_micro_batch",
    "choose_micro_batch",
    "frozen_bytes",
    "plan_for_run",
    "plan_micro_batches",
    "training_state_bytes",
]

log = logging.getLogger(__name__)

AUTO = "auto"
# Share of the free memory that the activations may take: the allocator's fragmentation, the optimizer
# step's temporaries and the estimate's error take the rest.
MEMORY_HEADROOM = 0.7


@dataclass(frozen=True)
class MicroBatchPlan:
    """The local mini-batch cut into ``accumulation_steps`` micro-batches of ``size`` completions."""

    size: int
    accumulation_steps: int
    chosen_by: str  # why this size: the flag that set it, or auto's figures

    def describe(self) -> str:
        return (
            f"micro-batches of {self.size} completions, {self.accumulation_steps} per optimizer step "
            f"({self.chosen_by})"
        )


@dataclass(frozen=True)
class AutoChoice:
    """What ``--micro_batch_size auto`` measured and chose."""

    size: int
    free: float  # bytes free on the GPU before the models were placed
    state: float  # bytes the training state will take (estimate)
    per_completion: float  # bytes one completion's activations take (estimate)

    def describe(self) -> str:
        gib, mib = 2**30, 2**20
        return (
            f"auto: {self.free / gib:.1f} GiB free, ~{self.state / gib:.1f} GiB for the training state, "
            f"~{self.per_completion / mib:.0f} MiB per completion, {MEMORY_HEADROOM:.0%} of the rest used"
        )


def divisors(n: int) -> list[int]:
    """The divisors of ``n``, ascending."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def activation_bytes(
    *,
    hidden: int,
    layers: int,
    intermediate: int,
    vocab: int,
    tokens: float,
    response_tokens: int,
    dtype_bytes: int,
    checkpointing: bool,
) -> float:
    """Memory one completion's forward and backward holds at its peak, in bytes.

    Per token and layer a decoder keeps its inputs for the backward: the norms', q/k/v/o's and the
    attention output (about 8 x hidden values, flash attention keeping no score matrix) and the MLP's
    (gate, up, their product and the activation: 4 x intermediate), in the compute dtype. Activation
    checkpointing keeps one hidden state per layer and recomputes one layer at a time. The output layer
    holds each response token's logits in the compute dtype, their fp32 log-softmax chunk and the logits'
    gradient: (2 x dtype + 4) bytes per vocabulary entry. ``tokens``: positions the forward runs per
    completion (with shared prompts, the prompt's length over K plus the response).
    """
    per_layer = (8 * hidden + 4 * intermediate) * dtype_bytes
    if checkpointing:
        kept = tokens * (layers * hidden * dtype_bytes + per_layer)
    else:
        kept = tokens * layers * per_layer
    return kept + response_tokens * vocab * (2 * dtype_bytes + 4)


def training_state_bytes(
    params: int, *, frozen_bytes: float = 0.0, zero_stage: int = 0, shards: int = 1
) -> float:
    """Device memory of the trained model's state before any activation: per trained parameter its fp32
    weight, gradient and Adam's two moments (16 bytes; ZeRO-1/2 split the moments and gradients over
    ``shards`` ranks, ZeRO-3 the weights too), plus ``frozen_bytes`` of frozen models (the reference, a
    rollout copy)."""
    split = {0: 0, 1: 8, 2: 12, 3: 16}[zero_stage]
    return params * (16 - split) + params * split / shards + frozen_bytes


def choose_micro_batch(mini_batch: int, rloo_k: int, per_completion: float, free: float) -> int:
    """The largest divisor of ``mini_batch`` whose completions' activations fit ``MEMORY_HEADROOM`` of
    ``free`` bytes, whole groups of ``rloo_k`` first; the smallest divisor when none fits (the run then
    finds out on its first update, with the smallest footprint it can have)."""
    budget = MEMORY_HEADROOM * free
    options = divisors(mini_batch)
    whole_groups = [d for d in options if d % rloo_k == 0]
    fitting = [d for d in whole_groups if d * per_completion <= budget] or [
        d for d in options if d * per_completion <= budget
    ]
    return max(fitting) if fitting else options[0]


def plan_micro_batches(
    *, mini_batch: int, per_device: int, setting: str | None, auto: AutoChoice | None = None
) -> MicroBatchPlan:
    """The micro-batches of a local mini-batch of ``mini_batch`` completions: ``setting`` None keeps
    ``per_device`` (per_device_train_batch_size, the classic layout), a number sets the size (it must
    divide the mini-batch: equal micro-batches keep the loss a mean over the mini-batch), ``auto`` takes
    ``auto``'s size (None: no device memory to measure, so ``per_device``)."""
    if setting is None:
        return MicroBatchPlan(per_device, mini_batch // per_device, "per_device_train_batch_size")
    if setting == AUTO:
        if auto is None:
            kept = f"auto: no GPU memory to measure, per_device_train_batch_size {per_device} kept"
            return MicroBatchPlan(per_device, mini_batch // per_device, kept)
        return MicroBatchPlan(auto.size, mini_batch // auto.size, auto.describe())
    size = int(setting)
    if mini_batch % size:
        fits = ", ".join(str(d) for d in divisors(mini_batch))
        raise UserError(
            f"--micro_batch_size {size} does not divide the {mini_batch} completions of a mini-batch "
            f"(per_device_train_batch_size x gradient_accumulation_steps); choose one of {fits}, or auto"
        )
    return MicroBatchPlan(size, mini_batch // size, "micro_batch_size")


def auto_micro_batch(
    model_config: Any,
    *,
    mini_batch: int,
    rloo_k: int,
    prompt_tokens: int,
    response_tokens: int,
    trained_params: int,
    frozen_bytes: float,
    compute_bytes: int,
    checkpointing: bool,
    zero_stage: int,
    shards: int,
    free_bytes: float,
) -> AutoChoice:
    """``--micro_batch_size auto`` for a model of ``model_config`` (a transformers config): the largest
    micro-batch whose activations fit what the training state leaves of ``free_bytes``. Prompts count
    once per group (prefix-shared forwards), responses per completion."""
    hidden = int(model_config.hidden_size)
    per_completion = activation_bytes(
        hidden=hidden,
        layers=int(model_config.num_hidden_layers),
        intermediate=int(getattr(model_config, "intermediate_size", None) or 4 * hidden),
        vocab=int(model_config.vocab_size),
        tokens=prompt_tokens / rloo_k + response_tokens,
        response_tokens=response_tokens,
        dtype_bytes=compute_bytes,
        checkpointing=checkpointing,
    )
    state = training_state_bytes(
        trained_params, frozen_bytes=frozen_bytes, zero_stage=zero_stage, shards=shards
    )
    size = choose_micro_batch(mini_batch, rloo_k, per_completion, max(free_bytes - state, 0.0))
    return AutoChoice(size, free_bytes, state, per_completion)


def frozen_bytes(cfg: RLOOConfig, accelerator: Any, policy: Any, params: int) -> float:
    """GPU bytes of the frozen copies of the policy a run holds beside it, in the dtypes
    ``rloo.training.precision`` gives them: the reference (none with LoRA, where it is the policy with its
    adapters off, nor on the GPU with --offload_ref_model) and the built-in generator's rollout copy."""
    loaded = next(policy.parameters()).element_size()
    total = 0.0
    if not cfg.use_peft and not cfg.offload_ref_model:
        ref = precision.reference_dtype(accelerator, moving=cfg.sync_ref_model)
        total += params * (ref.itemsize if ref is not None else loaded)
    if not cfg.use_vllm:
        copy = precision.rollout_copy_dtype(cfg.generation_dtype, accelerator, policy)
        total += params * (copy.itemsize if copy is not None else 0)
    return total


def plan_for_run(
    cfg: RLOOConfig,
    accelerator: Any,
    policy: Any,
    prompt_ids: list[list[int]],
    *,
    world: int,
    smallest: Callable[[int], int] = lambda size: size,
) -> MicroBatchPlan:
    """The micro-batches of this run's updates, ``auto`` measured on the GPU before the models are
    placed (DeepSpeed takes the accumulation steps at ``prepare``): the trained parameters' state, the
    frozen copies of the policy (:func:`frozen_bytes`), and the longest prompt. ``smallest``: the smallest
    of every rank's choice (each measures its own GPU, and the ranks must take the same number of
    micro-batches per step, or DeepSpeed's boundary and the gradient average would disagree)."""
    import torch

    mini_batch = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps
    auto = None
    if cfg.micro_batch_size == AUTO and torch.cuda.is_available():
        compute_bytes = 2 if cfg.bf16 or cfg.fp16 else 4
        params = sum(int(getattr(p, "ds_numel", p.numel())) for p in policy.parameters())
        trained = sum(int(getattr(p, "ds_numel", p.numel())) for p in policy.parameters() if p.requires_grad)
        auto = auto_micro_batch(
            policy.config,
            mini_batch=mini_batch,
            rloo_k=cfg.rloo_k,
            prompt_tokens=max(map(len, prompt_ids), default=1),
            response_tokens=cfg.response_length,
            trained_params=trained,
            frozen_bytes=frozen_bytes(cfg, accelerator, policy, params),
            compute_bytes=compute_bytes,
            checkpointing=cfg.gradient_checkpointing,
            zero_stage=deepspeed_utils.zero_stage(accelerator),
            shards=world,
            free_bytes=float(torch.cuda.mem_get_info()[0]),
        )
        agreed = smallest(auto.size)  # a divisor too: the smallest of divisors of the same mini-batch
        auto = AutoChoice(agreed, auto.free, auto.state, auto.per_completion)
    return plan_micro_batches(
        mini_batch=mini_batch,
        per_device=cfg.per_device_train_batch_size,
        setting=cfg.micro_batch_size,
        auto=auto,
    )


def apply_micro_batches(
    cfg: RLOOConfig, accelerator: Any, policy: Any, prompt_ids: list[list[int]], *, comm: Collectives
) -> MicroBatchPlan:
    """Plan this run's micro-batches (:func:`plan_for_run`) before the policy is placed, and tell accelerate
    and DeepSpeed how many make an optimizer step: accelerate divides each micro-batch's loss by that
    number, DeepSpeed scales it and steps at that boundary."""
    plan = plan_for_run(
        cfg,
        accelerator,
        policy,
        prompt_ids,
        world=comm.world,
        smallest=lambda size: comm.smallest(size, accelerator.device),
    )
    accelerator.gradient_accumulation_steps = plan.accumulation_steps
    deepspeed_utils.fill_deepspeed_config(  # a no-op without DeepSpeed
        accelerator,
        micro_batch_size=plan.size,
        gradient_accumulation_steps=plan.accumulation_steps,
        max_grad_norm=cfg.max_grad_norm,
    )
    log.info("%s", plan.describe())
    return plan
