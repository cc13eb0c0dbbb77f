"""Response logits with each prompt computed once.

RLOO scores K completions of every prompt. A plain forward over ``[prompt; response]`` rows recomputes
each prompt K times, and for TL;DR-shaped work (hundreds of prompt tokens, tens of response tokens) that
is most of the cost of the reference, old and training forwards. Two ways to compute each prompt once:

Packed rows (the default where the attention takes a 4D mask: ``eager`` and ``sdpa``). One row per
prompt group: the (left-padded) prompt, then the group's K responses back to back, each response's
tokens at positions ``prompt_len + t`` as if it followed the prompt alone, under a block attention mask:
a response token sees the prompt's real tokens and the earlier tokens of its own response, nothing of
the other responses, no padding. One plain model call without a KV cache, so activation checkpointing and
compiled decoder layers (:mod:`rloo.training.compile`) apply to it as to plain rows. Per group it runs
``L + K (T-1)`` positions where plain rows run ``K (L + T)``: with L=460, T=53, K=4 that is 668 against
2,052 positions, a third of the linear-layer FLOPs (the projections and MLP, most of a forward), and
the attention, though it computes the whole masked ``W x W`` square of the packed row, still less
(668^2 against 4 x 513^2). The output layer runs only at the T positions that predict each response's
tokens: the prompt's last position (read once for each response) and each response's own positions.
``flash_attention_2`` and other kernels that take no 4D mask fall back to the KV cache below.

KV cache (the fallback): the distinct prompts run once into a KV cache, which is gathered to the
completion rows (autograd sums the gradients of the copies back into the one prompt computation), and
only the response tokens run per completion: two model calls, and a cache, which activation
checkpointing and compiled layers do not take (those run plain rows then).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

# Share prompts when that leaves fewer than this fraction of the tokens of a plain forward.
SHARE_THRESHOLD = 0.75

# Attention implementations (``config._attn_implementation``) that take a ready 4D mask as it is:
# transformers' mask builders return a 4D tensor unchanged (masking_utils._preprocess_mask_arguments);
# sdpa hands it to torch's SDPA as ``attn_mask`` (boolean: True attends), eager adds it to the scores
# (additive: 0 or a large negative number). Flash attention reads 2D padding masks only.
BLOCK_MASK_ATTENTION = {"sdpa": "bool", "eager": "additive"}


def model_config(model: Any) -> Any:
    """The transformers config of a model, also through a DeepSpeed engine or DDP wrapper (``.module``):
    a DeepSpeed engine has a ``config`` of its own, DeepSpeed's dict."""
    return getattr(model, "module", model).config


def takes_block_mask(model: Any) -> bool:
    """Whether the model's attention takes a 4D block mask (:data:`BLOCK_MASK_ATTENTION`), i.e. whether
    it can run packed rows."""
    config = getattr(getattr(model, "module", model), "config", None)
    return getattr(config, "_attn_implementation", None) in BLOCK_MASK_ATTENTION


def shares_prefix(rows: torch.Tensor, width: int, length: int) -> bool:
    """Whether computing each distinct prompt once pays for ``rows`` (b,) completions of ``length`` tokens
    after prompts of padded ``width``: when it leaves fewer than SHARE_THRESHOLD of a plain forward's
    tokens (the KV-cache path's second call costs a fixed overhead)."""
    b = rows.numel()
    if width < 2:  # nothing to share before the prompt's last token
        return False
    shared_tokens = torch.unique(rows).numel() * width + b * length
    return shared_tokens < SHARE_THRESHOLD * b * (width + length)


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
    packed: bool | None = None,
    width_multiple: int = 1,
    autocast: Callable[[], Any] | None = None,
) -> torch.Tensor:
    """Next-token logits for every response token: (b, T, V).

    prompt_ids, prompt_mask: (P, L) left-padded prompts; rows: (b,) the prompt of each response row;
    responses: (b, T). ``logits[:, t]`` is the distribution the model assigns to ``responses[:, t]``.
    ``share_prefix=None`` decides by token count (:func:`shares_prefix`). ``packed``: run packed rows
    with a 4D block mask (one row per prompt when sharing, per completion otherwise); None packs when
    sharing and the attention takes the mask, and otherwise shares through a KV cache. ``width_multiple``
    pads packed rows (more left padding) to a multiple of it, and with it > 1 plain rows run packed too,
    always with a 4D mask: compiled layers then see few shapes and never a missing mask, and replay.
    """
    ctx = autocast or contextlib.nullcontext
    if share_prefix is None:
        share_prefix = shares_prefix(rows, prompt_ids.size(1), responses.size(1))
    if packed is None:
        packed = takes_block_mask(model) and (share_prefix or width_multiple > 1)
    if packed:
        rows_ = pack_rows(
            prompt_ids, prompt_mask, rows, responses, share=share_prefix, width_multiple=width_multiple
        )
        return packed_logits(model, rows_, ctx)
    if share_prefix and prompt_ids.size(1) >= 2:
        return _kv_cache_logits(model, prompt_ids, prompt_mask, rows, responses, ctx)
    return _plain_logits(model, prompt_ids, prompt_mask, rows, responses, ctx)


def _plain_logits(
    model: Any,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    rows: torch.Tensor,
    responses: torch.Tensor,
    ctx: Callable[[], Any],
) -> torch.Tensor:
    """One ``[prompt; response]`` row per completion, a 2D padding mask: (b, T, V)."""
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


def _kv_cache_logits(
    model: Any,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    rows: torch.Tensor,
    responses: torch.Tensor,
    ctx: Callable[[], Any],
) -> torch.Tensor:
    """The distinct prompts once into a KV cache gathered to the completions, then the responses:
    (b, T, V)."""
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


@dataclass(frozen=True)
class PackedRows:
    """Rows of prompts with their responses back to back, and where each response's logits are.

    ``keep`` last positions of every row reach the output layer (the prompt's last column, then every
    response slot); completion i's logits for its T tokens are kept position ``columns[i]`` of row
    ``row_of[i]``."""

    input_ids: torch.Tensor  # (R, W)
    position_ids: torch.Tensor  # (R, W)
    allowed: torch.Tensor  # (R, 1, W, W) bool: query q may attend to key k
    keep: int
    row_of: torch.Tensor  # (b,)
    columns: torch.Tensor  # (b, T)


def _group_slots(rows: torch.Tensor, share: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """The prompt of each packed row (R,), the row of each completion (b,), its slot within the row (b,),
    and the slots per row."""
    b = rows.numel()
    if not share:  # one completion per row
        return rows, torch.arange(b, device=rows.device), torch.zeros_like(rows), 1
    uniq, inverse, counts = torch.unique(rows, return_inverse=True, return_counts=True)  # (R,), (b,), (R,)
    order = torch.argsort(inverse, stable=True)  # completions grouped by row, in their order
    starts = counts.cumsum(0) - counts  # (R,) first position of each row's group in `order`
    slot = torch.empty_like(inverse)
    slot[order] = torch.arange(b, device=rows.device) - starts[inverse[order]]
    return uniq, inverse, slot, int(counts.max())


def _block_mask(valid: torch.Tensor, segment: torch.Tensor) -> torch.Tensor:
    """(R, 1, W, W) bool from the real tokens (R, W) and each column's segment (R, W): 0 the prompt,
    j + 1 response slot j. A query sees earlier real keys of the prompt or of its own segment. A padding
    query sees itself only: a row with nothing to attend to would be NaN in the softmax, and a NaN's
    gradient poisons the weights even where its logits are never read."""
    w = valid.size(1)
    causal = torch.ones(w, w, dtype=torch.bool, device=valid.device).tril()  # (W, W) key <= query
    q_seg, k_seg = segment[:, :, None], segment[:, None, :]  # (R, W, 1), (R, 1, W)
    same = (k_seg == 0) | (k_seg == q_seg)  # (R, W, W)
    allowed = causal & same & valid[:, None, :] & valid[:, :, None]
    eye = torch.eye(w, dtype=torch.bool, device=valid.device)
    allowed |= eye & ~valid[:, :, None]
    return allowed[:, None]  # (R, 1, W, W)


def pack_rows(
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    rows: torch.Tensor,
    responses: torch.Tensor,
    *,
    share: bool,
    width_multiple: int = 1,
) -> PackedRows:
    """Pack prompts (P, L) and responses (b, T) into rows: per distinct prompt of ``rows`` when ``share``,
    else per completion. A row is ``[pad; prompt (left padding kept, masked); slot 0; slot 1; ...]``, slot j
    holding a response but its last token (T - 1 positions: the last token predicts nothing needed); the
    rows are left-padded to a multiple of ``width_multiple`` columns."""
    row_prompt, row_of, slot, slots = _group_slots(rows, share)
    r, length = row_prompt.numel(), prompt_ids.size(1)
    t = responses.size(1)
    body = t - 1  # the tokens of a response that predict a next one
    used = length + slots * body
    width = -(-used // width_multiple) * width_multiple
    pad = width - used
    device = prompt_ids.device
    p_mask = prompt_mask[row_prompt].bool()  # (R, L)
    ids = prompt_ids.new_zeros(r, width)  # padding's token id is never seen (masked)
    ids[:, pad : pad + length] = prompt_ids[row_prompt]
    valid = torch.zeros(r, width, dtype=torch.bool, device=device)
    valid[:, pad : pad + length] = p_mask
    segment = torch.zeros(r, width, dtype=torch.long, device=device)  # 0: prompt or padding
    positions = torch.zeros(r, width, dtype=torch.long, device=device)
    # real prompt tokens count from 0 whatever the left padding, as in a plain row
    positions[:, pad : pad + length] = (p_mask.cumsum(-1) - 1).clamp(min=0)
    steps = torch.arange(body, device=device)  # (T-1,)
    if body:
        cols = pad + length + slot[:, None] * body + steps  # (b, T-1) columns of each response
        at = (row_of[:, None], cols)
        ids[at] = responses[:, :-1]
        valid[at] = True
        segment[at] = slot[:, None] + 1
        # response token t sits at position prompt_len + t, right after its prompt, in every slot
        positions[at] = p_mask.sum(-1)[row_of][:, None] + steps
    # Kept positions: 0 is the prompt's last column (predicts response token 0 of every slot), then the
    # slots; response token t >= 1 is predicted by the slot's token t - 1.
    first = torch.zeros_like(slot)[:, None]  # (b, 1)
    columns = torch.cat([first, 1 + slot[:, None] * body + steps], dim=1)  # (b, T)
    return PackedRows(ids, positions, _block_mask(valid, segment), 1 + slots * body, row_of, columns)


def _output_layer(model: Any) -> torch.nn.Module | None:
    """The module that turns hidden states into logits, also through a wrapper; None if the model has
    no such accessor."""
    get = getattr(getattr(model, "module", model), "get_output_embeddings", None)
    head = get() if callable(get) else None
    return head if isinstance(head, torch.nn.Module) else None


def packed_logits(model: Any, packed: PackedRows, ctx: Callable[[], Any]) -> torch.Tensor:
    """Run packed rows through ``model`` in one call: (b, T, V).

    The output layer is the costly part of a forward with a real vocabulary: a pre-hook on it gathers
    the hidden states of exactly the (b, T) positions whose logits are needed (the prompt's last position
    once for each response), so it computes and stores (b, T, V) and no slot padding or duplicate copy.
    Through the model's own call, so DDP, DeepSpeed and PEFT wrappers see an ordinary forward."""
    kind = BLOCK_MASK_ATTENTION[model_config(model)._attn_implementation]
    mask: torch.Tensor = packed.allowed
    if kind == "additive":
        # fp32 minimum: added to scores of any dtype it promotes them to fp32 and stays finite
        mask = torch.zeros(mask.shape, device=mask.device).masked_fill(~mask, torch.finfo(torch.float32).min)
    head = _output_layer(model)
    index = (packed.row_of[:, None], packed.columns)  # (b, T) each

    def gather(_module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return (args[0][index], *args[1:])  # (R, keep, H) -> (b, T, H)

    handle = head.register_forward_pre_hook(gather) if head is not None else None
    try:
        with ctx():
            logits = model(
                input_ids=packed.input_ids,
                attention_mask=mask,
                position_ids=packed.position_ids,
                use_cache=False,
                logits_to_keep=packed.keep,
            ).logits
    finally:
        if handle is not None:
            handle.remove()
    if head is None:
        logits = logits[index]  # (R, keep, V) -> (b, T, V)
    if logits.shape[:2] != packed.columns.shape:
        raise RuntimeError(
            f"packed forward returned logits of shape {tuple(logits.shape)}, expected (b, T) = "
            f"{tuple(packed.columns.shape)} first: the model's forward did not call its output layer once"
        )
    return logits  # (b, T, V)
