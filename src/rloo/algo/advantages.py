"""REINFORCE Leave-One-Out (RLOO) advantages over groups of completions of the same prompt.

Layout: (P, K) = (prompts, completions per prompt), prompt-major. A trainer holding the classic
sample-major flat batch ``[p0..pP-1, p0..pP-1, ...]`` gets (P, K) with ``r.view(K, P).T``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .choices import SCALE_REWARDS_MODES
from .masking import masked_var

__all__ = [
    "SCALE_REWARDS_MODES",
    "group_reward_stats",
    "informative_groups",
    "leave_one_out_advantages",
    "leave_one_out_baseline",
    "scale_advantages",
]


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


def _group_std(rewards: Tensor, valid: Tensor) -> Tensor:
    """Unbiased std of each group's valid rewards, (P,); 0 (not torch.std's NaN) with under two members."""
    r = torch.where(valid, rewards, torch.zeros_like(rewards))  # (P, K)
    n = valid.sum(dim=1).to(r.dtype)  # (P,)
    mean = r.sum(dim=1) / n.clamp(min=1)  # (P,)
    sq = torch.where(valid, (r - mean.unsqueeze(1)) ** 2, torch.zeros_like(r)).sum(dim=1)  # (P,)
    # n < 2 gives sq == 0, so such groups get std 0 rather than torch.std's NaN.
    return torch.sqrt(sq / (n - 1).clamp(min=1))  # (P,)


def _zero_std(std: Tensor) -> Tensor:
    """(P,) bool: the groups whose std counts as 0 (no spread, hence no learning signal)."""
    return torch.isclose(std, torch.zeros_like(std))


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
        std, and the fraction of groups whose std ``torch.isclose`` to 0 (the groups that
        :func:`informative_groups` flags False).
    """
    valid = _check_groups(rewards, valid)
    if rewards.shape[0] == 0:
        zero = rewards.new_zeros(())
        return zero, zero.clone()
    std = _group_std(rewards, valid)  # (P,)
    return std.mean(), _zero_std(std).to(std.dtype).mean()


def informative_groups(rewards: Tensor, valid: Tensor | None = None) -> Tensor:
    """Which groups carry a learning signal: their valid rewards are not all (close to) equal.

    A group is informative when it has at least two valid members and its unbiased reward std is not
    ``torch.isclose`` to 0. This is exactly the complement of the groups counted by
    :func:`group_reward_stats`' ``frac_reward_zero_std`` (DAPO's dynamic sampling keeps these groups).

    Args:
        rewards: (P, K) rewards; entries where ``valid`` is False may be NaN.
        valid: (P, K) bool; default all True.

    Returns:
        (P,) bool, True for informative groups.
    """
    valid = _check_groups(rewards, valid)
    # Fewer than two valid members gives std 0 in _group_std, so _zero_std already covers them.
    return ~_zero_std(_group_std(rewards, valid))  # (P,)


def scale_advantages(
    advantages: Tensor, rewards: Tensor, valid: Tensor | None, mode: str, eps: float = 1e-4
) -> Tensor:
    """Divide advantages by a reward std (TRL GRPO's ``scale_rewards``).

    - ``none``: no scaling (Dr. GRPO): ``advantages`` is returned as is.
    - ``group``: each group's advantages divided by the unbiased std of that group's valid rewards,
      plus ``eps``. A group with fewer than two valid members has no std; its advantages become 0 (they
      are 0 already for leave-one-out advantages, and dividing by ``eps`` alone would blow them up).
    - ``batch``: every advantage divided by the unbiased std of all valid rewards of ``rewards``, plus
      ``eps``. Pass the whole (gathered) batch: a rank's or micro-batch's slice has its own std.

    Args:
        advantages: (P, K) advantages (e.g. :func:`leave_one_out_advantages`); entries where ``valid`` is
            False may be anything.
        rewards: (P, K) the rewards the advantages come from; entries where ``valid`` is False may be NaN.
        valid: (P, K) bool; None means all True.
        mode: one of ``SCALE_REWARDS_MODES``.
        eps: added to the std, > 0 (TRL's 1e-4), so a constant group's zero advantages stay 0.

    Returns:
        (P, K) scaled advantages, exactly 0 where ``valid`` is False, never NaN for finite valid inputs.
    """
    if mode not in SCALE_REWARDS_MODES:
        raise ValueError(f"mode must be one of {SCALE_REWARDS_MODES} (got {mode!r}); pick one")
    if not eps > 0:
        raise ValueError(f"eps must be > 0 (got {eps}); use e.g. 1e-4")
    valid = _check_groups(rewards, valid)
    if advantages.shape != rewards.shape:
        raise ValueError(
            f"advantages shape {tuple(advantages.shape)} must equal rewards shape {tuple(rewards.shape)}; "
            "pass both as (prompts, completions per prompt)"
        )
    if mode == "none":
        return advantages
    zero = torch.zeros((), dtype=advantages.dtype, device=advantages.device)
    if mode == "group":
        std = _group_std(rewards, valid).to(advantages.dtype).unsqueeze(1)  # (P, 1)
        keep = valid & (valid.sum(dim=1, keepdim=True) >= 2)  # (P, K)
    else:
        r = torch.where(valid, rewards, torch.zeros_like(rewards))  # (P, K), NaN-free
        std = masked_var(r, valid, unbiased=True).sqrt().to(advantages.dtype)  # 0-dim
        keep = valid
    # where() on both sides: garbage at invalid entries must not reach the result.
    a = torch.where(keep, advantages, zero)  # (P, K)
    return torch.where(keep, a / (std + eps), zero)  # (P, K)
