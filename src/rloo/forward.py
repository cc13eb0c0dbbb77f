"""Response logits with each prompt computed once.

RLOO scores K completions of every prompt. A plain forward over ``[prompt; response]`` rows recomputes
each prompt K times, and for TL;DR-shaped work (hundreds of prompt tokens, tens of response tokens) that
is most of the cost of the reference, old and training forwards. Here the distinct prompts of a batch
are run once, their KV cache is gathered to the completion rows (autograd sums the gradients of the
copies back into the one prompt computation), and only the response tokens run per completion.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

# Share prompts when that leaves fewer than this fraction of the tokens of a plain forward.
SHARE_THRESHOLD = 0.75


def model_config(model: Any) -> Any:
    """The transformers config of a model, also through a DeepSpeed engine or DDP wrapper (``.module``):
    a DeepSpeed engine has a ``config`` of its own, DeepSpeed's dict."""
    return getattr(model, "module", model).config


def prefill(
    model: Any, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, ctx: Any
) -> tuple[Any, torch.Tensor]:
    """Run left-padded prompts (P, L) into a fresh KV cache; return the model output (its cache in
    ``past_key_values``, logits of the last position only) and the position ids (P, L), which count real
    tokens only so that left padding does not shift them."""
    from transformers import DynamicCache

    position_ids = (prompt_mask.cumsum(-1) - 1).clamp(min=0)
    with ctx():
        out = model(
            input_ids=prompt_ids,
            attention_mask=prompt_mask,
            position_ids=position_ids,
            past_key_values=DynamicCache(config=model_config(model)),
            use_cache=True,
            logits_to_keep=1,
        )
    return out, position_ids


def response_logits(
    model: Any,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    rows: torch.Tensor,
    responses: torch.Tensor,
    *,
    share_prefix: bool | None = None,
    autocast: Callable[[], Any] | None = None,
) -> torch.Tensor:
    """Next-token logits for every response token: (b, T, V).

    prompt_ids, prompt_mask: (P, L) left-padded prompts; rows: (b,) the prompt of each response row;
    responses: (b, T). ``logits[:, t]`` is the distribution the model assigns to ``responses[:, t]``.
    ``share_prefix=None`` decides by token count: sharing costs a second model call, which only pays
    when it saves a good part of the tokens (long prompts, several completions per prompt).
    """
    ctx = autocast or contextlib.nullcontext
    if share_prefix is None:
        b, t, width = rows.numel(), responses.size(1), prompt_ids.size(1)
        shared_tokens = torch.unique(rows).numel() * width + b * t
        share_prefix = shared_tokens < SHARE_THRESHOLD * b * (width + t)
    if not share_prefix:
        ids = torch.cat([prompt_ids[rows], responses], dim=1)  # (b, L+T)
        attn = torch.cat([prompt_mask[rows], torch.ones_like(responses)], dim=1)
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        t = responses.size(1)
        with ctx():
            # The output layer only where a response token is predicted (the last T+1 positions, the
            # final one predicting past the response): with a real vocabulary it costs more than the
            # transformer, and the prompt's L positions would be most of it.
            logits = model(
                input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=False, logits_to_keep=t + 1
            ).logits  # (b, T+1, V)
        return logits[:, :-1]  # (b, T, V)

    width = prompt_ids.size(1)
    if width < 2:  # nothing to share before the prompt's last token
        return response_logits(
            model, prompt_ids, prompt_mask, rows, responses, share_prefix=False, autocast=autocast
        )
    uniq, inverse = torch.unique(rows, return_inverse=True)  # (U,), (b,)
    p_mask = prompt_mask[uniq]  # (U, L)
    # The prompts but their last token run once into a KV cache; each completion row then runs the
    # prompt's last token and its response but the last: T positions whose logits are exactly the T
    # needed, from one call (no separate logits for response token 0, no (b, T, V) concatenation). Left
    # padding puts every prompt's last real token in the last column.
    out, _ = prefill(model, prompt_ids[uniq, :-1], p_mask[:, :-1], ctx)
    cache = out.past_key_values
    cache.batch_select_indices(inverse)  # (U, ...) -> (b, ...), differentiable gather
    t = responses.size(1)
    ids = torch.cat([prompt_ids[rows, -1:], responses[:, :-1]], dim=1)  # (b, T)
    attn = torch.cat([p_mask[inverse], torch.ones_like(responses[:, :-1])], dim=1)  # (b, L+T-1)
    last = (p_mask.sum(-1, keepdim=True) - 1).clamp(min=0)[inverse]  # (b, 1) position of the last token
    pos = last + torch.arange(t, device=responses.device)  # (b, T)
    with ctx():
        return model(
            input_ids=ids,
            attention_mask=attn,
            position_ids=pos,
            past_key_values=cache,
            use_cache=True,
        ).logits  # (b, T, V)
