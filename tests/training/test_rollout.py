from __future__ import annotations

import math
from dataclasses import fields

import pytest
import torch

from rloo.training.rollout import RolloutStats, rollout_metrics


def _stats() -> RolloutStats:
    # 2 prompts x k=2; the third completion has no score (valid 0) and did not stop (no EOS)
    return RolloutStats(
        scores=torch.tensor([1.0, 3.0, 0.0, 2.0]),
        valid=torch.tensor([1.0, 1.0, 0.0, 1.0]),
        kl=torch.tensor([0.2, 0.4, 0.6, 0.8]),
        neg_logprob=torch.tensor([4.0, 6.0, 8.0, 10.0]),
        non_score_reward=torch.tensor([-0.01, -0.02, -0.03, -0.04]),
        rlhf_reward=torch.tensor([0.99, 2.98, 0.0, 1.96]),
        contains_eos=torch.tensor([1.0, 1.0, 0.0, 1.0]),
        length=torch.tensor([2.0, 4.0, 6.0, 8.0]),
        prompt_length=torch.tensor([5.0, 5.0, 7.0, 7.0]),
    )


def test_rollout_metrics_hand_values() -> None:
    per_source = torch.tensor([[1.0], [3.0], [math.nan], [2.0]])  # (B, S=1)
    m = rollout_metrics(_stats(), per_source, ["task"], k=2)
    assert m["objective/kl"] == pytest.approx(0.5)  # (0.2 + 0.4 + 0.6 + 0.8) / 4
    assert m["objective/entropy"] == pytest.approx(7.0)  # (4 + 6 + 8 + 10) / 4
    assert m["objective/non_score_reward"] == pytest.approx(-0.025)
    assert m["objective/scores"] == pytest.approx(2.0)  # valid only: (1 + 3 + 2) / 3
    assert m["objective/rlhf_reward"] == pytest.approx((0.99 + 2.98 + 1.96) / 3)
    assert m["kl"] == pytest.approx(2.0 / 20.0)  # KL sum 2.0 over 2 + 4 + 6 + 8 tokens
    assert m["val/num_eos_tokens"] == 3
    assert m["frac_reward_none"] == pytest.approx(0.25)
    assert m["rewards/task/mean"] == pytest.approx(2.0)  # NaN left out
    assert m["rewards/task/std"] == pytest.approx(1.0)  # std of 1, 3, 2
    assert (m["completions/mean_length"], m["completions/min_length"], m["completions/max_length"]) == (
        5,
        2,
        8,
    )
    assert m["completions/mean_terminated_length"] == pytest.approx((2 + 4 + 8) / 3)
    assert m["completions/clipped_ratio"] == pytest.approx(0.25)
    assert (m["tokens/completion"], m["tokens/prompt"]) == (20, 24)


def test_stack_and_unstack_are_inverse_and_named() -> None:
    stats = _stats()
    table = stats.stack()
    assert table.shape == (4, len(fields(RolloutStats)))
    back = RolloutStats.unstack(table)
    for f in fields(RolloutStats):
        torch.testing.assert_close(getattr(back, f.name), getattr(stats, f.name).float())
    with pytest.raises(ValueError, match=r"expected a \(B, 9\) table"):
        RolloutStats.unstack(table[:, :3])
