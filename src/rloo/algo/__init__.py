"""Pure tensor functions of the RLOO algorithm (estimators, masks, losses), in the style of verl's core_algos.

Conventions: B completions, T response length, P prompts, K completions per prompt. A (P, K) batch is
prompt-major (flat index ``p * K + k``). Masks are bool tensors. Invalid arguments raise ``ValueError``.
"""

from .advantages import group_reward_stats, leave_one_out_advantages, leave_one_out_baseline
from .importance import SamplingMismatchStats, truncated_importance_weights
from .kl import KL_ESTIMATORS, per_token_kl, sequence_kl
from .logprobs import entropy_from_logits, selective_log_softmax
from .losses import LOSS_AGG_MODES, PolicyLossStats, agg_loss, kl_loss, policy_loss
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
from .rewards import (
    apply_missing_eos_penalty,
    combine_reward_sources,
    normalize_advantages,
    normalize_and_clip_scores,
    sequence_level_rewards,
    token_level_advantages,
)

__all__ = [
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "PolicyLossStats",
    "SamplingMismatchStats",
    "agg_loss",
    "apply_missing_eos_penalty",
    "combine_reward_sources",
    "completion_mask",
    "entropy_from_logits",
    "first_true_index",
    "group_reward_stats",
    "kl_loss",
    "leave_one_out_advantages",
    "leave_one_out_baseline",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "normalize_advantages",
    "normalize_and_clip_scores",
    "per_token_kl",
    "policy_loss",
    "selective_log_softmax",
    "sequence_kl",
    "sequence_level_rewards",
    "token_level_advantages",
    "truncate_after_stop",
    "truncated_completions",
    "truncated_importance_weights",
]
