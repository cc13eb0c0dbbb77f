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
    if not (p / "config.json").is_file():
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


def load_causal_lm(
    path: str, *, flag: str, trust_remote_code: bool = False, dtype: torch.dtype = torch.float32
) -> Any:
    from transformers import AutoModelForCausalLM

    model = _wrap_load(
        flag,
        path,
        lambda: AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=trust_remote_code),
    )
    disable_dropout(model)
    return model


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
