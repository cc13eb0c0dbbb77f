"""Per-token KL estimators between the policy and the reference model (Schulman's k1 / k2 / k3)."""

from __future__ import annotations

import torch
from torch import Tensor

from .choices import KL_ESTIMATORS
from .masking import masked_sum

__all__ = ["KL_ESTIMATORS", "per_token_kl", "sequence_kl"]


def per_token_kl(logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor, estimator: str = "k1") -> Tensor:
    """Per-token estimate of KL(policy || ref) from the sampled tokens' log-probs.

    - ``k1``: ``logp - ref_logp`` (the reference trainer's; unbiased, can be negative per token).
    - ``k2``: ``0.5 * (logp - ref_logp)**2``: biased, always >= 0, low variance; as a loss term its
      gradient ``(logp - ref_logp) * grad logp`` is the one of KL(policy || ref) (k1's is 0 in expectation).
    - ``k3``: ``exp(ref_logp - logp) - 1 - (ref_logp - logp)``: unbiased, always >= 0, lower variance.

    Args:
        logprobs: (B, T) policy log-probs of the sampled tokens.
        ref_logprobs: (B, T) reference-model log-probs of the same tokens.
        mask: (B, T) bool, True on completion tokens.
        estimator: "k1", "k2" or "k3".

    Differentiable w.r.t. ``logprobs`` (and ``ref_logprobs``), so the result can be a loss term.

    Returns:
        (B, T), exactly 0 where ``mask`` is False whatever the inputs hold there.
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"estimator must be one of {KL_ESTIMATORS} (got {estimator!r}); pick one of those")
    if logprobs.shape != ref_logprobs.shape or mask.shape != logprobs.shape:
        raise ValueError(
            f"logprobs {tuple(logprobs.shape)}, ref_logprobs {tuple(ref_logprobs.shape)} and mask "
            f"{tuple(mask.shape)} must have the same (B, T) shape; align them"
        )
    if mask.dtype != torch.bool:
        raise ValueError(f"mask must be a bool tensor (got {mask.dtype}); pass mask.bool()")
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    # Sanitise before any arithmetic: exp(inf) or inf - inf at padding would give NaN values/gradients.
    log_ratio = torch.where(mask, logprobs - ref_logprobs, zero)  # (B, T)
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2  # (B, T), 0 at padding since log_ratio is
    neg = -log_ratio  # (B, T) = ref_logp - logp
    return torch.where(mask, torch.expm1(neg) - neg, zero)  # (B, T)


def sequence_kl(kl: Tensor, mask: Tensor) -> Tensor:
    """Per-sequence KL: masked sum of the per-token KL over the completion.

    Args:
        kl: (B, T) per-token KL.
        mask: (B, T) bool.

    Returns:
        (B,)
    """
    return masked_sum(kl, mask, dim=-1)
