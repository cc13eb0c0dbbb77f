"""From raw reward-model / reward-function scores to the quantities RLOO optimises."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .advantages import leave_one_out_baseline
from .masking import _check_mask, masked_mean, masked_sum, masked_var

__all__ = [
    "apply_missing_eos_penalty",
    "combine_reward_sources",
    "normalize_advantages",
    "normalize_and_clip_scores",
    "normalize_reward_sources",
    "sequence_level_rewards",
    "soft_overlong_penalty",
    "token_level_advantages",
]


def _standardize(x: Tensor, mask: Tensor, eps: float) -> Tensor:
    """``(x - mean) / (std + eps)`` over the True entries of ``mask`` (unbiased std); 0 where False.

    std + eps (not sqrt(var + eps)) is the reference trainer's formula. A single entry has std 0 here
    (torch.std would give NaN), so it maps to 0.
    """
    mask = _check_mask(x, mask)
    xs = torch.where(mask, x, torch.zeros_like(x))
    mean = masked_mean(xs, mask)
    std = masked_var(xs, mask, unbiased=True).sqrt()
    return torch.where(mask, (xs - mean) / (std + eps), torch.zeros_like(xs))


def combine_reward_sources(per_source: Tensor, weights: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Weighted sum of several reward sources, skipping the ones that did not score a completion.

    Args:
        per_source: (B, S) scores; NaN means "this source returned None for this completion".
        weights: (S,) per-source weights; default all ones.

    Returns:
        ``(rewards, valid)``, both (B,): ``rewards = sum over non-NaN s of w_s * r_s`` (0 for rows with no
        score), ``valid`` True where at least one source scored the completion.
    """
    if per_source.dim() != 2:
        raise ValueError(
            f"per_source must have shape (B, S) (got {tuple(per_source.shape)}); stack one column per source"
        )
    if not per_source.is_floating_point():
        raise ValueError(
            f"per_source must be floating point (got {per_source.dtype}); pass per_source.float()"
        )
    n_sources = per_source.shape[1]
    if weights is None:
        weights = torch.ones(n_sources, dtype=per_source.dtype, device=per_source.device)
    elif weights.dim() != 1 or weights.shape[0] != n_sources:
        raise ValueError(
            f"weights must have one entry per reward source ({n_sources}), got shape {tuple(weights.shape)}; "
            "give exactly one weight per reward function"
        )
    present = ~torch.isnan(per_source)  # (B, S)
    scores = torch.where(present, per_source, torch.zeros_like(per_source))  # (B, S)
    rewards = (scores * weights.to(scores)).sum(dim=1)  # (B,)
    return rewards, present.any(dim=1)


def normalize_reward_sources(per_source: Tensor, k: int, eps: float = 1e-4) -> Tensor:
    """Each reward source's scores standardised within its prompt's group, before any weighted sum (GDPO,
    TRL's ``multi_objective_aggregation="normalize_then_sum"``): a source on a large scale no longer drowns a
    0/1 one, and a source that does not tell a group's completions apart adds nothing to their advantages.

    ``(r - mean) / (std + eps)`` over the completions of the group the source scored (unbiased std, 0 with
    under two), so a constant source becomes 0 and a single scored completion 0.

    Args:
        per_source: (B, S) scores, prompt-major (flat index ``p * k + j``); NaN where a source did not score.
        k: completions per prompt, >= 1, dividing B.
        eps: added to the std, > 0 (TRL's 1e-4).

    Returns:
        (B, S), NaN exactly where ``per_source`` is.
    """
    if per_source.dim() != 2 or not per_source.is_floating_point():
        raise ValueError(
            f"per_source must be a floating-point (B, S) tensor (got {per_source.dtype} "
            f"{tuple(per_source.shape)}); stack one column per source"
        )
    if k < 1 or per_source.shape[0] % k:
        raise ValueError(f"k must be >= 1 and divide B = {per_source.shape[0]} (got k={k}); pass rloo_k")
    if not eps > 0:
        raise ValueError(f"eps must be > 0 (got {eps}); use e.g. 1e-4")
    b, n_sources = per_source.shape
    grouped = per_source.view(b // k, k, n_sources)  # (P, K, S)
    present = ~grouped.isnan()  # (P, K, S)
    r = torch.where(present, grouped, torch.zeros_like(grouped))  # (P, K, S), NaN-free
    n = present.sum(dim=1, keepdim=True).to(r.dtype)  # (P, 1, S)
    mean = r.sum(dim=1, keepdim=True) / n.clamp(min=1)  # (P, 1, S)
    sq = torch.where(present, (r - mean) ** 2, torch.zeros_like(r)).sum(dim=1, keepdim=True)  # (P, 1, S)
    std = torch.sqrt(sq / (n - 1).clamp(min=1))  # (P, 1, S), 0 with under two scored
    normed = (r - mean) / (std + eps)  # (P, K, S)
    return torch.where(present, normed, torch.full_like(normed, math.nan)).view(b, n_sources)  # (B, S)


def apply_missing_eos_penalty(scores: Tensor, contains_eos: Tensor, penalty: float | None) -> Tensor:
    """Subtract ``penalty`` from the score of every completion that never emitted EOS.

    Args:
        scores: (B,) scores.
        contains_eos: (B,) bool, True where the completion contains an EOS token.
        penalty: amount subtracted; None leaves the scores unchanged.

    Returns:
        (B,) new tensor (a copy even when ``penalty`` is None).
    """
    if contains_eos.shape != scores.shape:
        raise ValueError(
            f"contains_eos shape {tuple(contains_eos.shape)} must equal scores shape {tuple(scores.shape)}; "
            "pass one flag per completion"
        )
    if penalty is None:
        return scores.clone()
    return torch.where(contains_eos.bool(), scores, scores - penalty)


def normalize_and_clip_scores(
    scores: Tensor, clip_range: float, valid: Tensor | None = None, eps: float = 1e-8
) -> Tensor:
    """Standardise scores over the batch, then clamp to ``[-clip_range, clip_range]``.

    The reference's ``normalize_reward`` + ``reward_clip_range``: ``(s - mean) / (std + eps)`` with the
    unbiased std, both over the valid entries only.

    Args:
        scores: (B,) scores; entries where ``valid`` is False may be NaN.
        clip_range: positive clamp bound.
        valid: (B,) bool; default all True.
        eps: added to the std.

    Returns:
        (B,) normalised scores, 0 where ``valid`` is False.
    """
    if not clip_range > 0:
        raise ValueError(f"clip_range must be > 0 (got {clip_range}); pass a positive reward clip range")
    if valid is None:
        valid = torch.ones_like(scores, dtype=torch.bool)
    return _standardize(scores, valid, eps).clamp(-clip_range, clip_range)


def sequence_level_rewards(scores: Tensor, kl: Tensor, mask: Tensor, kl_coef: float) -> tuple[Tensor, Tensor]:
    """The reference's default reward: score minus ``kl_coef`` times the sequence's summed KL.

    Args:
        scores: (B,) scores.
        kl: (B, T) per-token KL.
        mask: (B, T) bool completion mask.
        kl_coef: KL penalty coefficient.

    Returns:
        ``(rlhf_reward, non_score_reward)``, both (B,): ``non_score_reward = -kl_coef * sum_t kl``,
        ``rlhf_reward = scores + non_score_reward``.
    """
    if kl.dim() != 2 or kl.shape[0] != scores.shape[0] or scores.dim() != 1:
        raise ValueError(
            f"scores must be (B,) and kl (B, T) (got {tuple(scores.shape)} and {tuple(kl.shape)}); align them"
        )
    non_score_reward = -kl_coef * masked_sum(kl, mask, dim=1)  # (B,)
    return scores + non_score_reward, non_score_reward


def token_level_advantages(
    scores: Tensor, kl: Tensor, mask: Tensor, kl_coef: float, valid: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Per-token RLOO advantages with a real per-token KL penalty (REINFORCE++ eq. 1).

    Per-token reward ``r_t = -kl_coef * kl_t``, plus the score on the last completion token; return to go
    ``G_t = sum_{s >= t} r_s = score - kl_coef * sum_{s >= t} kl_s``. The baseline of completion i is the
    leave-one-out mean of the other valid completions' full returns ``G_{j,0}`` (their sequence-level
    rlhf rewards), so ``A_{i,t} = G_{i,t} - b_i``. At the first token this is the sequence-level RLOO
    advantage; later tokens are charged only the KL that follows them, i.e.
    ``A_{i,t} = A_i^seq + kl_coef * sum_{s < t} kl_{i,s}``.

    Args:
        scores: (P, K) scores; entries where ``valid`` is False may be NaN.
        kl: (P, K, T) per-token KL (anything where ``mask`` is False).
        mask: (P, K, T) bool completion mask.
        kl_coef: KL penalty coefficient.
        valid: (P, K) bool, True where the score exists; default all True.

    Returns:
        ``(advantages, non_score_reward)``: (P, K, T) advantages, 0 where ``mask`` is False, for invalid
        completions and for completions whose group has no other valid member; (P, K)
        ``non_score_reward = -kl_coef * sum_t kl``.
    """
    if scores.dim() != 2 or kl.dim() != 3 or kl.shape[:2] != scores.shape:
        raise ValueError(
            f"scores must be (P, K) and kl (P, K, T) (got {tuple(scores.shape)} and {tuple(kl.shape)}); "
            "reshape both to prompt-major groups"
        )
    mask = _check_mask(kl, mask)
    kl = torch.where(mask, kl, torch.zeros_like(kl))  # (P, K, T)
    non_score_reward = -kl_coef * kl.sum(dim=-1)  # (P, K)
    if valid is None:
        valid = torch.ones_like(scores, dtype=torch.bool)
    elif valid.dtype != torch.bool or valid.shape != scores.shape:
        raise ValueError(
            f"valid must be a bool tensor shaped like scores {tuple(scores.shape)} "
            f"(got {valid.dtype} {tuple(valid.shape)}); pass one bool flag per completion"
        )
    safe_scores = torch.where(valid, scores, torch.zeros_like(scores))  # (P, K), NaN-free
    baseline, has_baseline = leave_one_out_baseline(safe_scores + non_score_reward, valid)  # (P, K) each
    kl_before = kl.cumsum(dim=-1) - kl  # (P, K, T) KL of the tokens strictly before t
    # G_t = score + non_score + kl_coef * kl_before: the return drops the KL already paid before t.
    returns = (safe_scores + non_score_reward).unsqueeze(-1) + kl_coef * kl_before  # (P, K, T)
    advantages = returns - baseline.unsqueeze(-1)  # (P, K, T)
    keep = mask & has_baseline.unsqueeze(-1)  # (P, K, T)
    return torch.where(keep, advantages, torch.zeros_like(advantages)), non_score_reward


def normalize_advantages(advantages: Tensor, mask: Tensor | None = None, eps: float = 1e-8) -> Tensor:
    """Standardise advantages over the whole batch: ``(A - mean) / (std + eps)``, unbiased std.

    Args:
        advantages: (B,) sequence-level or (B, T) token-level advantages.
        mask: bool with the shape of ``advantages``: (B,) e.g. valid completions, or (B, T) completion
            tokens; default all True.
        eps: added to the std (the reference's 1e-8).

    Returns:
        Same shape as ``advantages``, 0 where ``mask`` is False.
    """
    if mask is None:
        mask = torch.ones_like(advantages, dtype=torch.bool)
    elif mask.shape != advantages.shape:
        raise ValueError(
            f"mask shape {tuple(mask.shape)} must equal advantages shape {tuple(advantages.shape)}; "
            "pass a (B,) mask for sequence-level or a (B, T) mask for token-level advantages"
        )
    return _standardize(advantages, mask, eps)


def soft_overlong_penalty(
    lengths: Tensor, max_length: int, buffer_length: int, factor: float = 1.0
) -> Tensor:
    """DAPO's soft overlong punishment (eq. 13; TRL's ``get_soft_overlong_punishment``) times ``factor``.

    With ``start = max_length - buffer_length``: 0 for ``length <= start``; the linear ramp
    ``(start - length) / buffer_length * factor`` for ``start < length <= max_length`` (reaching
    ``-factor`` at ``max_length``); ``-factor`` beyond. ``buffer_length`` 0 gives no penalty at all (TRL
    would give -1 to a length over ``max_length``, which a generation capped at ``max_length`` never has).

    Args:
        lengths: (B,) completion lengths in tokens (integer or floating).
        max_length: the generation's maximum completion length, ``L_max``.
        buffer_length: the punishment interval ``L_cache``, ``0 <= buffer_length <= max_length``.
        factor: the penalty at and beyond ``max_length`` is ``-factor``.

    Returns:
        (B,) penalties, to add to the rewards: dtype of ``lengths`` if floating, else the default float.
    """
    if not 0 <= buffer_length <= max_length:
        raise ValueError(
            f"buffer_length must be in [0, max_length = {max_length}] (got {buffer_length}); "
            "pass the tokens before max_length where the penalty ramps up"
        )
    dtype = lengths.dtype if lengths.is_floating_point() else torch.get_default_dtype()
    length = lengths.to(dtype)  # (B,)
    if buffer_length == 0:
        return torch.zeros_like(length)
    start = max_length - buffer_length
    # (start - length) / buffer is >= 0 before the buffer, in [-1, 0) inside it, < -1 past max_length.
    return ((start - length) / buffer_length).clamp(min=-1.0, max=0.0) * factor  # (B,)
