"""Frozen models that only run forwards next to the policy (the reference, a distillation teacher): held in
the dtype :func:`rloo.training.precision.reference_dtype` picks and placed as the policy is (a DeepSpeed
inference engine under ZeRO-3, on the device otherwise)."""

from __future__ import annotations

import logging
from typing import Any

from rloo.config import RLOOConfig
from rloo.training import deepspeed_utils, precision

log = logging.getLogger(__name__)


def place(
    model: Any,
    accelerator: Any,
    name: str,
    *,
    moving: bool = False,
    on_cpu: bool = False,
    fp32_head: bool = False,
) -> Any:
    """``model`` cast (``moving``: a model that moves toward the policy keeps full precision) and placed;
    ``on_cpu``: left in CPU memory (the producer moves it in for its forwards). ``name`` names it in the log.
    ``fp32_head`` (--cast_lm_head_to_fp32): its logits computed in fp32, as the policy's are."""
    if fp32_head:
        precision.lm_head_in_fp32(model)
    dtype = precision.reference_dtype(accelerator, moving=moving)
    if dtype is not None:
        precision.cast_parameters(model, dtype)  # what autocast casts at every call, once
        log.info("%s: weights in %s", name, str(dtype).removeprefix("torch."))
    if on_cpu:
        return model
    # under ZeRO-3 the frozen models become DeepSpeed inference engines; otherwise just moved
    return deepspeed_utils.prepare_reference_model(model, accelerator)


def place_reference(model: Any, accelerator: Any, cfg: RLOOConfig, deepspeed: bool) -> Any:
    """The reference placed (None stays None: with LoRA the reference is the policy with its adapters off);
    --offload_ref_model keeps it in CPU memory but under DeepSpeed, which places it itself."""
    if model is None:
        return None
    on_cpu = cfg.offload_ref_model and not deepspeed
    return place(
        model,
        accelerator,
        "reference model",
        moving=cfg.sync_ref_model,
        on_cpu=on_cpu,
        fp32_head=cfg.cast_lm_head_to_fp32,
    )
