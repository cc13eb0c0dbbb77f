"""The values the algorithm's string options take, stdlib only: the tensor modules that act on them
(:mod:`.kl`, :mod:`.losses`, :mod:`.advantages`, :mod:`.importance`) and the training config, which is
parsed where torch is not installed (``rloo pipeline`` on a client), read the same tuples."""

from __future__ import annotations

__all__ = [
    "IMPORTANCE_SAMPLING_LEVELS",
    "IS_MODES",
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "LOSS_TYPES",
    "MULTI_OBJECTIVE_AGGREGATIONS",
    "SCALE_REWARDS_MODES",
]

KL_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3")

# verl's names; the first is the classic RLOO loss (one sequence-level ratio, summed log-probs)
LOSS_AGG_MODES: tuple[str, ...] = (
    "seq-mean-token-sum",
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)

IMPORTANCE_SAMPLING_LEVELS: tuple[str, ...] = ("auto", "token", "sequence")

SCALE_REWARDS_MODES: tuple[str, ...] = ("none", "group", "batch")

# what truncated importance sampling does with a weight above its cap
IS_MODES: tuple[str, ...] = ("truncate", "mask")

# the policy surrogate: PPO's clipped ratio (the classic), CISPO's clipped stop-gradient weight on the
# log-prob (MiniMax-M1, TRL), SAPO's soft gate (TRL), GMPO's geometric mean of clipped token ratios (verl)
LOSS_TYPES: tuple[str, ...] = ("clip", "cispo", "sapo", "gmpo")

# how several reward sources become one score: weighted sum, or each normalised within its group first (GDPO)
MULTI_OBJECTIVE_AGGREGATIONS: tuple[str, ...] = ("sum_then_normalize", "normalize_then_sum")
