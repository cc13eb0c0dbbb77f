"""Which weights run in the compute dtype (bf16/fp16) rather than the policy's fp32.

The policy trains in fp32 under mixed-precision autocast: its optimizer needs full-precision weights. The
models that only run forwards (the rollout copy the built-in generator samples from, the frozen
reference) gain nothing from fp32 weights under autocast, which casts each weight at every call: held in
the compute dtype they are cast once, read at half the bytes, and give the matmuls the same inputs.
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
    (``RLOOConfig.generation_dtype``). 'auto' copies on a GPU run in mixed precision, where the copy saves a
    cast of every weight at every decode step and halves the KV cache; not with LoRA (the reference is the
    policy with its adapters off, and a copy would double the base) nor DeepSpeed (ZeRO holds the policy in
    the training dtype already, or shards it). Raises UserError for an explicit copy under DeepSpeed."""
    if generation_dtype == "policy":
        return None
    if generation_dtype != "auto":
        if _deepspeed(accelerator):
            raise UserError(
                f"--generation_dtype {generation_dtype} copies the policy, which DeepSpeed holds itself: "
                "leave --generation_dtype auto under DeepSpeed."
            )
        return _COPY_DTYPES[generation_dtype]
    half = half_dtype(accelerator)
    if (
        half is None
        or _deepspeed(accelerator)
        or accelerator.device.type != "cuda"
        or hasattr(policy, "peft_config")
    ):
        return None
    return half


def reference_dtype(accelerator: Any, *, moving: bool) -> torch.dtype | None:
    """The dtype to hold the frozen reference model in: the compute dtype on a GPU run in mixed precision
    without DeepSpeed (which places and casts it itself), None (as loaded) otherwise. A ``moving``
    reference (--sync_ref_model) stays in full precision: its updates are small steps towards the policy,
    which bf16 would round away."""
    if moving or _deepspeed(accelerator) or accelerator.device.type != "cuda":
        return None
    return half_dtype(accelerator)
