"""What generation produced for one update, and the metrics of its sequences.

``Sampled`` is what generation produced (enough for a log-prob forward); the update's whole experience, with
log-probs, advantages and metrics, is :class:`rloo.training.experience.Experience`. ``RolloutStats`` names the
per-sequence statistics that are gathered over ranks in one collective and turned into the rollout
metrics by :func:`rollout_metrics`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

import torch

from rloo import algo
from rloo.training.judge_reward import JUDGE


@dataclass
class Sampled:
    """Prompts and their sampled completions, every tensor prompt-major over B = P*K completions."""

    prompt_ids: torch.Tensor  # (P, L) left-padded
    prompt_mask: torch.Tensor  # (P, L)
    rows: torch.Tensor  # (B,) prompt of each completion: b // K
    responses: torch.Tensor  # (B, T) truncated after the stop token
    mask: torch.Tensor  # (B, T) bool: response tokens that count
    # (B, T) bool: the tokens the loss trains on; mask less the truncated completions with
    # --mask_truncated_completions (they keep their reward, their KL and their place in the baseline)
    loss_mask: torch.Tensor
    # (B, T) the sampler's (vLLM's) log-probs, kept for --vllm_importance_sampling_correction; else None
    sampling_logprobs: torch.Tensor | None
    # multi-turn episodes (rloo.agents.episodes.Episodes): mask then holds only the model's own tokens
    episodes: Any = None


@dataclass
class RolloutStats:
    """Per-sequence statistics of a rollout, each (B,) float."""

    scores: torch.Tensor  # task score before the KL penalty (after the missing-EOS penalty)
    valid: torch.Tensor  # 1 where every reward source scored the completion, else 0
    kl: torch.Tensor  # k1 KL summed over the sequence
    neg_logprob: torch.Tensor  # minus the summed sampling log-prob: the entropy estimate
    non_score_reward: torch.Tensor  # the KL penalty part of the reward
    rlhf_reward: torch.Tensor  # score + non-score reward
    contains_eos: torch.Tensor  # 1 where the completion stopped by itself
    length: torch.Tensor  # completion tokens
    prompt_length: torch.Tensor  # prompt tokens

    def stack(self) -> torch.Tensor:
        """(B, F) one tensor in field order, so that a multi-process gather is one collective."""
        return torch.stack([getattr(self, f.name).float() for f in fields(self)], dim=1)

    @classmethod
    def unstack(cls, table: torch.Tensor) -> RolloutStats:
        """The inverse of :meth:`stack` (of a gathered table, say)."""
        names = [f.name for f in fields(cls)]
        if table.dim() != 2 or table.size(1) != len(names):
            raise ValueError(f"expected a (B, {len(names)}) table, got {tuple(table.shape)}")
        return cls(**dict(zip(names, table.unbind(1), strict=True)))


def rollout_metrics(
    stats: RolloutStats,
    per_source: torch.Tensor,
    source_names: list[str],
    k: int,
    *,
    response_length: int | None = None,
    weights: torch.Tensor | None = None,
) -> dict[str, float]:
    """The rollout's metrics over the batch given (the global one): stats of B = P*K sequences in prompt
    order, per_source (B, S) the raw score of each reward source (NaN where it gave none). With
    ``response_length``, the reward-hacking monitors too (``monitor/*``); with the sources' ``weights`` (S,),
    an LLM judge's agreement with the other sources (``monitor/judge_reward_corr``)."""
    valid, contains_eos, lengths = stats.valid.bool(), stats.contains_eos.bool(), stats.length
    m: dict[str, float] = {}
    m["objective/kl"] = float(stats.kl.mean())
    # the entropy estimate of the sampled sequences; the reference also counted padded positions
    m["objective/entropy"] = float(stats.neg_logprob.mean())
    m["objective/non_score_reward"] = float(stats.non_score_reward.mean())
    m["objective/rlhf_reward"] = float(algo.masked_mean(stats.rlhf_reward, valid))
    m["objective/scores"] = float(algo.masked_mean(stats.scores, valid))
    m["val/num_eos_tokens"] = float(contains_eos.sum())
    m["kl"] = float(stats.kl.sum() / lengths.sum().clamp(min=1))
    m["reward"] = m["objective/scores"]
    reward_std, frac_zero = algo.group_reward_stats(stats.scores.view(-1, k), valid.view(-1, k))
    m["reward_std"], m["frac_reward_zero_std"] = float(reward_std), float(frac_zero)
    m["frac_reward_none"] = float((~valid).float().mean())
    for j, name in enumerate(source_names):
        col = per_source[:, j]
        ok = ~torch.isnan(col)
        m[f"rewards/{name}/mean"] = float(col[ok].mean()) if ok.any() else math.nan
        m[f"rewards/{name}/std"] = float(col[ok].std()) if ok.sum() > 1 else math.nan
    m["completions/mean_length"] = float(lengths.mean())
    m["completions/min_length"] = float(lengths.min())
    m["completions/max_length"] = float(lengths.max())
    term = lengths[contains_eos]
    m["completions/mean_terminated_length"] = float(term.mean()) if term.numel() else 0.0
    m["completions/min_terminated_length"] = float(term.min()) if term.numel() else 0.0
    m["completions/max_terminated_length"] = float(term.max()) if term.numel() else 0.0
    m["completions/clipped_ratio"] = float((~contains_eos).float().mean())
    if response_length is not None:
        # a policy that learns "longer scores more" rather than the task: the score-length correlation
        # climbs and completions pile up at the length limit
        m["monitor/score_length_corr"] = float(algo.pearson_correlation(stats.scores, lengths.float(), valid))
        m["monitor/at_response_length_frac"] = float((lengths >= response_length).float().mean())
    if weights is not None and JUDGE in source_names and len(source_names) > 1:
        m["monitor/judge_reward_corr"] = judge_reward_corr(per_source, source_names.index(JUDGE), weights)
    m["tokens/completion"] = float(lengths.sum())
    m["tokens/prompt"] = float(stats.prompt_length.sum())
    return m


def judge_reward_corr(per_source: torch.Tensor, judge: int, weights: torch.Tensor) -> float:
    """Pearson correlation over the batch of the LLM judge's reward (column ``judge`` of ``per_source``,
    (B, S)) and the weighted sum of the other sources (``weights``, (S,)), over the completions both scored:
    a policy that games the judge (or the other rewards) pulls the two apart. 0 where either is constant."""
    others = [s for s in range(per_source.size(1)) if s != judge]
    rest, scored = algo.combine_reward_sources(per_source[:, others], weights[others])  # (B,), (B,)
    verdict = per_source[:, judge]  # (B,)
    ok = scored & ~torch.isnan(verdict)
    return float(algo.pearson_correlation(torch.nan_to_num(verdict), rest, ok))
