"""LoRA through PEFT: the policy trains low-rank adapters, the frozen reference is the same base model
with the adapters switched off (no second copy of the weights in memory).

What a LoRA run writes: checkpoints hold the adapter, optimizer, scheduler and RNG state only; the final
``output_dir`` holds the adapter (``adapter_config.json``, ``adapter_model.safetensors``) and the
tokenizer, plus with ``--merge_adapter`` a full merged model in ``output_dir/merged``. ``rloo eval`` and
``rloo push`` take either (:func:`rloo.models.load_causal_lm` merges an adapter directory on load).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from rloo.errors import UserError
from rloo.models import ADAPTER_CONFIG, ADAPTER_WEIGHTS


def require_peft() -> Any:
    try:
        import peft
    except ImportError:
        raise UserError(
            "--use_peft needs the peft package: pip install 'rloo-kfp[train]' (or pip install peft)."
        ) from None
    return peft


def is_peft_model(model: Any) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def wrap_with_lora(
    model: Any,
    *,
    r: int,
    alpha: float,
    dropout: float,
    target_modules: list[str] | None,
    gradient_checkpointing: bool = False,
    quantized: bool = False,
) -> Any:
    """The policy with fresh LoRA adapters (B = 0, so it starts as exactly the base model)."""
    peft = require_peft()
    if quantized:  # QLoRA: norms in fp32, input grads on, as PEFT prepares a k-bit model for training
        model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=gradient_checkpointing)
    config = peft.LoraConfig(
        task_type="CAUSAL_LM",
        r=r,
        lora_alpha=alpha,
        lora_dropout=dropout,
        # None: PEFT's per-architecture default (the attention projections)
        target_modules=list(target_modules) if target_modules else None,
    )
    try:
        wrapped = peft.get_peft_model(model, config)
    except ValueError as e:  # e.g. target modules that the model does not have
        raise UserError(f"--lora_target_modules: {str(e).splitlines()[0]}") from None
    if gradient_checkpointing:
        # recomputed blocks need an input that requires grad, which frozen embeddings do not give
        wrapped.enable_input_require_grads()
    return wrapped


@contextlib.contextmanager
def adapter_disabled(model: Any) -> Iterator[Any]:
    """``model`` acting as its base model (the frozen reference of a LoRA run)."""
    with model.disable_adapter():
        yield model


def quantization_kwargs(load_in_4bit: bool, *, bf16: bool) -> dict[str, Any]:
    """``from_pretrained`` keywords for QLoRA's 4-bit base (NF4, double quantisation), or none."""
    if not load_in_4bit:
        return {}
    if not torch.cuda.is_available():
        raise UserError(
            "--load_in_4bit needs a CUDA GPU (bitsandbytes' 4-bit kernels); drop it to train LoRA on CPU."
        )
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        raise UserError("--load_in_4bit needs bitsandbytes: pip install bitsandbytes.") from None
    from transformers import BitsAndBytesConfig

    return {
        "quantization_config": BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16 if bf16 else torch.float32,
        )
    }


def record_base_model(out_dir: Path, base: str) -> None:
    """Name the durable base model in the saved adapter (PEFT writes the path it was loaded from, which
    in a pipeline step is a temporary copy), so that loading the adapter later finds its base."""
    import json

    path = out_dir / ADAPTER_CONFIG
    config = json.loads(path.read_text())
    config["base_model_name_or_path"] = base
    path.write_text(json.dumps(config, indent=2, sort_keys=True))


def parameter_counts(model: Any) -> tuple[int, int]:
    """(trainable, total) parameters."""
    # ds_numel: under ZeRO-3 a parameter's own numel is its local shard (often 0)
    sizes = [(int(getattr(p, "ds_numel", p.numel())), p.requires_grad) for p in model.parameters()]
    return sum(n for n, trainable in sizes if trainable), sum(n for n, _ in sizes)


def load_adapter_weights(model: Any, path: Path) -> None:
    """Restore a checkpoint's adapter into the live PEFT model (the base weights never change)."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    weights = path / ADAPTER_WEIGHTS
    if not weights.is_file():
        raise ValueError(f"{weights.name} is missing: the checkpoint was not written by a --use_peft run")
    result = set_peft_model_state_dict(model, load_file(str(weights)))
    unexpected = getattr(result, "unexpected_keys", None)
    if unexpected:
        raise ValueError(f"the adapter does not fit this model (unexpected keys such as {unexpected[0]})")


def save_merged(model: Any, tokenizer: Any, path: Path) -> None:
    """The base model with the adapter folded in, as a plain ``save_pretrained`` model. Merges a copy:
    the live model keeps its adapter."""
    import copy

    merged = copy.deepcopy(model).merge_and_unload()
    path.mkdir(parents=True, exist_ok=True)
    merged.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)


@contextlib.contextmanager
def merged_weights(model: Any) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """(name, tensor) of the base model's weights with the adapter merged in, named as in the base
    checkpoint (what an inference engine such as vLLM loads). The merge is undone on exit."""
    model.merge_adapter()
    try:
        prefix = "base_model.model."
        yield [
            (name.removeprefix(prefix).replace(".base_layer.", "."), param.data)
            for name, param in model.named_parameters()
            if "lora_" not in name
        ]
    finally:
        model.unmerge_adapter()
