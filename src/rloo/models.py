"""Loading the policy, the frozen reference and the reward model, with one-line errors for bad paths."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from rloo.errors import UserError

log = logging.getLogger(__name__)


def _check_source(flag: str, path: str) -> None:
    p = Path(path).expanduser()
    looks_local = p.exists() or path.startswith((".", "/", "~")) or path.count("/") > 1
    if not looks_local:
        return  # a Hub id: transformers resolves it (and reports its own failure, wrapped below)
    if not p.is_dir():
        raise UserError(f"--{flag} {path}: no such directory; pass a model directory or a Hub id.")
    if not (p / "config.json").is_file() and not (p / "adapter_config.json").is_file():
        raise UserError(
            f"--{flag} {path}: not a model directory (no config.json); pass a save_pretrained output."
        )


def _wrap_load(flag: str, path: str, fn: Any) -> Any:
    _check_source(flag, path)
    try:
        return fn()
    except UserError:
        raise
    except Exception as e:  # corrupt weights, missing files, network: all one line for the user
        first = (str(e).strip().splitlines() or [""])[0][:300]
        raise UserError(
            f"--{flag} {path}: cannot load it ({type(e).__name__}: {first}); check that it is a complete, "
            "uncorrupted save_pretrained output (re-download or re-save it)."
        ) from None


def load_tokenizer(path: str, *, flag: str = "model_name_or_path", trust_remote_code: bool = False) -> Any:
    """The tokenizer, left-padding (for generation), with pad = eos when it has no pad token."""
    from transformers import AutoTokenizer

    tok = _wrap_load(
        flag,
        path,
        lambda: AutoTokenizer.from_pretrained(path, padding_side="left", trust_remote_code=trust_remote_code),
    )
    if tok.eos_token_id is None:
        raise UserError(
            f"--{flag} {path}: the tokenizer has no EOS token; set one (tokenizer.eos_token) and save it."
        )
    if tok.pad_token_id is None:
        log.info(
            "tokenizer at %s has no pad token: using its EOS token (%r) for padding", path, tok.eos_token
        )
        tok.pad_token = tok.eos_token
    return tok


def disable_dropout(model: torch.nn.Module) -> None:
    # RLHF wants the sampling policy, the "old" policy and the trained policy to be one function:
    # dropout would make the importance ratio noisy for nothing.
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0


ADAPTER_CONFIG = "adapter_config.json"


def load_causal_lm(
    path: str,
    *,
    flag: str,
    trust_remote_code: bool = False,
    dtype: torch.dtype = torch.float32,
    **from_pretrained: Any,
) -> Any:
    """A causal LM from a model directory or Hub id. A LoRA adapter directory (``adapter_config.json``,
    what ``rloo train --use_peft`` writes) loads its base model and merges the adapter in."""
    from transformers import AutoModelForCausalLM

    if (Path(path).expanduser() / ADAPTER_CONFIG).is_file():
        return _load_adapter(path, flag=flag, trust_remote_code=trust_remote_code, dtype=dtype)
    model = _wrap_load(
        flag,
        path,
        lambda: AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, trust_remote_code=trust_remote_code, **from_pretrained
        ),
    )
    disable_dropout(model)
    return model


def _load_adapter(path: str, *, flag: str, trust_remote_code: bool, dtype: torch.dtype) -> Any:
    import json

    try:
        from peft import PeftModel
    except ImportError:
        raise UserError(
            f"--{flag} {path} is a LoRA adapter: loading it needs the peft package (pip install peft)."
        ) from None
    try:
        base_path = json.loads((Path(path).expanduser() / ADAPTER_CONFIG).read_text())[
            "base_model_name_or_path"
        ]
    except (ValueError, KeyError):
        raise UserError(
            f"--{flag} {path}: {ADAPTER_CONFIG} names no base_model_name_or_path; re-save the adapter."
        ) from None
    if not base_path:
        raise UserError(f"--{flag} {path}: {ADAPTER_CONFIG} names no base model; re-save the adapter.")
    base = load_causal_lm(
        base_path, flag=f"{flag} (the adapter's base model)", trust_remote_code=trust_remote_code, dtype=dtype
    )
    model = _wrap_load(flag, path, lambda: PeftModel.from_pretrained(base, path))
    return model.merge_and_unload()  # a plain model again: generation and push see no adapter


def load_reward_model(
    path: str, *, trust_remote_code: bool = False, dtype: torch.dtype = torch.float32
) -> tuple[Any, Any]:
    """A sequence-classification model with one output and its *own* tokenizer (right padding)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    flag = "reward_model_path"
    model = _wrap_load(
        flag,
        path,
        lambda: AutoModelForSequenceClassification.from_pretrained(
            path, num_labels=1, dtype=dtype, trust_remote_code=trust_remote_code
        ),
    )
    tok = _wrap_load(
        flag,
        path,
        lambda: AutoTokenizer.from_pretrained(
            path, padding_side="right", trust_remote_code=trust_remote_code
        ),
    )
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    model.config.pad_token_id = tok.pad_token_id
    model.eval().requires_grad_(False)
    return model, tok
