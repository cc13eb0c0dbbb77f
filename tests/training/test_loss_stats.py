"""LossStats: the optimization phase's diagnostics, reduced once per update (one process here: the
collectives are the identity; tests/integration covers two)."""

from __future__ import annotations

import math

import pytest
import torch

from rloo.algo.losses import PolicyLossStats
from rloo.training.collectives import Collectives
from rloo.training.loss_stats import LossStats

accelerate = pytest.importorskip("accelerate")


def _policy(ratio: float, low: float, high: float) -> PolicyLossStats:
    t = torch.tensor
    return PolicyLossStats(
        clipfrac=t(low + high),
        approxkl=t(0.5 * math.log(ratio) ** 2),
        ratio_mean=t(ratio),
        ratio_var=t(0.0),
        clip_low_frac=t(low),
        clip_high_frac=t(high),
        ratio_min=t(ratio),
        ratio_max=t(ratio),
        dual_clip_frac=t(0.0),
    )


@pytest.fixture
def comm() -> Collectives:
    return Collectives(accelerate.Accelerator(cpu=True))


def test_means_over_the_micro_batches(comm: Collectives) -> None:
    stats = LossStats()
    for loss, ent, (ratio, low, high) in ((1.0, 2.0, (1.0, 0.0, 0.5)), (3.0, 4.0, (1.5, 0.25, 0.0))):
        stats.policy_loss.append(torch.tensor(loss))
        stats.entropy.append(torch.tensor(ent))
        stats.add_policy(_policy(ratio, low, high), trained=True)
    out = stats.metrics(comm, torch.device("cpu"), skip_nan=False)
    assert out["loss/policy_avg"] == pytest.approx(2.0)  # (1 + 3) / 2
    assert out["policy/entropy_avg"] == out["entropy"] == pytest.approx(3.0)  # (2 + 4) / 2
    assert out["val/ratio"] == pytest.approx(1.25)  # (1 + 1.5) / 2
    assert out["policy/clipfrac_avg"] == pytest.approx(0.375)  # (0.5 + 0.25) / 2
    assert out["clip_ratio/low_mean"] == pytest.approx(0.125)  # (0 + 0.25) / 2
    assert out["clip_ratio/low_min"] == 0.0 and out["clip_ratio/high_max"] == 0.5
    assert out["clip_ratio/region_mean"] == pytest.approx(0.375)  # ((0 + .5) + (.25 + 0)) / 2
    assert out["val/clipfrac_avg"] == 0.0
    # optional groups appear only when something was recorded
    assert not {"grad_norm", "loss/kl_avg", "objective/vllm_is_capped_frac"} & out.keys()


def test_untrained_micro_batches_stay_out_of_the_ratio_means(comm: Collectives) -> None:
    stats = LossStats()
    stats.entropy += [torch.tensor(1.0), torch.tensor(1.0)]
    stats.policy_loss += [torch.tensor(0.5), torch.tensor(0.0)]
    stats.add_policy(_policy(2.0, 0.0, 1.0), trained=True)
    stats.add_policy(_policy(1.0, 0.0, 0.0), trained=False)  # all completions masked as truncated
    out = stats.metrics(comm, torch.device("cpu"), skip_nan=True)
    assert out["val/ratio"] == pytest.approx(2.0)  # the trained one alone, not (2 + 1) / 2
    assert out["clip_ratio/high_mean"] == pytest.approx(1.0)
    # nothing trained at all: zeros, not NaN
    none = LossStats(entropy=[torch.tensor(1.0)], policy_loss=[torch.tensor(0.0)])
    none.add_policy(_policy(1.0, 0.0, 0.0), trained=False)
    out = none.metrics(comm, torch.device("cpu"), skip_nan=True)
    assert out["val/ratio"] == 0.0 and out["clip_ratio/low_mean"] == 0.0


def test_grad_norm_and_kl_term_are_reported_when_recorded(comm: Collectives) -> None:
    stats = LossStats(entropy=[torch.tensor(0.0)], policy_loss=[torch.tensor(0.0)])
    stats.add_policy(_policy(1.0, 0.0, 0.0), trained=True)
    stats.grad_norm += [torch.tensor(1.0), torch.tensor(3.0)]
    stats.kl_loss.append(torch.tensor(0.25))
    out = stats.metrics(comm, torch.device("cpu"), skip_nan=False)
    assert out["grad_norm"] == pytest.approx(2.0) and out["loss/kl_avg"] == pytest.approx(0.25)
