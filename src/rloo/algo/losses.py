"""The RLOO policy loss: PPO-clipped REINFORCE with a sequence-level (or per-token) importance ratio.

Loss aggregation follows verl's ``loss_agg_mode`` names (see :func:`agg_loss`); the default,
``seq-mean-token-sum``, is the classic RLOO loss. Optional variants: GSPO's length-normalised sequence
ratio (``importance_sampling_level="sequence"``), dual-clip PPO (``clip_ratio_c``), TRL's two-sided
GRPO cap (``delta``) and other surrogates than PPO's clip (``loss_type``: CISPO, SAPO, GMPO).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .choices import IMPORTANCE_SAMPLING_LEVELS, LOSS_AGG_MODES, LOSS_TYPES
from .kl import per_token_kl
from .masking import masked_mean, masked_sum, masked_var

__all__ = [
    "IMPORTANCE_SAMPLING_LEVELS",
    "LOSS_AGG_MODES",
    "LOSS_TYPES",
    "PolicyLossStats",
    "agg_loss",
    "kl_loss",
    "policy_loss",
]


def agg_loss(
    loss_mat: Tensor,
    mask: Tensor,
    loss_agg_mode: str,
    max_response_length: int | None = None,
    num_tokens: float | Tensor | None = None,
) -> Tensor:
    """Reduce per-token losses to one scalar, verl's ``agg_loss``.

    - ``seq-mean-token-sum``: sum over each sequence's tokens, mean over sequences (classic RLOO).
    - ``token-mean``: mean over every unmasked token of the batch (DAPO): long completions weigh more.
    - ``seq-mean-token-mean``: mean over each sequence's tokens, mean over sequences (GRPO).
    - ``seq-mean-token-sum-norm``: sum over each sequence's tokens divided by the constant
      ``max_response_length``, mean over sequences (Dr. GRPO): no length bias from the divisor. verl
      divides the batch's total by the constant instead of averaging over sequences, which scales the
      loss with the micro-batch size; the mean keeps the scale of the other modes.

    A sequence with no unmasked token contributes 0 and still counts in the mean over sequences.

    The sequence modes average over this call's sequences; a trainer summing equal-sized micro-batches
    (and ranks) gets the mean over the whole mini-batch. ``token-mean`` over the whole mini-batch needs its
    token count, which one micro-batch does not know: pass ``num_tokens`` (the mini-batch's unmasked
    tokens divided by the number of micro-batch losses averaged), and the loss is ``sum / num_tokens``.

    Args:
        loss_mat: (B, T) per-token losses; anything where ``mask`` is False.
        mask: (B, T) bool.
        loss_agg_mode: one of ``LOSS_AGG_MODES``.
        max_response_length: the constant of ``seq-mean-token-sum-norm``; default T.
        num_tokens: the denominator of ``token-mean``; default the unmasked tokens of ``mask``.

    Returns:
        0-dim loss.
    """
    if loss_agg_mode == "seq-mean-token-sum":
        return masked_sum(loss_mat, mask, dim=1).mean()
    if loss_agg_mode == "token-mean":
        if num_tokens is None:
            return masked_mean(loss_mat, mask)
        return masked_sum(loss_mat, mask) / num_tokens
    if loss_agg_mode == "seq-mean-token-mean":
        return masked_mean(loss_mat, mask, dim=1).mean()
    if loss_agg_mode == "seq-mean-token-sum-norm":
        norm = loss_mat.shape[-1] if max_response_length is None else max_response_length
        if norm < 1:
            raise ValueError(f"max_response_length must be >= 1 (got {norm}); pass the response length")
        return (masked_sum(loss_mat, mask, dim=1) / norm).mean()
    raise ValueError(f"loss_agg_mode must be one of {LOSS_AGG_MODES} (got {loss_agg_mode!r}); pick one")


def kl_loss(
    logprobs: Tensor,
    ref_logprobs: Tensor,
    mask: Tensor,
    estimator: str,
    loss_agg_mode: str = "seq-mean-token-sum",
    max_response_length: int | None = None,
    num_tokens: float | Tensor | None = None,
    importance_ratio: Tensor | None = None,
) -> Tensor:
    """KL(policy || ref) as a loss term (GRPO / verl ``use_kl_loss``), aggregated like the policy loss.

    The gradient flows through ``logprobs`` (the current policy's); the reference is a constant. With
    k1 the gradient is 0 in expectation (it is the score function), so use k2 or k3 here.

    ``importance_ratio`` (DeepSeek-V3.2's bias-corrected KL, TRL's ``use_bias_correction_kl``): each token's
    KL is multiplied by ``pi_theta / pi_old`` of the sampled token (with its gradient), so that on samples
    drawn by an older policy the k3 term's gradient is the unbiased gradient of KL(pi_theta || ref).

    Args:
        logprobs: (B, T) current policy log-probs of the sampled tokens (with grad).
        ref_logprobs: (B, T) reference-model log-probs of the same tokens.
        mask: (B, T) bool completion mask.
        estimator: "k1", "k2" or "k3" (see :func:`per_token_kl`).
        loss_agg_mode: one of ``LOSS_AGG_MODES`` (see :func:`agg_loss`).
        max_response_length: the constant of ``seq-mean-token-sum-norm``.
        num_tokens: the denominator of ``token-mean`` (see :func:`agg_loss`).
        importance_ratio: (B, T) per-token ratio, or (B,) one per sequence broadcast to its tokens (GSPO's);
            default none.

    Returns:
        0-dim KL estimate; multiply by the KL coefficient and add to the policy loss.
    """
    kl = per_token_kl(logprobs, ref_logprobs.detach(), mask, estimator)  # (B, T)
    if importance_ratio is not None:
        ratio = importance_ratio if importance_ratio.dim() == 2 else importance_ratio.unsqueeze(1)  # (B, T|1)
        kl = torch.where(mask, kl * ratio, torch.zeros_like(kl))  # (B, T): garbage ratios at padding stay out
    return agg_loss(kl, mask, loss_agg_mode, max_response_length, num_tokens)


@dataclass
class PolicyLossStats:
    """Diagnostics of one :func:`policy_loss` call; every field is a detached 0-dim tensor.

    Computed over sequences (the summed or length-normalised sequence ratio) or over unmasked tokens
    (per-token ratios); see :func:`policy_loss`.

    Attributes:
        clipfrac: fraction where the clipped surrogate was the active (larger) loss (CISPO: where the cap
            bounded the weight; GMPO: the share of tokens whose log-ratio was clipped; SAPO: 0).
        approxkl: mean of ``0.5 * logratio**2``.
        ratio_mean: mean importance ratio.
        ratio_var: unbiased variance of the ratio (0 with fewer than two entries).
        clip_low_frac: fraction with ``ratio < 1 - cliprange`` and ``A < 0`` (clipped at the low bound).
        clip_high_frac: fraction with ``ratio > 1 + cliprange`` and ``A > 0`` (clipped at the high bound).
        ratio_min: smallest ratio (1 when there is no entry).
        ratio_max: largest ratio (1 when there is no entry).
        dual_clip_frac: fraction with ``A < 0`` where the dual-clip bound ``-A * clip_ratio_c`` was the
            active loss (0 without ``clip_ratio_c``).
    """

    clipfrac: Tensor
    approxkl: Tensor
    ratio_mean: Tensor
    ratio_var: Tensor
    clip_low_frac: Tensor
    clip_high_frac: Tensor
    ratio_min: Tensor
    ratio_max: Tensor
    dual_clip_frac: Tensor


def _clipped_surrogate(
    ratio: Tensor,
    advantages: Tensor,
    c_low: float,
    c_high: float,
    delta: float | None = None,
    clip_ratio_c: float | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """Elementwise ``max(-A*r, -A*clip(r))``: return ``(loss, clipped, unclipped, dual_clipped)``.

    ``delta`` caps ``r`` in the unclipped part only (TRL clips the raw ratio for the clipped part).
    ``dual_clipped`` is None without ``clip_ratio_c``, else where the bound ``-A*c`` replaced the loss.
    """
    unclipped = -advantages * (ratio if delta is None else torch.clamp(ratio, max=delta))
    clipped = -advantages * torch.clamp(ratio, 1.0 - c_low, 1.0 + c_high)
    loss = torch.maximum(unclipped, clipped)
    if clip_ratio_c is None:
        return loss, clipped, unclipped, None
    bound = -advantages * clip_ratio_c
    # Only A < 0 is bounded: there a huge ratio would make the loss (and the step) arbitrarily large.
    dual_clipped = (advantages < 0) & (loss > bound)
    return torch.where(dual_clipped, bound, loss), clipped, unclipped, dual_clipped


def _surrogate(
    loss_type: str,
    ratio: Tensor,
    advantages: Tensor,
    logp: Tensor,
    c_low: float,
    c_high: float,
    delta: float | None,
    clip_ratio_c: float | None,
    cispo_max: float,
    sapo_temperature_pos: float,
    sapo_temperature_neg: float,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Elementwise surrogate loss of ``ratio`` (sequences or tokens): ``(loss, clip_flags, dual_clipped)``.

    - ``clip``: PPO's ``max(-A*r, -A*clip(r))`` (see :func:`_clipped_surrogate`).
    - ``cispo``: ``-sg(min(r, cispo_max)) * A * logp`` (MiniMax-M1's CISPO as TRL writes it): the ratio only
      weighs the REINFORCE term and is capped, so no token loses its gradient to clipping.
    - ``sapo``: ``-A * (4 / tau) * sigmoid(tau * (r - 1))`` with ``tau`` the temperature of A's sign (TRL's
      SAPO): a soft gate whose gradient at ``r = 1`` equals PPO's and fades smoothly off policy.

    ``logp`` is the log-prob term CISPO's gradient flows through (the token's, or a sequence's sum).
    ``clip_flags`` marks where the loss ignores a change of the ratio (the cap of CISPO; never for SAPO).
    """
    if loss_type == "clip":
        loss, clipped, unclipped, dual = _clipped_surrogate(
            ratio, advantages, c_low, c_high, delta, clip_ratio_c
        )
        return loss, clipped > unclipped, dual
    if loss_type == "cispo":
        weight = torch.clamp(ratio, max=cispo_max).detach()
        return -weight * advantages * logp, ratio > cispo_max, None
    if loss_type == "sapo":
        tau = torch.where(
            advantages > 0,
            torch.full_like(ratio, sapo_temperature_pos),
            torch.full_like(ratio, sapo_temperature_neg),
        )
        gate = torch.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau
        return -gate * advantages, torch.zeros_like(ratio, dtype=torch.bool), None
    raise ValueError(f"loss_type must be one of {LOSS_TYPES} (got {loss_type!r}); pick one")


def _stats(
    logratio: Tensor,
    ratio: Tensor,
    advantages: Tensor,
    clip_flags: Tensor,
    dual_clipped: Tensor | None,
    mask: Tensor,
    c_low: float,
    c_high: float,
    token_mask: Tensor | None = None,
) -> PolicyLossStats:
    """Stats over the True entries of ``mask`` (sequences or tokens).

    ``logratio``, ``ratio`` share the shape of ``mask``. The other tensors do too, unless ``token_mask``
    (B, T) is given with a (B,) ``mask`` of sequences (one ratio per sequence, per-token surrogates): then
    they are (B, T), and each fraction is first taken over a sequence's tokens, then over the sequences.
    """
    with torch.no_grad():
        one = torch.ones((), dtype=ratio.dtype, device=ratio.device)
        inf = torch.full((), math.inf, dtype=ratio.dtype, device=ratio.device)
        any_entry = mask.any()
        ratio_min = torch.where(mask, ratio, inf).min() if mask.numel() else inf
        ratio_max = torch.where(mask, ratio, -inf).max() if mask.numel() else -inf
        flag_ratio = ratio if token_mask is None else ratio.unsqueeze(1)  # broadcasts to the flags' shape
        low = (flag_ratio < 1.0 - c_low) & (advantages < 0)
        high = (flag_ratio > 1.0 + c_high) & (advantages > 0)

        def frac(flags: Tensor) -> Tensor:
            f = flags.to(ratio.dtype)
            if token_mask is not None:
                f = masked_mean(f, token_mask, dim=1)  # (B,) share of each sequence's tokens
            return masked_mean(f, mask)

        return PolicyLossStats(
            clipfrac=frac(clip_flags),
            approxkl=masked_mean(0.5 * logratio**2, mask),
            ratio_mean=masked_mean(ratio, mask),
            ratio_var=masked_var(ratio, mask, unbiased=True),
            clip_low_frac=frac(low),
            clip_high_frac=frac(high),
            ratio_min=torch.where(any_entry, ratio_min, one),
            ratio_max=torch.where(any_entry, ratio_max, one),
            dual_clip_frac=(
                torch.zeros((), dtype=ratio.dtype, device=ratio.device)
                if dual_clipped is None
                else frac(dual_clipped)
            ),
        )


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    cliprange: float,
    *,
    cliprange_high: float | None = None,
    loss_agg_mode: str = "seq-mean-token-sum",
    max_response_length: int | None = None,
    num_tokens: float | Tensor | None = None,
    is_weights: Tensor | None = None,
    importance_sampling_level: str = "auto",
    clip_ratio_c: float | None = None,
    delta: float | None = None,
    ratio_mask: Tensor | None = None,
    loss_type: str = "clip",
    cispo_max: float = 5.0,
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
) -> tuple[Tensor, PolicyLossStats]:
    """PPO-clipped RLOO policy loss (or another surrogate, ``loss_type``).

    Sequence level (``advantages`` (B,) with ``loss_agg_mode="seq-mean-token-sum"``, the reference's):
    ``logratio = sum_t new - sum_t old`` over the completion tokens, ``ratio = exp(logratio)``, loss
    ``= mean_b max(-A*ratio, -A*clip(ratio, 1-c, 1+c_high))``. A sequence without completion tokens has
    no ratio: it contributes 0 and is left out of the stats.

    Token level (``advantages`` (B, T), for per-token KL advantages, or (B,) broadcast to every token with
    any other ``loss_agg_mode``): per-token ratio ``exp(new_t - old_t)`` and clipped surrogate, reduced by
    :func:`agg_loss`. With ``seq-mean-token-sum`` (summed over each sequence's tokens, averaged over
    sequences) its gradient at ratio 1 with a constant per-token advantage equals the sequence-level one.

    ``importance_sampling_level`` picks the ratio: ``auto`` is the rule above; ``token`` always takes
    per-token ratios (a (B,) advantage broadcast to the tokens, even with ``seq-mean-token-sum``);
    ``sequence`` is GSPO's length-normalised ratio ``s_b = exp(sum_t (new_t - old_t) / max(1, n_b))``
    over the ``n_b`` completion tokens (TRL's ``importance_sampling_level="sequence"``), shared by every
    token of the sequence: per-token surrogates ``max(-A_t*s_b, -A_t*clip(s_b))`` with ``A_t`` the
    sequence's advantage or the token's own, reduced by :func:`agg_loss`.

    Dual clip (``clip_ratio_c``, Ye et al. 2020, verl's ``clip_ratio_c``): where ``A < 0`` the loss is
    also bounded above by ``-A * clip_ratio_c``, so a huge ratio on a bad sample cannot dominate the step.
    ``delta`` (TRL's two-sided GRPO, INTELLECT-2) caps the ratio at ``delta`` in the unclipped surrogate
    only: ``max(-A*min(r, delta), -A*clip(r))``. Both apply to whichever ratio the level picks.

    ``loss_type`` swaps PPO's clipped surrogate (``clip``) for another on the same ratio (see
    :func:`_surrogate`): ``cispo`` (``-sg(min(r, cispo_max)) * A * logp``; on the summed sequence ratio
    ``logp`` is the sequence's summed log-prob) or ``sapo`` (soft gates, ``sapo_temperature_pos/neg``);
    ``gmpo`` (Zhao et al. 2025, verl's ``geo_mean``) is its own sequence ratio: the geometric mean of the
    token ratios, each clipped PPO-style in log space to ``[-cliprange, cliprange_high]``, ``loss_b =
    -A_b * exp(mean_t min(sgn(A) l_t, sgn(A) clip(l_t)) * sgn(A))``, shared by the sequence's tokens and
    reduced by :func:`agg_loss` (``seq-mean-token-mean`` gives the paper's mean over sequences; a (B, T)
    advantage enters as its mean over the sequence's tokens). ``delta`` and ``clip_ratio_c`` are PPO's only.

    Positions where ``mask`` is False never influence the loss, its gradient or the stats, whatever
    ``logprobs`` / ``old_logprobs`` / ``advantages`` hold there.

    Args:
        logprobs: (B, T) current policy log-probs of the sampled tokens (with grad).
        old_logprobs: (B, T) log-probs under the policy that sampled them (no grad needed).
        advantages: (B,) sequence-level or (B, T) token-level advantages.
        mask: (B, T) bool completion mask.
        cliprange: PPO clip range ``c >= 0`` (the lower one when ``cliprange_high`` is set).
        cliprange_high: upper clip range (DAPO's clip-higher, TRL's ``epsilon_high``); default ``cliprange``.
        loss_agg_mode: one of ``LOSS_AGG_MODES`` (see :func:`agg_loss`).
        max_response_length: the constant of ``seq-mean-token-sum-norm``; default T.
        num_tokens: the denominator of ``token-mean``; default this call's unmasked tokens (see :func:`agg_loss`).
        is_weights: constant importance weights multiplying each surrogate (truncated importance sampling
            against the sampler's log-probs, see :func:`truncated_importance_weights`): (B,) per sequence,
            or (B, T) per token on every path but the summed sequence ratio; default none.
        importance_sampling_level: one of ``IMPORTANCE_SAMPLING_LEVELS``.
        clip_ratio_c: dual-clip bound, > 1 (verl's default 3.0); default none.
        delta: cap of the unclipped ratio, > ``1 + cliprange_high`` (TRL suggests 1 + 2 * epsilon
            upwards); default none.
        ratio_mask: with ``sequence``, the (B, T) bool tokens GSPO's ratio averages over when they are more
            than the tokens the loss trains on (``mask``, e.g. only the high-entropy ones): the ratio
            measures the whole completion's change, as TRL computes it; default ``mask``.
        loss_type: one of ``LOSS_TYPES``.
        cispo_max: with ``cispo``, the cap of the weight, > 1 (ScaleRL's epsilon_max: 5.0).
        sapo_temperature_pos: with ``sapo``, the gate's temperature where ``A > 0``, > 0.
        sapo_temperature_neg: with ``sapo``, the gate's temperature where ``A <= 0``, > 0.

    Returns:
        ``(loss, stats)``: 0-dim loss and :class:`PolicyLossStats`: over sequences with tokens for the
        summed and the ``sequence`` ratios (with per-token advantages, a clip fraction is each sequence's
        share of clipped tokens, averaged over sequences), over unmasked tokens for per-token ratios. The
        stats ignore ``is_weights``.
    """
    c_high = cliprange if cliprange_high is None else cliprange_high
    for name, c in (("cliprange", cliprange), ("cliprange_high", c_high)):
        if not (c >= 0 and math.isfinite(c)):
            raise ValueError(f"{name} must be a finite number >= 0 (got {c}); use e.g. 0.2")
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"loss_agg_mode must be one of {LOSS_AGG_MODES} (got {loss_agg_mode!r}); pick one")
    if importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
        raise ValueError(
            f"importance_sampling_level must be one of {IMPORTANCE_SAMPLING_LEVELS} "
            f"(got {importance_sampling_level!r}); pick one"
        )
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES} (got {loss_type!r}); pick one")
    if loss_type != "clip" and (delta is not None or clip_ratio_c is not None):
        raise ValueError(
            f"delta and clip_ratio_c bound PPO's clipped surrogate; loss_type {loss_type!r} has none"
        )
    if loss_type == "gmpo" and importance_sampling_level != "auto":
        raise ValueError(
            "loss_type 'gmpo' takes its own sequence ratio: leave importance_sampling_level 'auto'"
        )
    if loss_type == "cispo" and not (cispo_max > 1 and math.isfinite(cispo_max)):
        raise ValueError(f"cispo_max must be a finite number > 1 (got {cispo_max}); ScaleRL uses 5.0")
    for name, tau in (
        ("sapo_temperature_pos", sapo_temperature_pos),
        ("sapo_temperature_neg", sapo_temperature_neg),
    ):
        if loss_type == "sapo" and not (tau > 0 and math.isfinite(tau)):
            raise ValueError(f"{name} must be a finite number > 0 (got {tau}); TRL uses 1.0 and 1.05")
    if clip_ratio_c is not None and not (clip_ratio_c > 1 and math.isfinite(clip_ratio_c)):
        raise ValueError(
            f"clip_ratio_c must be a finite number > 1 (got {clip_ratio_c}); use e.g. 3.0, or None to disable"
        )
    if delta is not None and not (delta > 1.0 + c_high and math.isfinite(delta)):
        raise ValueError(
            f"delta must be a finite number > 1 + cliprange_high = {1.0 + c_high} (got {delta}); "
            "raise it or pass None to disable"
        )
    if logprobs.dim() != 2 or old_logprobs.shape != logprobs.shape or mask.shape != logprobs.shape:
        raise ValueError(
            f"logprobs {tuple(logprobs.shape)}, old_logprobs {tuple(old_logprobs.shape)} and mask "
            f"{tuple(mask.shape)} must share one (B, T) shape; align them"
        )
    if mask.dtype != torch.bool:
        raise ValueError(f"mask must be a bool tensor (got {mask.dtype}); pass mask.bool()")
    if ratio_mask is not None and (ratio_mask.shape != mask.shape or ratio_mask.dtype != torch.bool):
        raise ValueError(
            f"ratio_mask must be a bool tensor of the mask's shape {tuple(mask.shape)} (got "
            f"{ratio_mask.dtype} {tuple(ratio_mask.shape)})"
        )
    if advantages.shape not in (logprobs.shape[:1], logprobs.shape):
        raise ValueError(
            f"advantages must have shape (B,) = {tuple(logprobs.shape[:1])} or (B, T) = "
            f"{tuple(logprobs.shape)} (got {tuple(advantages.shape)}); pass sequence- or token-level advantages"
        )
    sequence_ratio = (
        importance_sampling_level == "auto"
        and advantages.dim() == 1
        and loss_agg_mode == "seq-mean-token-sum"
        and loss_type != "gmpo"
    )
    if is_weights is not None and is_weights.shape not in (
        logprobs.shape[:1],
        logprobs.shape[:1] if sequence_ratio else logprobs.shape,
    ):
        raise ValueError(
            f"is_weights shape {tuple(is_weights.shape)} must be (B,) = {tuple(logprobs.shape[:1])}"
            + ("" if sequence_ratio else f" or (B, T) = {tuple(logprobs.shape)}")
            + "; per-token weights need a token-level loss"
        )
    old_logprobs = old_logprobs.detach()
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    w = None if is_weights is None else is_weights.detach().to(logprobs.dtype)
    surrogate = functools.partial(
        _surrogate,
        loss_type,
        c_low=cliprange,
        c_high=c_high,
        delta=delta,
        clip_ratio_c=clip_ratio_c,
        cispo_max=cispo_max,
        sapo_temperature_pos=sapo_temperature_pos,
        sapo_temperature_neg=sapo_temperature_neg,
    )
    if loss_type == "gmpo":
        return _geometric_mean_loss(
            logprobs,
            old_logprobs,
            advantages,
            mask,
            cliprange,
            c_high,
            w,
            loss_agg_mode,
            max_response_length,
            num_tokens,
        )

    if sequence_ratio:
        advantages = advantages.detach().to(logprobs.dtype)
        # Sequence-level: one ratio per completion, as in the reference trainer.
        logratio = masked_sum(logprobs, mask, dim=1) - masked_sum(old_logprobs, mask, dim=1)  # (B,)
        ratio = torch.exp(logratio)  # (B,)
        seq_logp = masked_sum(logprobs, mask, dim=1)  # (B,) CISPO's REINFORCE term
        losses, flags, dual = surrogate(ratio, advantages, seq_logp)  # (B,) each
        has_tokens = mask.any(dim=1)  # (B,) e.g. False for a masked truncated completion
        losses = torch.where(has_tokens, losses, zero)  # (B,)
        if w is not None:
            losses = losses * w
        loss = losses.mean()
        stats = _stats(logratio, ratio, advantages, flags, dual, has_tokens, cliprange, c_high)
        return loss, stats

    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1).expand_as(logprobs)  # (B, T): every token gets A_b
    advantages = torch.where(mask, advantages.detach().to(logprobs.dtype), zero)  # (B, T)
    # where() before exp(): garbage at padding must yield neither inf values nor NaN gradients.
    logratio = torch.where(mask, logprobs - old_logprobs, zero)  # (B, T)
    if importance_sampling_level == "sequence":
        rmask = mask if ratio_mask is None else ratio_mask  # (B, T)
        n_tokens = rmask.sum(dim=1).clamp(min=1).to(logprobs.dtype)  # (B,)
        seq_logratio = (
            logratio.sum(dim=1)
            if ratio_mask is None
            else torch.where(rmask, logprobs - old_logprobs, zero).sum(1)
        ) / n_tokens  # (B,) mean log-ratio: comparable across lengths
        seq_ratio = torch.exp(seq_logratio)  # (B,)
        ratio = seq_ratio.unsqueeze(1).expand_as(logprobs)  # (B, T): one ratio for all of b's tokens
    else:
        ratio = torch.exp(logratio)  # (B, T)
    token_logp = torch.where(mask, logprobs, zero)  # (B, T) CISPO's REINFORCE term, padding's garbage out
    losses, flags, dual = surrogate(ratio, advantages, token_logp)  # (B, T) each
    if w is not None:
        losses = losses * (w.unsqueeze(1) if w.dim() == 1 else w)  # (B, T)
    loss = agg_loss(losses, mask, loss_agg_mode, max_response_length, num_tokens)
    if importance_sampling_level == "sequence":
        has_tokens = mask.any(dim=1)  # (B,)
        stats = _stats(
            seq_logratio,
            seq_ratio,
            advantages,
            flags,
            dual,
            has_tokens,
            cliprange,
            c_high,
            token_mask=mask,
        )
    else:
        stats = _stats(logratio, ratio, advantages, flags, dual, mask, cliprange, c_high)
    return loss, stats


def _geometric_mean_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    c_low: float,
    c_high: float,
    w: Tensor | None,
    loss_agg_mode: str,
    max_response_length: int | None,
    num_tokens: float | Tensor | None,
) -> tuple[Tensor, PolicyLossStats]:
    """GMPO's loss (see :func:`policy_loss`), after its checks."""
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    adv = advantages.detach().to(logprobs.dtype)
    seq_adv = adv if adv.dim() == 1 else masked_mean(torch.where(mask, adv, zero), mask, dim=1)  # (B,)
    # clamp as verl does: exp of a wild log-ratio must not overflow before the clip decides
    logratio = torch.where(mask, logprobs - old_logprobs, zero).clamp(-20.0, 20.0)  # (B, T)
    sign = torch.sign(seq_adv).unsqueeze(1)  # (B, 1)
    clipped = logratio.clamp(-c_low, c_high)  # (B, T)
    # pessimistic in A's direction: a move that helps the surrogate is capped, one that hurts it is not
    pessimistic = sign * torch.minimum(sign * logratio, sign * clipped)  # (B, T)
    n_tokens = mask.sum(dim=1).clamp(min=1).to(logprobs.dtype)  # (B,)
    seq_logratio = torch.where(mask, pessimistic, zero).sum(dim=1) / n_tokens  # (B,)
    seq_ratio = torch.exp(seq_logratio)  # (B,) the geometric mean of the clipped token ratios
    losses = (-seq_adv * seq_ratio).unsqueeze(1).expand_as(logprobs)  # (B, T): one value per sequence
    if w is not None:
        losses = losses * (w.unsqueeze(1) if w.dim() == 1 else w)  # (B, T)
    loss = agg_loss(losses, mask, loss_agg_mode, max_response_length, num_tokens)
    flags = mask & (pessimistic != logratio)  # (B, T) tokens whose change the clip ignored
    raw_logratio = (logratio.sum(dim=1) / n_tokens).detach()  # (B,) unclipped, for the stats
    stats = _stats(
        raw_logratio,
        torch.exp(raw_logratio),
        seq_adv.unsqueeze(1).expand_as(logprobs),  # (B, T): the stats' flags are per token
        flags,
        None,
        mask.any(dim=1),
        c_low,
        c_high,
        token_mask=mask,
    )
    return loss, stats
