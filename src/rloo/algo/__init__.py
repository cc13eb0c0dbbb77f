"""Pure tensor functions of the RLOO algorithm (estimators, masks, losses), in the style of verl's core_algos.

Conventions: B completions, T response length, P prompts, K completions per prompt. A (P, K) batch is
prompt-major (flat index ``p * K + k``). Masks are bool tensors. Invalid arguments raise ``ValueError``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# The names below, by the module that defines them, are imported on first use (PEP 562), not with the
# package: rloo.algo.intervals is stdlib only, and what imports it (the evaluation's statistics, the push
# gate, and through their configs the pipeline's parameters that 'rloo pipeline compile/submit' read) must
# not pull torch in with the tensor modules: a client install has no torch.
_EXPORTS = {
    "advantages": (
        "group_reward_stats",
        "informative_groups",
        "leave_one_out_advantages",
        "leave_one_out_baseline",
        "scale_advantages",
    ),
    # stdlib only: the values of the string options, which the training config reads without torch
    "choices": (
        "IMPORTANCE_SAMPLING_LEVELS",
        "IS_MODES",
        "KL_ESTIMATORS",
        "LOSS_AGG_MODES",
        "LOSS_TYPES",
        "MULTI_OBJECTIVE_AGGREGATIONS",
        "SCALE_REWARDS_MODES",
    ),
    "entropy_control": ("applied_entropy_coef", "next_entropy_coef"),
    "importance": ("SamplingMismatchStats", "off_policy_sequence_mask", "truncated_importance_weights"),
    "kl": ("per_token_kl", "sequence_kl"),
    "logprobs": (
        "entropy_from_logits",
        "entropy_quantile_threshold",
        "entropy_with_grad",
        "selective_log_softmax",
        "top_entropy_mask",
    ),
    "losses": (
        "PolicyLossStats",
        "agg_loss",
        "kl_loss",
        "policy_loss",
    ),
    "masking": (
        "completion_mask",
        "first_true_index",
        "masked_mean",
        "masked_sum",
        "masked_var",
        "masked_whiten",
        "truncate_after_stop",
        "truncated_completions",
    ),
    "monitors": ("pearson_correlation",),
    "rewards": (
        "apply_missing_eos_penalty",
        "combine_reward_sources",
        "normalize_advantages",
        "normalize_and_clip_scores",
        "normalize_reward_sources",
        "sequence_level_rewards",
        "soft_overlong_penalty",
        "token_level_advantages",
    ),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = [
    "IMPORTANCE_SAMPLING_LEVELS",
    "IS_MODES",
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "LOSS_TYPES",
    "MULTI_OBJECTIVE_AGGREGATIONS",
    "SCALE_REWARDS_MODES",
    "PolicyLossStats",
    "SamplingMismatchStats",
    "agg_loss",
    "applied_entropy_coef",
    "apply_missing_eos_penalty",
    "combine_reward_sources",
    "completion_mask",
    "entropy_from_logits",
    "entropy_quantile_threshold",
    "entropy_with_grad",
    "first_true_index",
    "group_reward_stats",
    "informative_groups",
    "kl_loss",
    "leave_one_out_advantages",
    "leave_one_out_baseline",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "next_entropy_coef",
    "normalize_advantages",
    "normalize_and_clip_scores",
    "normalize_reward_sources",
    "off_policy_sequence_mask",
    "pearson_correlation",
    "per_token_kl",
    "policy_loss",
    "scale_advantages",
    "selective_log_softmax",
    "sequence_kl",
    "sequence_level_rewards",
    "soft_overlong_penalty",
    "token_level_advantages",
    "top_entropy_mask",
    "truncate_after_stop",
    "truncated_completions",
    "truncated_importance_weights",
]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    globals()[name] = value  # once: later lookups find it without this function
    return value


if TYPE_CHECKING:  # what the names are, for the type checker
    from .advantages import (
        group_reward_stats,
        informative_groups,
        leave_one_out_advantages,
        leave_one_out_baseline,
        scale_advantages,
    )
    from .choices import (
        IMPORTANCE_SAMPLING_LEVELS,
        IS_MODES,
        KL_ESTIMATORS,
        LOSS_AGG_MODES,
        LOSS_TYPES,
        MULTI_OBJECTIVE_AGGREGATIONS,
        SCALE_REWARDS_MODES,
    )
    from .entropy_control import applied_entropy_coef, next_entropy_coef
    from .importance import SamplingMismatchStats, off_policy_sequence_mask, truncated_importance_weights
    from .kl import per_token_kl, sequence_kl
    from .logprobs import (
        entropy_from_logits,
        entropy_quantile_threshold,
        entropy_with_grad,
        selective_log_softmax,
        top_entropy_mask,
    )
    from .losses import (
        PolicyLossStats,
        agg_loss,
        kl_loss,
        policy_loss,
    )
    from .masking import (
        completion_mask,
        first_true_index,
        masked_mean,
        masked_sum,
        masked_var,
        masked_whiten,
        truncate_after_stop,
        truncated_completions,
    )
    from .monitors import pearson_correlation
    from .rewards import (
        apply_missing_eos_penalty,
        combine_reward_sources,
        normalize_advantages,
        normalize_and_clip_scores,
        normalize_reward_sources,
        sequence_level_rewards,
        soft_overlong_penalty,
        token_level_advantages,
    )
