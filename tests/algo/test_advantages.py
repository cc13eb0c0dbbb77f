import math

import pytest
import torch

from rloo.algo import (
    SCALE_REWARDS_MODES,
    group_reward_stats,
    informative_groups,
    leave_one_out_advantages,
    leave_one_out_baseline,
    scale_advantages,
)

NAN = math.nan


def test_loo_hand_values():
    rewards = torch.tensor([[1.0, 2.0, 6.0], [3.0, 3.0, 3.0]])
    # group [1, 2, 6]: baseline of 1 = (2+6)/2 = 4 -> 1-4 = -3
    #                  baseline of 2 = (1+6)/2 = 3.5 -> 2-3.5 = -1.5
    #                  baseline of 6 = (1+2)/2 = 1.5 -> 6-1.5 = 4.5
    # group [3, 3, 3]: every baseline is 3 -> 0
    expected = torch.tensor([[-3.0, -1.5, 4.5], [0.0, 0.0, 0.0]])
    torch.testing.assert_close(leave_one_out_advantages(rewards), expected)


def test_loo_matches_seed_rloo_reward_example():
    """The example from the classic trainer's docs (sample-major layout, rloo_k=4, 3 prompts)."""
    local_batch_size, rloo_k = 3, 4
    rlhf_reward = torch.tensor([1, 2, 3, 2, 3, 4, 5, 6, 7, 8, 9, 10]).float()
    advantages = torch.zeros_like(rlhf_reward)
    for i in range(0, len(advantages), local_batch_size):
        others = [
            rlhf_reward[j : j + local_batch_size]
            for j in range(0, len(advantages), local_batch_size)
            if i != j
        ]
        advantages[i : i + local_batch_size] = rlhf_reward[i : i + local_batch_size] - torch.stack(
            others
        ).mean(0)

    grouped = rlhf_reward.reshape(rloo_k, local_batch_size).T  # (P, K)
    ours = leave_one_out_advantages(grouped)  # (P, K)
    torch.testing.assert_close(ours.T.flatten(), advantages)
    # the doc's own asserts: first reward of prompt 0 is 1, others 2, 5, 8
    assert ours[0, 0].item() == pytest.approx(1 - (2 + 5 + 8) / 3)
    # third reward of prompt 1 is 6, others 2, 3, 9
    assert ours[1, 2].item() == pytest.approx(6 - (2 + 3 + 9) / 3)


def test_loo_with_invalid_entries_hand_values():
    rewards = torch.tensor([[1.0, NAN, 3.0, 5.0], [4.0, NAN, NAN, 7.0], [NAN, NAN, NAN, NAN]])
    valid = torch.tensor(
        [[True, False, True, True], [True, False, False, False], [False, False, False, False]]
    )
    # group 0, valid [1, 3, 5]: 1 - (3+5)/2 = -3; 3 - (1+5)/2 = 0; 5 - (1+3)/2 = 3; invalid -> 0
    # group 1: only 4 is valid -> no baseline -> 0 (7 is invalid even though it is a number)
    # group 2: nothing valid -> all 0, no NaN
    expected = torch.tensor([[-3.0, 0.0, 0.0, 3.0], [0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(leave_one_out_advantages(rewards, valid), expected)
    baseline, has = leave_one_out_baseline(rewards, valid)
    torch.testing.assert_close(baseline[0], torch.tensor([4.0, 0.0, 3.0, 2.0]))
    torch.testing.assert_close(has[0], torch.tensor([True, False, True, True]))
    assert not has[1:].any()


def _loop_loo(rewards, valid):
    p, k = rewards.shape
    out = torch.zeros(p, k, dtype=rewards.dtype)
    for i in range(p):
        for j in range(k):
            if not valid[i, j]:
                continue
            others = [rewards[i, m].item() for m in range(k) if m != j and valid[i, m]]
            if others:
                out[i, j] = rewards[i, j] - sum(others) / len(others)
    return out


@pytest.mark.parametrize("with_invalid", [False, True])
def test_loo_matches_loop_reference(with_invalid):
    g = torch.Generator().manual_seed(3)
    rewards = torch.randn(20, 5, generator=g, dtype=torch.float64)
    if with_invalid:
        valid = torch.rand(20, 5, generator=g) > 0.4
        rewards = rewards.masked_fill(~valid, NAN)
    else:
        valid = torch.ones(20, 5, dtype=torch.bool)
    out = leave_one_out_advantages(rewards, valid if with_invalid else None)
    assert not out.isnan().any()
    torch.testing.assert_close(out, _loop_loo(rewards, valid))


def test_loo_sums_to_zero_over_full_groups():
    # with all K valid: sum_i (r_i - (S - r_i)/(K-1)) = S - (K S - S)/(K-1) = 0
    g = torch.Generator().manual_seed(4)
    adv = leave_one_out_advantages(torch.randn(8, 4, generator=g, dtype=torch.float64))
    torch.testing.assert_close(adv.sum(1), torch.zeros(8, dtype=torch.float64))


def test_loo_errors():
    with pytest.raises(ValueError, match="K >= 2"):
        leave_one_out_advantages(torch.ones(3, 1))
    with pytest.raises(ValueError, match=r"\(P, K\)"):
        leave_one_out_advantages(torch.ones(6))
    with pytest.raises(ValueError, match="valid"):
        leave_one_out_advantages(torch.ones(3, 2), torch.ones(3, 2))
    with pytest.raises(ValueError, match="valid"):
        leave_one_out_advantages(torch.ones(3, 2), torch.ones(2, 3, dtype=torch.bool))


def test_group_reward_stats_hand_values():
    rewards = torch.tensor([[1.0, 3.0], [2.0, 2.0]])
    # group 0: mean 2, unbiased std sqrt((1 + 1)/1) = sqrt(2); group 1: std 0
    std, frac_zero = group_reward_stats(rewards)
    assert std.item() == pytest.approx(math.sqrt(2) / 2)
    assert frac_zero.item() == pytest.approx(0.5)


def test_group_reward_stats_with_invalid():
    rewards = torch.tensor([[1.0, 3.0, NAN], [5.0, NAN, NAN], [0.0, 2.0, 4.0]])
    valid = ~rewards.isnan()
    # group 0 over [1, 3]: sqrt(2); group 1 has one valid member -> std 0 (counts as zero-std);
    # group 2 [0, 2, 4]: mean 2, sqrt((4 + 0 + 4)/2) = 2
    std, frac_zero = group_reward_stats(rewards, valid)
    assert std.item() == pytest.approx((math.sqrt(2) + 0 + 2) / 3)
    assert frac_zero.item() == pytest.approx(1 / 3)
    assert std.dim() == 0 and frac_zero.dim() == 0


def test_group_reward_stats_matches_torch_std():
    g = torch.Generator().manual_seed(5)
    rewards = torch.randn(10, 4, generator=g, dtype=torch.float64)
    rewards[3] = 1.5  # one constant group
    std, frac_zero = group_reward_stats(rewards)
    torch.testing.assert_close(std, rewards.std(dim=1).mean())
    assert frac_zero.item() == pytest.approx(0.1)


def test_scale_advantages_group_hand_values():
    rewards = torch.tensor([[1.0, 3.0, NAN], [2.0, 2.0, 2.0], [5.0, NAN, NAN]])
    valid = ~rewards.isnan()
    adv = leave_one_out_advantages(rewards, valid)
    # group 0 over [1, 3]: LOO [-2, 2], std sqrt((1 + 1) / 1) = sqrt(2) -> +-2 / (sqrt(2) + 1e-4)
    # group 1: std 0, LOO 0 -> 0 / 1e-4 = 0; group 2: one valid member, no std -> 0
    a = 2 / (math.sqrt(2) + 1e-4)
    expected = torch.tensor([[-a, a, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    torch.testing.assert_close(scale_advantages(adv, rewards, valid, "group"), expected)


def test_scale_advantages_group_zeroes_groups_without_a_std():
    # advantages that are not LOO's: the single-member group 1 would get 7 / 1e-4 = 70000, and the
    # invalid entry holds NaN; both must come out as exactly 0
    rewards = torch.tensor([[0.0, 4.0], [1.0, NAN]])
    valid = ~rewards.isnan()
    adv = torch.tensor([[-1.0, 1.0], [7.0, NAN]])
    out = scale_advantages(adv, rewards, valid, "group", eps=0.5)
    # group 0: std of [0, 4] = sqrt((4 + 4) / 1) = sqrt(8) -> +-1 / (sqrt(8) + 0.5)
    s = 1 / (math.sqrt(8) + 0.5)
    torch.testing.assert_close(out, torch.tensor([[-s, s], [0.0, 0.0]]))


def test_scale_advantages_batch_hand_values():
    rewards = torch.tensor([[1.0, 3.0, NAN], [5.0, 7.0, 100.0]])
    valid = torch.tensor([[True, True, False], [True, True, False]])
    adv = torch.tensor([[-2.0, 2.0, NAN], [-2.0, 2.0, 9.0]])
    # valid rewards [1, 3, 5, 7] (100 is invalid): mean 4, squared deviations 9 + 1 + 1 + 9 = 20,
    # unbiased std sqrt(20 / 3) = 2.58199 -> +-2 / (2.58199 + 1e-4); invalid -> 0
    a = 2 / (math.sqrt(20 / 3) + 1e-4)
    expected = torch.tensor([[-a, a, 0.0], [-a, a, 0.0]])
    torch.testing.assert_close(scale_advantages(adv, rewards, valid, "batch"), expected)
    # the group std differs: group 0 [1, 3] and group 1 [5, 7] both have sqrt(2), not sqrt(20/3)
    g = 2 / (math.sqrt(2) + 1e-4)
    torch.testing.assert_close(
        scale_advantages(adv, rewards, valid, "group"), torch.tensor([[-g, g, 0.0], [-g, g, 0.0]])
    )


def test_scale_advantages_none_is_the_identity():
    adv = torch.tensor([[-1.0, 1.0]])
    assert scale_advantages(adv, torch.tensor([[0.0, 2.0]]), None, "none") is adv
    assert SCALE_REWARDS_MODES == ("none", "group", "batch")


def test_scale_advantages_errors():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="mode"):
        scale_advantages(x, x, None, "std")
    with pytest.raises(ValueError, match="eps"):
        scale_advantages(x, x, None, "group", eps=0.0)
    with pytest.raises(ValueError, match="advantages shape"):
        scale_advantages(torch.zeros(6), x, None, "batch")
    with pytest.raises(ValueError, match="valid"):
        scale_advantages(x, x, torch.ones(2, 3), "group")


def test_informative_groups_hand_values():
    rewards = torch.tensor(
        [[1.0, 3.0, NAN], [2.0, 2.0, 2.0], [5.0, NAN, NAN], [1.0, 1.0 + 1e-12, 1.0], [0.0, 0.0, 1.0]],
        dtype=torch.float64,
    )
    valid = ~rewards.isnan()
    # [1, 3]: std sqrt(2) -> True; constant -> False; one valid member -> False;
    # a 1e-12 spread: std ~5.8e-13, isclose to 0 (atol 1e-8) -> False; [0, 0, 1]: std 0.577 -> True
    out = informative_groups(rewards, valid)
    torch.testing.assert_close(out, torch.tensor([True, False, False, False, True]))
    # the complement of frac_reward_zero_std's groups: 3 of 5 are zero-std
    _, frac_zero = group_reward_stats(rewards, valid)
    assert frac_zero.item() == pytest.approx(3 / 5)
    assert frac_zero.item() == pytest.approx(1 - out.double().mean().item())


def test_informative_groups_default_valid_and_errors():
    # all valid: [0, 1] has spread, [4, 4] has none
    torch.testing.assert_close(
        informative_groups(torch.tensor([[0.0, 1.0], [4.0, 4.0]])), torch.tensor([True, False])
    )
    with pytest.raises(ValueError, match=r"\(P, K\)"):
        informative_groups(torch.ones(4))
