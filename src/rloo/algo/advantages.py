"""REINFORCE Leave-One-Out (RLOO) advantages over groups of completions of the same prompt.

Layout: (P, K) = (prompts, completions per prompt), prompt-major. A trainer holding the classic
sample-major flat batch ``[p0..pP-1, p0..pP-1, ...]`` gets (P, K) with ``r.view(K, P).T``.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["group_reward_stats", "leave_one_out_advantages", "leave_one_out_baseline"]


def _check_groups(rewards: Tensor, valid: Tensor | None) -> Tensor:
    """Validate (P, K) rewards and return ``valid`` as a (P, K) bool tensor."""
    if rewards.dim() != 2:
        raise ValueError(
            f"rewards must have shape (P, K) (got {tuple(rewards.shape)}); reshape the flat batch to "
            "(prompts, completions per prompt)"
        )
    if not rewards.is_floating_point():
        raise ValueError(
            f"rewards must be a floating-point tensor (got {rewards.dtype}); pass rewards.float()"
        )
    if valid is None:
        return torch.ones_like(rewards, dtype=torch.bool)
    if valid.dtype != torch.bool:
        raise ValueError(f"valid must be a bool tensor (got {valid.dtype}); pass valid.bool()")
    if valid.shape != rewards.shape:
        raise ValueError(
            f"valid shape {tuple(valid.shape)} must equal rewards shape {tuple(rewards.shape)}; "
            "pass one flag per completion"
        )
    return valid


def leave_one_out_baseline(rewards: Tensor, valid: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Per-completion baseline: the mean reward of the other valid completions of the same prompt.

    Args:
        rewards: (P, K) rewards; entries where ``valid`` is False may be NaN.
        valid: (P, K) bool, True where the reward exists; default all True.

    Returns:
        ``(baseline, has_baseline)``, both (P, K). ``has_baseline`` is True for valid completions with at
        least one other valid completion in their group; ``baseline`` is 0 wherever it is False.
    """
    valid = _check_groups(rewards, valid)
    if rewards.shape[1] < 2:
        raise ValueError(
            f"leave-one-out needs K >= 2 completions per prompt (got K={rewards.shape[1]}); raise rloo_k"
        )
    r = torch.where(valid, rewards, torch.zeros_like(rewards))  # (P, K), NaN-free
    total = r.sum(dim=1, keepdim=True)  # (P, 1)
    n_others = valid.sum(dim=1, keepdim=True) - 1  # (P, 1) valid members besides a valid i
    has_baseline = valid & (n_others >= 1)  # (P, K)
    # For an invalid i, r_i is 0 so total - r_i still sums the others; has_baseline masks it anyway.
    baseline = (total - r) / n_others.clamp(min=1).to(r.dtype)  # (P, K)
    return torch.where(has_baseline, baseline, torch.zeros_like(baseline)), has_baseline


def leave_one_out_advantages(rewards: Tensor, valid: Tensor | None = None) -> Tensor:
    """RLOO advantage ``r_i - mean(r_j for valid j != i in the same group)``.

    With every completion valid this is the classic ``r - (r.sum(1) - r) / (K - 1)``.

    Args:
        rewards: (P, K) (rlhf) rewards; entries where ``valid`` is False may be NaN.
        valid: (P, K) bool, True where the reward exists; default all True.

    Returns:
        (P, K) advantages, never NaN. Exactly 0 for invalid completions (no gradient signal rather than
        a made-up reward) and for valid completions with no other valid member in their group (no
        baseline can be formed). Invalid completions never enter anyone's baseline.

    Raises:
        ValueError: K < 2, or a malformed ``rewards``/``valid``.
    """
    baseline, has_baseline = leave_one_out_baseline(rewards, valid)
    r = torch.where(has_baseline, rewards, torch.zeros_like(rewards))  # (P, K)
    return torch.where(has_baseline, r - baseline, torch.zeros_like(r))  # (P, K)


def group_reward_stats(rewards: Tensor, valid: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Spread of rewards within each prompt's group, for the ``reward_std`` / ``frac_reward_zero_std`` metrics.

    The per-group std is unbiased (as ``torch.std``) over the group's valid members. A group with fewer
    than two valid members has std 0 (it carries no learning signal: all its advantages are 0), so it
    lowers ``reward_std`` and counts as a zero-std group.

    Args:
        rewards: (P, K) rewards; entries where ``valid`` is False may be NaN.
        valid: (P, K) bool; default all True.

    Returns:
        ``(reward_std, frac_reward_zero_std)``: 0-dim tensors; the mean over the P groups of the per-group
        std, and the fraction of groups whose std ``torch.isclose`` to 0.
    """
    valid = _check_groups(rewards, valid)
    if rewards.shape[0] == 0:
        zero = rewards.new_zeros(())
        return zero, zero.clone()
    r = torch.where(valid, rewards, torch.zeros_like(rewards))  # (P, K)
    n = valid.sum(dim=1).to(r.dtype)  # (P,)
    mean = r.sum(dim=1) / n.clamp(min=1)  # (P,)
    sq = torch.where(valid, (r - mean.unsqueeze(1)) ** 2, torch.zeros_like(r)).sum(dim=1)  # (P,)
    # n < 2 gives sq == 0, so such groups get std 0 rather than torch.std's NaN.
    std = torch.sqrt(sq / (n - 1).clamp(min=1))  # (P,)
    zero_std = torch.isclose(std, torch.zeros_like(std))  # (P,)
    return std.mean(), zero_std.to(r.dtype).mean()
