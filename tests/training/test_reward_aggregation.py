"""--multi_objective_aggregation normalize_then_sum (GDPO; TRL's grpo_trainer.py ``_generate_and_score_completions``,
branch ``normalize_then_sum``): the score the advantages are taken from."""

from __future__ import annotations

import math

import pytest
import torch

from rloo import algo
from rloo.training.experience import normalized_sum


def test_a_large_scale_source_no_longer_drowns_a_binary_one() -> None:
    # one group of K = 4: source 0 is 0/1 ([1, 0, 0, 1]), source 1 is on a x100 scale ([300, 100, 200, 0])
    per_source = torch.tensor([[1.0, 300.0], [0.0, 100.0], [0.0, 200.0], [1.0, 0.0]], dtype=torch.float64)
    w = torch.ones(2, dtype=torch.float64)
    plain, _ = algo.combine_reward_sources(per_source, w)
    # summed first, the ranking is source 1's alone: 301 > 200 > 100 > 1
    assert plain.argsort(descending=True).tolist() == [0, 2, 1, 3]
    # standardised first, each source within the group: both weigh alike
    s0 = torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=torch.float64)
    s1 = torch.tensor([300.0, 100.0, 200.0, 0.0], dtype=torch.float64)
    z = lambda x: (x - x.mean()) / (x.std() + 1e-4)  # noqa: E731  unbiased std, as the leave-one-out stats
    expected = z(s0) + z(s1)
    got = normalized_sum(per_source, plain, w, 4)
    assert got.tolist() == pytest.approx(expected.tolist())
    assert got[3] > got[1]  # the binary source's success now outweighs 100 points of the other


def test_penalties_on_the_score_are_kept() -> None:
    # a missing-EOS penalty of -1 on completion 1 and an unscored completion 2 (NaN in source 1)
    per_source = torch.tensor([[0.0, 1.0], [1.0, 3.0], [1.0, math.nan]], dtype=torch.float64)
    w = torch.tensor([1.0, 2.0], dtype=torch.float64)
    plain, _ = algo.combine_reward_sources(per_source, w)
    scores = plain + torch.tensor([0.0, -1.0, 0.0], dtype=torch.float64)
    got = normalized_sum(per_source, scores, w, 3)
    normed = algo.normalize_reward_sources(per_source, 3)
    base = torch.nan_to_num(normed[:, 0]) + 2 * torch.nan_to_num(normed[:, 1])
    assert got.tolist() == pytest.approx(
        (base + torch.tensor([0.0, -1.0, 0.0], dtype=torch.float64)).tolist()
    )
