"""The optimization phase's diagnostics: collected per micro-batch on the device, reduced once per update.

:class:`LossStats` replaces a dict of lists keyed by strings: each statistic is a named list, the policy
loss's own diagnostics come from :class:`rloo.algo.losses.PolicyLossStats`' fields, and :meth:`metrics`
names them as the classic trainer logs them. Values stay 0-dim device tensors until the end of the update:
no host sync per micro-batch.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch

from rloo.algo.losses import PolicyLossStats
from rloo.training.collectives import Collectives

_POLICY_FIELDS = tuple(f.name for f in dataclasses.fields(PolicyLossStats))


@dataclass
class LossStats:
    """Per-micro-batch values of one update (each list holds 0-dim tensors)."""

    policy_loss: list[torch.Tensor] = field(default_factory=list)
    entropy: list[torch.Tensor] = field(default_factory=list)
    kl_loss: list[torch.Tensor] = field(default_factory=list)  # --kl_in_loss: the KL term before kl_coef
    # --teacher_kl_in_loss: the KL-to-the-teacher term before teacher_kl_coef
    teacher_kl_loss: list[torch.Tensor] = field(default_factory=list)
    grad_norm: list[torch.Tensor] = field(default_factory=list)  # per optimizer step; none under DeepSpeed
    vllm_logp_diff_abs: list[torch.Tensor] = field(default_factory=list)
    vllm_is_capped: list[torch.Tensor] = field(default_factory=list)
    vllm_is_masked: list[torch.Tensor] = field(default_factory=list)
    entropy_bonus: list[torch.Tensor] = field(
        default_factory=list
    )  # --entropy_coef: the term before the coef
    top_entropy_threshold: list[torch.Tensor] = field(default_factory=list)  # --top_entropy_quantile < 1
    top_entropy_kept: list[torch.Tensor] = field(default_factory=list)  # the share of tokens trained on
    off_policy_masked: list[torch.Tensor] = field(default_factory=list)  # --off_policy_mask_threshold
    policy: dict[str, list[torch.Tensor]] = field(
        default_factory=lambda: {name: [] for name in _POLICY_FIELDS}
    )
    skipped_steps: int = 0  # optimizer steps left out: their mini-batch had nothing to train on

    def add_policy(self, st: PolicyLossStats, *, trained: bool) -> None:
        """One micro-batch's ratio and clip statistics; NaN for a micro-batch with nothing to train on (all
        completions masked as truncated), so it stays out of the means (a 0 would read as "ratio 0")."""
        for name in _POLICY_FIELDS:
            value = getattr(st, name)
            self.policy[name].append(value if trained else torch.full_like(value, math.nan))

    def skip(self, device: torch.device, *, optional: tuple[list[torch.Tensor], ...] = ()) -> None:
        """A mini-batch with nothing to train on anywhere (--filter_groups), so no step: NaN in the lists
        every update reports and in the ``optional`` ones its options fill (so an update skipped whole still
        reports the same metrics), left out of the means like an empty micro-batch (``skip_nan``)."""
        nan = torch.full((), math.nan, device=device)
        for values in (self.policy_loss, self.entropy, *self.policy.values(), *optional):
            values.append(nan)
        self.skipped_steps += 1

    def metrics(
        self, comm: Collectives, device: torch.device, *, skip_nan: bool, dual_clip: bool = False
    ) -> dict[str, float]:
        """Means over every rank's micro-batches, named as the classic trainer logs them. ``skip_nan``
        (an option that can leave a micro-batch nothing to train on, e.g. --mask_truncated_completions): means
        over the micro-batches that trained on something, 0 if none. ``dual_clip`` (--clip_ratio_c): report
        how often its bound was active."""

        def avg(values: list[torch.Tensor]) -> float:
            stacked = torch.stack(values).float()
            if not skip_nan:
                return comm.mean(float(stacked.mean()), device)
            kept = ~stacked.isnan()
            total = torch.stack([torch.where(kept, stacked, 0.0).sum(), kept.sum().float()]).to(device)
            total = comm.sum(total)
            return float(total[0] / total[1]) if total[1] > 0 else 0.0

        low = comm.gather(torch.stack(self.policy["clip_low_frac"]).float())
        high = comm.gather(torch.stack(self.policy["clip_high_frac"]).float())
        if skip_nan:
            low, high = low[~low.isnan()], high[~high.isnan()]
            if low.numel() == 0:
                low, high = low.new_zeros(1), high.new_zeros(1)
        entropy = avg(self.entropy)
        out = {
            "loss/policy_avg": avg(self.policy_loss),
            "policy/entropy_avg": entropy,
            "policy/approxkl_avg": avg(self.policy["approxkl"]),
            "policy/clipfrac_avg": avg(self.policy["clipfrac"]),
            # RLOO has no value function; logged as 0 so dashboards built for the reference keep working.
            "val/clipfrac_avg": 0.0,
            "val/ratio": avg(self.policy["ratio_mean"]),
            "val/ratio_var": avg(self.policy["ratio_var"]),
            "entropy": entropy,
            "clip_ratio/low_mean": float(low.mean()),
            "clip_ratio/low_min": float(low.min()),
            "clip_ratio/high_mean": float(high.mean()),
            "clip_ratio/high_max": float(high.max()),
            "clip_ratio/region_mean": float((low + high).mean()),
        }
        if self.grad_norm:
            out["grad_norm"] = avg(self.grad_norm)
        if self.kl_loss:
            out["loss/kl_avg"] = avg(self.kl_loss)
        if self.teacher_kl_loss:
            out["loss/teacher_kl_avg"] = avg(self.teacher_kl_loss)
        if self.vllm_logp_diff_abs:  # --vllm_importance_sampling_correction
            out["objective/vllm_logp_diff_abs_mean"] = avg(self.vllm_logp_diff_abs)
            out["objective/vllm_is_capped_frac"] = avg(self.vllm_is_capped)
            out["objective/vllm_is_masked_frac"] = avg(self.vllm_is_masked)
        if self.entropy_bonus:
            out["loss/entropy_bonus_avg"] = avg(self.entropy_bonus)
        if self.top_entropy_threshold:
            out["policy/top_entropy_threshold"] = avg(self.top_entropy_threshold)
            out["policy/top_entropy_kept_frac"] = avg(self.top_entropy_kept)
        if self.off_policy_masked:  # the share of completions the off-policy mask left out of the loss
            out["policy/off_policy_masked_frac"] = avg(self.off_policy_masked)
        if dual_clip:
            out["clip_ratio/dual_clip_frac"] = avg(self.policy["dual_clip_frac"])
        return out
