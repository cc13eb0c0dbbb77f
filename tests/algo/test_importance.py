import math

import pytest
import torch

from rloo.algo import IS_MODES, truncated_importance_weights

NAN, INF = math.nan, math.inf


def test_token_weights_hand_values():
    train = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, NAN, 3.0]])
    sampler = torch.tensor([[-1.5, -1.0, -0.5], [-2.0, -INF, INF]])
    mask = torch.tensor([[True, True, True], [True, False, False]])
    w, stats = truncated_importance_weights(train, sampler, mask, 2.0)
    # diffs train - sampler: [0.5, -1, 0] and [1]; exp: [1.64872, 0.36788, 1] and [2.71828 -> cap 2]
    expected = torch.tensor([[math.exp(0.5), math.exp(-1.0), 1.0], [2.0, 1.0, 1.0]])
    torch.testing.assert_close(w, expected)
    # |diff| over the 4 completion tokens: (0.5 + 1 + 0 + 1) / 4 = 0.625
    assert stats.logp_diff_abs_mean.item() == pytest.approx(0.625)
    # one of 4 tokens capped
    assert stats.capped_frac.item() == pytest.approx(0.25)
    assert stats.masked_frac.item() == 0.0


def test_sequence_weights_hand_values():
    train = torch.tensor([[-1.0, -2.0], [-1.0, 0.0]])
    sampler = torch.tensor([[-1.5, -1.0], [-2.0, NAN]])
    mask = torch.tensor([[True, True], [True, False]])
    w, stats = truncated_importance_weights(train, sampler, mask, 2.0, per_sequence=True)
    # row 0: 0.5 - 1 = -0.5 -> e^-0.5 = 0.60653; row 1: 1 -> e = 2.718 -> cap 2
    torch.testing.assert_close(w, torch.tensor([math.exp(-0.5), 2.0]))
    assert stats.capped_frac.item() == pytest.approx(0.5)  # 1 of 2 sequences
    assert stats.logp_diff_abs_mean.item() == pytest.approx((0.5 + 1 + 1) / 3)


def test_identical_log_probs_give_weight_one_and_no_gradient():
    train = torch.randn(3, 4, requires_grad=True)
    w, stats = truncated_importance_weights(train, train.detach(), torch.ones(3, 4, dtype=torch.bool), 2.0)
    assert torch.equal(w, torch.ones(3, 4)) and not w.requires_grad
    assert stats.logp_diff_abs_mean.item() == 0.0 and stats.capped_frac.item() == 0.0


def test_huge_ratio_is_capped_not_inf():
    w, _ = truncated_importance_weights(
        torch.tensor([[1000.0]]), torch.tensor([[0.0]]), torch.ones(1, 1, dtype=torch.bool), 1.5
    )
    assert w.item() == 1.5


def test_mask_mode_token_hand_values():
    train = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, NAN, 3.0]])
    sampler = torch.tensor([[-1.5, -1.0, -0.5], [-2.0, -INF, INF]])
    mask = torch.tensor([[True, True, True], [True, False, False]])
    w, stats = truncated_importance_weights(train, sampler, mask, 2.0, mode="mask")
    # raw ratios [1.64872, 0.36788, 1] and [2.71828]: the one above the cap 2 becomes 0, the rest stay raw
    expected = torch.tensor([[math.exp(0.5), math.exp(-1.0), 1.0], [0.0, 1.0, 1.0]])
    torch.testing.assert_close(w, expected)
    assert stats.masked_frac.item() == pytest.approx(0.25)  # 1 of 4 tokens dropped
    assert stats.capped_frac.item() == 0.0  # nothing truncated to the cap
    assert stats.logp_diff_abs_mean.item() == pytest.approx(0.625)


def test_mask_mode_sequence_hand_values():
    train = torch.tensor([[-1.0, -2.0], [-1.0, 0.0], [1000.0, 0.0]])
    sampler = torch.tensor([[-1.5, -1.0], [-2.0, NAN], [0.0, 0.0]])
    mask = torch.tensor([[True, True], [True, False], [True, True]])
    w, stats = truncated_importance_weights(train, sampler, mask, 2.0, per_sequence=True, mode="mask")
    # row 0: e^-0.5 = 0.60653 kept; row 1: e^1 = 2.718 > 2 -> 0; row 2: e^1000 = inf > 2 -> 0 (not NaN)
    torch.testing.assert_close(w, torch.tensor([math.exp(-0.5), 0.0, 0.0]))
    assert stats.masked_frac.item() == pytest.approx(2 / 3)
    assert stats.capped_frac.item() == 0.0


def test_errors():
    x = torch.zeros(1, 2)
    mask = torch.ones(1, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match="cap"):
        truncated_importance_weights(x, x, mask, 0.0)
    with pytest.raises(ValueError, match="shape"):
        truncated_importance_weights(x, torch.zeros(2, 2), mask, 2.0)
    with pytest.raises(ValueError, match="mask"):
        truncated_importance_weights(x, x, mask.float(), 2.0)
    with pytest.raises(ValueError, match="mode"):
        truncated_importance_weights(x, x, mask, 2.0, mode="drop")
    assert IS_MODES == ("truncate", "mask")
