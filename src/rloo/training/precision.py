"""Which weights run in the compute dtype (bf16/fp16) rather than the policy's fp32.

The policy trains in fp32 under mixed-precision autocast: its optimizer needs full-precision weights. The
models that only run forwards (the rollout copy the built-in generator samples from, the frozen
reference) gain little from fp32 weights under autocast, which casts each weight at every call: held in
bf16 they are cast once and read at half the bytes; the matmuls get the same weights, the activations
between them (norms, residual sums) run in bf16 rather than fp32, as in any bf16 inference engine.
Buffers (rotary frequencies) keep their dtype.
"""

from __future__ import annotations

from typing import Any

import torch

from rloo.errors import UserError

_HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}
_COPY_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def _deepspeed(accelerator: Any) -> bool:
    from accelerate.utils import DistributedType

    return bool(accelerator.distributed_type == DistributedType.DEEPSPEED)


def half_dtype(accelerator: Any) -> torch.dtype | None:
    """The mixed-precision compute dtype of this run (bf16 or fp16), None without mixed precision."""
    return _HALF.get(str(accelerator.mixed_precision))


def rollout_copy_dtype(generation_dtype: str, accelerator: Any, policy: Any) -> torch.dtype | None:
    """The dtype of the policy copy the built-in generator samples from, None for the policy itself
    (``RLOOConfig.generation_dtype``). 'auto' copies on a GPU run in bf16, where the copy saves a cast of
    every weight at every decode step and halves the KV cache; not in fp16 (pure fp16 activations can
    overflow where fp16 autocast keeps them in fp32: opt in with 'float16'), not with LoRA (a copy would
    hold the base twice and refresh it at every step) nor DeepSpeed (ZeRO holds the policy in the training
    dtype already, or shards it). Raises UserError for an explicit copy under DeepSpeed."""
    if generation_dtype == "policy":
        return None
    if generation_dtype != "auto":
        if _deepspeed(accelerator):
            raise UserError(
                f"--generation_dtype {generation_dtype} copies the policy, which DeepSpeed holds itself: "
                "leave --generation_dtype auto under DeepSpeed."
            )
        return _COPY_DTYPES[generation_dtype]
    if not _bf16_on_gpu(accelerator) or hasattr(policy, "peft_config"):
        return None
    return torch.bfloat16


def _bf16_on_gpu(accelerator: Any) -> bool:
    return (
        half_dtype(accelerator) is torch.bfloat16
        and accelerator.device.type == "cuda"
        and not _deepspeed(accelerator)
    )


def reference_dtype(accelerator: Any, *, moving: bool) -> torch.dtype | None:
    """The dtype to hold the frozen reference model's parameters in: bf16 on a GPU run in bf16 without
    DeepSpeed (which places and casts it itself), None (as loaded) otherwise; fp16 runs keep it in fp32
    (see :func:`rollout_copy_dtype`). A ``moving`` reference (--sync_ref_model) stays in full precision:
    its updates are small steps towards the policy, which bf16 would round away."""
    if moving or not _bf16_on_gpu(accelerator):
        return None
    return torch.bfloat16


def cast_parameters(model: Any, dtype: torch.dtype) -> None:
    """Cast ``model``'s floating-point parameters to ``dtype`` in place, leaving its buffers as they are:
    ``model.to(dtype)`` would also round the rotary embedding's fp32 ``inv_freq`` (which transformers keeps
    in fp32 in bf16 models too) and shift every position's phase."""
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point():
                p.data = p.data.to(dtype)


def lm_head_in_fp32(model: Any) -> None:
    """--cast_lm_head_to_fp32 (ScaleRL; TRL's option of that name): ``model``'s output projection computes
    in float32 whatever the autocast or the weights' dtype, so the logits and every log-prob drawn from them
    keep fp32 precision (a bf16 logit has 8 bits of mantissa: log-prob errors of ~1e-2 at a 150k vocabulary).

    The weights keep their dtype and names (checkpoints, the optimizer and weight pushes see no change):
    the head's forward upcasts them at each call. The override is a bound method, so a deep copy of the
    model (the rollout copy) computes its head in fp32 too. A head that is not a plain linear layer (a LoRA
    adapter on it) is refused in one line.
    """
    import types

    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear) or type(head) is not torch.nn.Linear:
        raise UserError(
            f"--cast_lm_head_to_fp32 needs a plain linear LM head (got {type(head).__name__}): leave lm_head out "
            "of --lora_target_modules, or drop --cast_lm_head_to_fp32."
        )
    head.forward = types.MethodType(_fp32_linear, head)  # type: ignore[method-assign]


def _fp32_linear(self: torch.nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
    with torch.autocast(device_type=hidden.device.type, enabled=False):
        bias = None if self.bias is None else self.bias.float()
        return torch.nn.functional.linear(hidden.float(), self.weight.float(), bias)
