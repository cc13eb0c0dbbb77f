"""The RLOO policy loss: PPO-clipped REINFORCE with a sequence-level (or per-token) importance ratio."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .masking import masked_mean, masked_sum, masked_var

__all__ = ["PolicyLossStats", "policy_loss"]


@dataclass
class PolicyLossStats:
    """Diagnostics of one :func:`policy_loss` call; every field is a detached 0-dim tensor.

    Computed over sequences (sequence-level advantages) or over unmasked tokens (token-level).

    Attributes:
        clipfrac: fraction where the clipped surrogate was the active (larger) loss.
        approxkl: mean of ``0.5 * logratio**2``.
        ratio_mean: mean importance ratio.
        ratio_var: unbiased variance of the ratio (0 with fewer than two entries).
        clip_low_frac: fraction with ``ratio < 1 - cliprange`` and ``A < 0`` (clipped at the low bound).
        clip_high_frac: fraction with ``ratio > 1 + cliprange`` and ``A > 0`` (clipped at the high bound).
        ratio_min: smallest ratio (1 when there is no entry).
        ratio_max: largest ratio (1 when there is no entry).
    """

    clipfrac: Tensor
    approxkl: Tensor
    ratio_mean: Tensor
    ratio_var: Tensor
    clip_low_frac: Tensor
    clip_high_frac: Tensor
    ratio_min: Tensor
    ratio_max: Tensor


def _clipped_surrogate(ratio: Tensor, advantages: Tensor, cliprange: float) -> tuple[Tensor, Tensor, Tensor]:
    """Return ``(loss, clipped, unclipped)`` elementwise: ``max(-A*r, -A*clip(r))`` and its two parts."""
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    return torch.maximum(unclipped, clipped), clipped, unclipped


def _stats(
    logratio: Tensor,
    ratio: Tensor,
    advantages: Tensor,
    clipped: Tensor,
    unclipped: Tensor,
    mask: Tensor,
    c: float,
) -> PolicyLossStats:
    """Stats over the True entries of ``mask`` (sequences or tokens); all inputs share its shape."""
    with torch.no_grad():
        one = torch.ones((), dtype=ratio.dtype, device=ratio.device)
        inf = torch.full((), math.inf, dtype=ratio.dtype, device=ratio.device)
        any_entry = mask.any()
        ratio_min = torch.where(mask, ratio, inf).min() if mask.numel() else inf
        ratio_max = torch.where(mask, ratio, -inf).max() if mask.numel() else -inf
        low = (ratio < 1.0 - c) & (advantages < 0)
        high = (ratio > 1.0 + c) & (advantages > 0)
        return PolicyLossStats(
            clipfrac=masked_mean((clipped > unclipped).to(ratio.dtype), mask),
            approxkl=masked_mean(0.5 * logratio**2, mask),
            ratio_mean=masked_mean(ratio, mask),
            ratio_var=masked_var(ratio, mask, unbiased=True),
            clip_low_frac=masked_mean(low.to(ratio.dtype), mask),
            clip_high_frac=masked_mean(high.to(ratio.dtype), mask),
            ratio_min=torch.where(any_entry, ratio_min, one),
            ratio_max=torch.where(any_entry, ratio_max, one),
        )


def policy_loss(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, cliprange: float
) -> tuple[Tensor, PolicyLossStats]:
    """PPO-clipped RLOO policy loss.

    Sequence level (``advantages`` (B,), the reference's): ``logratio = sum_t new - sum_t old`` over
    the completion tokens, ``ratio = exp(logratio)``, loss ``= mean_b max(-A*ratio, -A*clip(ratio,
    1-c, 1+c))``.

    Token level (``advantages`` (B, T), for per-token KL advantages): per-token ratio
    ``exp(new_t - old_t)`` and clipped surrogate, summed over each sequence's completion tokens and
    averaged over sequences. At ratio 1 with a constant per-token advantage its gradient equals the
    sequence-level one.

    Positions where ``mask`` is False never influence the loss, its gradient or the stats, whatever
    ``logprobs`` / ``old_logprobs`` / ``advantages`` hold there.

    Args:
        logprobs: (B, T) current policy log-probs of the sampled tokens (with grad).
        old_logprobs: (B, T) log-probs under the policy that sampled them (no grad needed).
        advantages: (B,) sequence-level or (B, T) token-level advantages.
        mask: (B, T) bool completion mask.
        cliprange: PPO clip range ``c >= 0``.

    Returns:
        ``(loss, stats)``: 0-dim loss and :class:`PolicyLossStats` (over sequences for sequence-level,
        over unmasked tokens for token-level).
    """
    if not (cliprange >= 0 and math.isfinite(cliprange)):
        raise ValueError(f"cliprange must be a finite number >= 0 (got {cliprange}); use e.g. 0.2")
    if logprobs.dim() != 2 or old_logprobs.shape != logprobs.shape or mask.shape != logprobs.shape:
        raise ValueError(
            f"logprobs {tuple(logprobs.shape)}, old_logprobs {tuple(old_logprobs.shape)} and mask "
            f"{tuple(mask.shape)} must share one (B, T) shape; align them"
        )
    if mask.dtype != torch.bool:
        raise ValueError(f"mask must be a bool tensor (got {mask.dtype}); pass mask.bool()")
    old_logprobs = old_logprobs.detach()
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)

    if advantages.shape == logprobs.shape[:1]:
        advantages = advantages.detach().to(logprobs.dtype)
        # Sequence-level: one ratio per completion, as in the reference trainer.
        logratio = masked_sum(logprobs, mask, dim=1) - masked_sum(old_logprobs, mask, dim=1)  # (B,)
        ratio = torch.exp(logratio)  # (B,)
        losses, clipped, unclipped = _clipped_surrogate(ratio, advantages, cliprange)  # (B,) each
        loss = losses.mean()
        seq_mask = torch.ones_like(ratio, dtype=torch.bool)  # (B,)
        stats = _stats(logratio, ratio, advantages, clipped, unclipped, seq_mask, cliprange)
        return loss, stats

    if advantages.shape == logprobs.shape:
        advantages = torch.where(mask, advantages.detach().to(logprobs.dtype), zero)  # (B, T)
        # where() before exp(): garbage at padding must yield neither inf values nor NaN gradients.
        logratio = torch.where(mask, logprobs - old_logprobs, zero)  # (B, T)
        ratio = torch.exp(logratio)  # (B, T)
        losses, clipped, unclipped = _clipped_surrogate(ratio, advantages, cliprange)  # (B, T) each
        loss = masked_sum(losses, mask, dim=1).mean()
        stats = _stats(logratio, ratio, advantages, clipped, unclipped, mask, cliprange)
        return loss, stats

    raise ValueError(
        f"advantages must have shape (B,) = {tuple(logprobs.shape[:1])} or (B, T) = {tuple(logprobs.shape)} "
        f"(got {tuple(advantages.shape)}); pass sequence- or token-level advantages"
    )
