"""Truncated importance sampling (TIS) for the mismatch between the sampler (vLLM) and the trainer.

A rollout sampled by an inference engine comes from the engine's numerics, not exactly from the policy the
trainer computes: kernels, precision and batch composition differ. The policy-gradient estimate is
corrected by weighting each surrogate with ``pi_train / pi_sampler``, truncated from above at ``cap`` to
bound its variance (Yao et al., "Your efficient RL framework secretly brings you off-policy RL training",
2025; TRL's ``vllm_importance_sampling_correction``). Instead of truncating, ``mode="mask"`` drops the
samples whose ratio exceeds the cap (TRL's ``token_mask`` / ``sequence_mask``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .choices import IS_MODES
from .masking import masked_mean, masked_sum

__all__ = ["IS_MODES", "SamplingMismatchStats", "off_policy_sequence_mask", "truncated_importance_weights"]


@dataclass
class SamplingMismatchStats:
    """How far the sampler's log-probs are from the trainer's; detached 0-dim tensors.

    Attributes:
        logp_diff_abs_mean: mean over completion tokens of ``|train_logp - sampler_logp|``.
        capped_frac: fraction of the weights (tokens or sequences) that the cap truncated (0 with
            ``mode="mask"``).
        masked_frac: fraction of the weights (tokens or sequences) set to 0 for exceeding the cap (0 with
            ``mode="truncate"``).
    """

    logp_diff_abs_mean: Tensor
    capped_frac: Tensor
    masked_frac: Tensor


def truncated_importance_weights(
    train_logprobs: Tensor,
    sampling_logprobs: Tensor,
    mask: Tensor,
    cap: float,
    *,
    per_sequence: bool = False,
    mode: str = "truncate",
) -> tuple[Tensor, SamplingMismatchStats]:
    """Weights ``min(pi_train / pi_sampler, cap)`` of the sampled tokens, as constants (no gradient).

    Per token: ``w_t = min(exp(train_t - sampler_t), cap)``. Per sequence (for the sequence-level ratio
    of the classic loss, where tokens have no surrogate of their own): ``w = min(exp(sum_t (train_t -
    sampler_t)), cap)``. With ``mode="mask"`` a ratio above ``cap`` gives weight 0 instead of ``cap``
    (the sample is dropped) and the others keep their raw ratio.

    Args:
        train_logprobs: (B, T) log-probs of the sampled tokens under the trainer's forward of the policy
            that sampled them ("old" log-probs).
        sampling_logprobs: (B, T) the sampler's log-probs of the same tokens.
        mask: (B, T) bool completion mask.
        cap: truncation bound, > 0 (TRL's default 2.0).
        per_sequence: one weight per sequence instead of one per token.
        mode: one of ``IS_MODES``: ``truncate`` (TRL's ``token_truncate`` / ``sequence_truncate``) or
            ``mask`` (``token_mask`` / ``sequence_mask``).

    Returns:
        ``(weights, stats)``: (B, T) weights, 1 where ``mask`` is False, or (B,) with ``per_sequence``;
        :class:`SamplingMismatchStats` (``capped_frac`` and ``masked_frac`` over tokens, or over
        sequences with ``per_sequence``).
    """
    if not cap > 0:
        raise ValueError(f"cap must be > 0 (got {cap}); use e.g. 2.0")
    if mode not in IS_MODES:
        raise ValueError(f"mode must be one of {IS_MODES} (got {mode!r}); pick one")
    if (
        train_logprobs.dim() != 2
        or sampling_logprobs.shape != train_logprobs.shape
        or mask.shape != (train_logprobs.shape)
    ):
        raise ValueError(
            f"train_logprobs {tuple(train_logprobs.shape)}, sampling_logprobs {tuple(sampling_logprobs.shape)} "
            f"and mask {tuple(mask.shape)} must share one (B, T) shape; align them"
        )
    if mask.dtype != torch.bool:
        raise ValueError(f"mask must be a bool tensor (got {mask.dtype}); pass mask.bool()")
    with torch.no_grad():
        zero = torch.zeros((), dtype=train_logprobs.dtype, device=train_logprobs.device)
        # where() before exp(): padding may hold -inf or garbage, which must not become inf or NaN.
        diff = torch.where(mask, train_logprobs - sampling_logprobs, zero)  # (B, T)
        logp_diff_abs_mean = masked_mean(diff.abs(), mask)
        log_w = masked_sum(diff, mask, dim=1) if per_sequence else diff  # (B,) or (B, T)
        raw = torch.exp(log_w)  # (B,) or (B, T); may overflow to inf, which the cap turns into cap (or 0)
        capped = raw > cap
        entries = torch.ones_like(capped) if per_sequence else mask
        over_frac = masked_mean(capped.to(diff.dtype), entries)
        if mode == "truncate":
            weights = raw.clamp(max=cap)
            capped_frac, masked_frac = over_frac, torch.zeros_like(over_frac)
        else:
            weights = torch.where(capped, torch.zeros_like(raw), raw)
            capped_frac, masked_frac = torch.zeros_like(over_frac), over_frac
        return weights, SamplingMismatchStats(
            logp_diff_abs_mean=logp_diff_abs_mean,
            capped_frac=capped_frac,
            masked_frac=masked_frac,
        )


def off_policy_sequence_mask(
    advantages: Tensor,
    logprobs: Tensor,
    sampling_logprobs: Tensor,
    mask: Tensor,
    threshold: float,
) -> Tensor:
    """DeepSeek-V3.2's off-policy sequence masking (TRL's ``off_policy_mask_threshold``): which sequences
    the loss keeps.

    A sequence is dropped when its advantage is negative and it has drifted off policy: the mean over its
    completion tokens of ``sampler_logp - logp`` (a per-token estimate of KL(pi_sampler || pi_theta)) is above
    ``threshold``. Positive-advantage sequences are always kept: pushing up a sample the policy has moved away
    from cannot destabilise it, pushing down one it no longer produces can.

    Args:
        advantages: (B,) sequence advantages, or (B, T) per token (the sign of a sequence with per-token advantages
            tokens is its mean over the completion).
        logprobs: (B, T) current policy log-probs of the sampled tokens (used without gradient).
        sampling_logprobs: (B, T) log-probs under whatever sampled them (vLLM's, else the old policy's).
        mask: (B, T) bool completion mask.
        threshold: the KL bound, > 0 (the paper's delta; TRL suggests e.g. 0.5).

    Returns:
        (B,) bool, True for the sequences to keep.
    """
    if not threshold > 0:
        raise ValueError(f"threshold must be > 0 (got {threshold}); use e.g. 0.5")
    if logprobs.dim() != 2 or sampling_logprobs.shape != logprobs.shape or mask.shape != logprobs.shape:
        raise ValueError(
            f"logprobs {tuple(logprobs.shape)}, sampling_logprobs {tuple(sampling_logprobs.shape)} and mask "
            f"{tuple(mask.shape)} must share one (B, T) shape; align them"
        )
    with torch.no_grad():
        zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
        # where(): padding's garbage (or NaN a sampler could not score) gives no evidence of drift
        drift = torch.where(mask, sampling_logprobs - logprobs, zero).nan_to_num(nan=0.0)  # (B, T)
        mean_drift = masked_mean(drift, mask, dim=1)  # (B,)
        if advantages.dim() == 2:
            advantages = masked_mean(torch.where(mask, advantages, zero), mask, dim=1)  # (B,)
        return (advantages >= 0) | (mean_drift <= threshold)  # (B,)
