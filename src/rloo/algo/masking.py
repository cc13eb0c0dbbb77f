"""Masked reductions and completion masks.

Every function here treats positions where ``mask`` is False as absent: they may hold garbage (NaN, inf)
and still never reach the result or the gradient. Masks are bool tensors.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "completion_mask",
    "first_true_index",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "truncate_after_stop",
    "truncated_completions",
]


def _check_mask(x: Tensor, mask: Tensor, name: str = "mask") -> Tensor:
    """Return ``mask`` expanded to ``x.shape``; raise ValueError if it is not bool or does not broadcast."""
    if mask.dtype != torch.bool:
        raise ValueError(f"{name} must be a bool tensor (got {mask.dtype}); pass {name}.bool()")
    try:
        return mask.expand_as(x)
    except RuntimeError:
        raise ValueError(
            f"{name} of shape {tuple(mask.shape)} does not broadcast to x of shape {tuple(x.shape)}; "
            "pass a mask with the same shape as x"
        ) from None


def _zero_masked(x: Tensor, mask: Tensor) -> Tensor:
    # torch.where (not x * mask): 0 * inf = NaN, and where() also sends zero gradient to masked entries.
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))


def masked_sum(x: Tensor, mask: Tensor, dim: int | tuple[int, ...] | None = None) -> Tensor:
    """Sum of ``x`` over the entries where ``mask`` is True.

    Args:
        x: (...) values; entries where ``mask`` is False may be anything, including NaN/inf.
        mask: bool, broadcastable to ``x.shape``.
        dim: dimension(s) to reduce; None reduces everything to a 0-dim tensor.

    Returns:
        ``x`` reduced over ``dim`` (0-dim when ``dim`` is None).
    """
    mask = _check_mask(x, mask)
    xs = _zero_masked(x, mask)
    return xs.sum() if dim is None else xs.sum(dim=dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | tuple[int, ...] | None = None) -> Tensor:
    """Mean of ``x`` over the entries where ``mask`` is True; 0 (not NaN) where there is none.

    Args:
        x: (...) values.
        mask: bool, broadcastable to ``x.shape``.
        dim: dimension(s) to reduce; None reduces everything to a 0-dim tensor.

    Returns:
        ``x`` reduced over ``dim``.
    """
    mask = _check_mask(x, mask)
    total = masked_sum(x, mask, dim)
    count = mask.sum() if dim is None else mask.sum(dim=dim)
    # clamp: an all-False slice has sum 0, so 0 / 1 = 0 rather than 0 / 0 = NaN.
    return total / count.clamp(min=1).to(total.dtype)


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of ``x`` over all entries where ``mask`` is True.

    Args:
        x: (...) values.
        mask: bool, broadcastable to ``x.shape``.
        unbiased: divide by ``n - 1`` (as ``torch.var``) instead of ``n``.

    Returns:
        0-dim tensor. 0 when there are too few entries (``n < 2`` unbiased, ``n < 1`` biased), where
        ``torch.var`` would give NaN.
    """
    mask = _check_mask(x, mask)
    xs = _zero_masked(x, mask)
    mean = masked_mean(xs, mask)
    sq = masked_sum((xs - mean) ** 2, mask)
    n = mask.sum()
    denom = n - 1 if unbiased else n
    var = sq / denom.clamp(min=1).to(sq.dtype)
    return torch.where(denom > 0, var, torch.zeros_like(var))


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """Standardise ``x`` with the mean and unbiased variance of its True entries.

    ``(x - mean) / sqrt(var + eps)``; with ``shift_mean=False`` the mean is added back (only the scale
    changes), as in TRL's ``masked_whiten``.

    Args:
        x: (...) values.
        mask: bool, broadcastable to ``x.shape``.
        shift_mean: whether the result is centred.
        eps: added to the variance.

    Returns:
        (...) same shape as ``x``, 0 where ``mask`` is False.
    """
    mask = _check_mask(x, mask)
    xs = _zero_masked(x, mask)
    mean = masked_mean(xs, mask)
    var = masked_var(xs, mask, unbiased=True)
    whitened = (xs - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return _zero_masked(whitened, mask)


def first_true_index(flags: Tensor) -> Tensor:
    """Index of the first True along the last dimension.

    Args:
        flags: (B, T) bool (any leading dims are allowed).

    Returns:
        (B,) long, ``T`` for rows with no True entry.
    """
    if flags.dtype != torch.bool:
        raise ValueError(f"flags must be a bool tensor (got {flags.dtype}); pass flags.bool()")
    t = flags.shape[-1]
    positions = torch.arange(t, device=flags.device).expand_as(flags)  # (B, T)
    sentinel = torch.full_like(positions, t)
    if t == 0:
        return sentinel.sum(-1)  # (B,) of zeros == T
    # min over "position if flagged else T" is the first flagged position, or T when none is.
    return torch.where(flags, positions, sentinel).min(dim=-1).values  # (B,)


def completion_mask(response_ids: Tensor, stop_token_id: int | None) -> Tensor:
    """Mask of the tokens that belong to each completion.

    Built from the position of the first stop token, never from pad ids: pad may equal eos, and a real
    eos inside the completion must stay in it.

    Args:
        response_ids: (B, T) token ids.
        stop_token_id: the stop (usually eos) token id, or None for "no stop token".

    Returns:
        (B, T) bool, True up to and including the first stop token; the whole row when
        ``stop_token_id`` is None or the row has no stop token.
    """
    if stop_token_id is None:
        return torch.ones_like(response_ids, dtype=torch.bool)
    stop_at = first_true_index(response_ids == stop_token_id)  # (B,)
    positions = torch.arange(response_ids.shape[-1], device=response_ids.device)  # (T,)
    # <= keeps the stop token itself; stop_at == T (no stop) keeps every position.
    return positions <= stop_at.unsqueeze(-1)  # (B, T)


def truncate_after_stop(response_ids: Tensor, stop_token_id: int, pad_token_id: int) -> Tensor:
    """Replace every token after the first stop token with ``pad_token_id``.

    Args:
        response_ids: (B, T) token ids.
        stop_token_id: the stop token id; it is kept.
        pad_token_id: id written after it.

    Returns:
        (B, T) new tensor; rows without a stop token are unchanged.
    """
    keep = completion_mask(response_ids, stop_token_id)  # (B, T)
    return torch.where(keep, response_ids, torch.full_like(response_ids, pad_token_id))


def truncated_completions(response_ids: Tensor, stop_token_id: int) -> Tensor:
    """Which completions hit the length limit without a stop token.

    Args:
        response_ids: (B, T) token ids (before or after :func:`truncate_after_stop`).
        stop_token_id: the stop (usually eos) token id.

    Returns:
        (B,) bool, True for rows with no ``stop_token_id`` at all.
    """
    return first_true_index(response_ids == stop_token_id) == response_ids.shape[-1]  # (B,)
