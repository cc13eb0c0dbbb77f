import math

import pytest
import torch

from rloo.algo import (
    apply_missing_eos_penalty,
    combine_reward_sources,
    leave_one_out_advantages,
    normalize_advantages,
    normalize_and_clip_scores,
    sequence_level_rewards,
    soft_overlong_penalty,
    token_level_advantages,
)

NAN = math.nan


def test_combine_reward_sources_hand_values():
    per_source = torch.tensor([[1.0, 2.0], [NAN, 3.0], [NAN, NAN]])
    weights = torch.tensor([0.5, 2.0])
    rewards, valid = combine_reward_sources(per_source, weights)
    # row 0: 0.5*1 + 2*2 = 4.5; row 1: only source 2: 2*3 = 6; row 2: nothing -> 0, invalid
    torch.testing.assert_close(rewards, torch.tensor([4.5, 6.0, 0.0]))
    torch.testing.assert_close(valid, torch.tensor([True, True, False]))
    # default weights are ones: [1+2, 3, 0]
    torch.testing.assert_close(combine_reward_sources(per_source)[0], torch.tensor([3.0, 3.0, 0.0]))


def test_combine_reward_sources_wrong_weights_length():
    with pytest.raises(ValueError, match="weights"):
        combine_reward_sources(torch.zeros(4, 2), torch.ones(3))


def test_missing_eos_penalty():
    scores = torch.tensor([1.0, 2.0, 3.0])
    has_eos = torch.tensor([True, False, True])
    # only the second lacks EOS: 2 - 1.5 = 0.5
    torch.testing.assert_close(apply_missing_eos_penalty(scores, has_eos, 1.5), torch.tensor([1.0, 0.5, 3.0]))
    same = apply_missing_eos_penalty(scores, has_eos, None)
    torch.testing.assert_close(same, scores)
    same[0] = 100.0  # a copy: the caller's scores are untouched
    assert scores[0].item() == 1.0


def test_normalize_and_clip_scores_hand_values():
    # [1, 3]: mean 2, unbiased std sqrt(2) -> [-1/sqrt2, 1/sqrt2] = [-0.7071, 0.7071]
    out = normalize_and_clip_scores(torch.tensor([1.0, 3.0]), clip_range=10.0)
    torch.testing.assert_close(out, torch.tensor([-1 / math.sqrt(2), 1 / math.sqrt(2)]))
    # clip_range 0.5 clamps them to +-0.5
    out = normalize_and_clip_scores(torch.tensor([1.0, 3.0]), clip_range=0.5)
    torch.testing.assert_close(out, torch.tensor([-0.5, 0.5]))
    # an invalid NaN entry is left out of the stats and maps to 0
    valid = torch.tensor([True, False, True])
    out = normalize_and_clip_scores(torch.tensor([1.0, NAN, 3.0]), 10.0, valid)
    torch.testing.assert_close(out, torch.tensor([-1 / math.sqrt(2), 0.0, 1 / math.sqrt(2)]))


def test_normalize_and_clip_scores_matches_reference_formula():
    g = torch.Generator().manual_seed(0)
    s = torch.randn(32, generator=g, dtype=torch.float64) * 3 + 1
    expected = ((s - s.mean()) / (s.std() + 1e-8)).clamp(-1.5, 1.5)
    torch.testing.assert_close(normalize_and_clip_scores(s, 1.5), expected)


def test_normalize_and_clip_scores_bad_clip_range():
    with pytest.raises(ValueError, match="clip_range"):
        normalize_and_clip_scores(torch.ones(3), 0.0)


def test_sequence_level_rewards_hand_values():
    scores = torch.tensor([1.0, 2.0])
    kl = torch.tensor([[0.1, 0.2, 9.0], [0.3, NAN, 0.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    rlhf, non_score = sequence_level_rewards(scores, kl, mask, kl_coef=0.5)
    # non_score = -0.5 * [0.1+0.2, 0.3] = [-0.15, -0.15]; rlhf = [1 - 0.15, 2 - 0.15]
    torch.testing.assert_close(non_score, torch.tensor([-0.15, -0.15]))
    torch.testing.assert_close(rlhf, torch.tensor([0.85, 1.85]))


def test_token_level_advantages_hand_values():
    scores = torch.tensor([[1.0, 3.0]])  # P=1, K=2
    kl = torch.tensor([[[0.2, 0.4, 0.6], [0.0, 0.2, 9.0]]])
    mask = torch.tensor([[[True, True, True], [True, True, False]]])
    adv, non_score = token_level_advantages(scores, kl, mask, kl_coef=0.5)
    # non_score: row 0 -0.5*(0.2+0.4+0.6) = -0.6; row 1 -0.5*(0+0.2) = -0.1
    torch.testing.assert_close(non_score, torch.tensor([[-0.6, -0.1]]))
    # full returns (rlhf rewards): [1-0.6, 3-0.1] = [0.4, 2.9]; LOO baselines: [2.9, 0.4]
    # row 0 returns-to-go: G0 = 1-0.5*1.2 = 0.4, G1 = 1-0.5*1.0 = 0.5, G2 = 1-0.5*0.6 = 0.7
    #   minus 2.9 -> [-2.5, -2.4, -2.2]
    # row 1: G0 = 3-0.5*0.2 = 2.9, G1 = 3-0.5*0.2 = 2.9, t=2 masked -> minus 0.4 -> [2.5, 2.5, 0]
    expected = torch.tensor([[[-2.5, -2.4, -2.2], [2.5, 2.5, 0.0]]])
    torch.testing.assert_close(adv, expected)


def _loop_token_level(scores, kl, mask, kl_coef, valid):
    p, k, t = kl.shape
    full = torch.zeros(p, k, dtype=kl.dtype)
    togo = torch.zeros(p, k, t, dtype=kl.dtype)
    for i in range(p):
        for j in range(k):
            steps = [s for s in range(t) if mask[i, j, s]]
            rewards = {s: -kl_coef * kl[i, j, s].item() for s in steps}
            if steps:
                rewards[steps[-1]] += scores[i, j].item() if valid[i, j] else 0.0
            for s in steps:
                togo[i, j, s] = sum(r for u, r in rewards.items() if u >= s)
            full[i, j] = sum(rewards.values()) if steps else (scores[i, j] if valid[i, j] else 0.0)
    adv = torch.zeros(p, k, t, dtype=kl.dtype)
    for i in range(p):
        for j in range(k):
            others = [full[i, m].item() for m in range(k) if m != j and valid[i, m]]
            if not valid[i, j] or not others:
                continue
            b = sum(others) / len(others)
            for s in range(t):
                if mask[i, j, s]:
                    adv[i, j, s] = togo[i, j, s] - b
    return adv


def _random_token_batch(seed, p=6, k=3, t=7):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(p, k, generator=g, dtype=torch.float64)
    kl = torch.randn(p, k, t, generator=g, dtype=torch.float64).abs()
    lengths = torch.randint(1, t + 1, (p, k), generator=g)
    mask = torch.arange(t) < lengths.unsqueeze(-1)  # (P, K, T) prefix masks
    kl = kl.masked_fill(~mask, NAN)  # garbage at padding must not leak
    valid = torch.rand(p, k, generator=g) > 0.3
    return scores.masked_fill(~valid, NAN), kl, mask, valid


def test_token_level_advantages_match_loop_reference():
    scores, kl, mask, valid = _random_token_batch(0)
    adv, non_score = token_level_advantages(scores, kl, mask, 0.3, valid)
    assert not adv.isnan().any() and not non_score.isnan().any()
    torch.testing.assert_close(adv, _loop_token_level(scores, kl, mask, 0.3, valid))
    assert adv[~valid].eq(0).all()
    assert adv[~mask].eq(0).all()


def test_token_level_first_token_equals_sequence_level_and_kl0_is_constant():
    scores, kl, mask, valid = _random_token_batch(1)
    p, k, t = kl.shape
    adv, non_score = token_level_advantages(scores, kl, mask, 0.3, valid)
    rlhf, non_score_seq = sequence_level_rewards(
        scores.reshape(-1), kl.reshape(p * k, t), mask.reshape(p * k, t), 0.3
    )
    torch.testing.assert_close(non_score.reshape(-1), non_score_seq)
    seq_adv = leave_one_out_advantages(rlhf.view(p, k), valid)  # (P, K)
    torch.testing.assert_close(adv[..., 0], seq_adv)
    # later tokens are charged less KL: A_t - A_0 = kl_coef * (KL before t) >= 0 on completion tokens
    assert (adv[..., 1:][mask[..., 1:]] >= adv[..., :1].expand(-1, -1, t - 1)[mask[..., 1:]] - 1e-12).all()
    # kl_coef = 0: every completion token carries the sequence-level LOO advantage of the scores
    adv0, _ = token_level_advantages(scores, kl, mask, 0.0, valid)
    expected = leave_one_out_advantages(scores, valid).unsqueeze(-1).expand(-1, -1, t)
    torch.testing.assert_close(adv0, torch.where(mask, expected, torch.zeros_like(expected)))


def test_token_level_all_invalid_group_has_no_nan():
    scores = torch.full((2, 2), NAN)
    valid = torch.zeros(2, 2, dtype=torch.bool)
    mask = torch.zeros(2, 2, 3, dtype=torch.bool)
    adv, non_score = token_level_advantages(scores, torch.full((2, 2, 3), NAN), mask, 0.1, valid)
    assert adv.eq(0).all() and non_score.eq(0).all()


def test_normalize_advantages_hand_values():
    # [1, 2, 3]: mean 2, unbiased std 1 -> [-1, 0, 1]
    torch.testing.assert_close(
        normalize_advantages(torch.tensor([1.0, 2.0, 3.0])), torch.tensor([-1.0, 0.0, 1.0])
    )
    # token-level with mask: entries 1, 3, 2 -> mean 2, std 1 -> [[-1, 1, 0], [0, 0, 0]]
    adv = torch.tensor([[1.0, 3.0, 99.0], [2.0, 100.0, NAN]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    torch.testing.assert_close(
        normalize_advantages(adv, mask), torch.tensor([[-1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    )
    # sequence-level with a (B,) mask: [1, _, 5] -> mean 3, std sqrt(8) -> [-2/sqrt8, 0, 2/sqrt8]
    out = normalize_advantages(torch.tensor([1.0, NAN, 5.0]), torch.tensor([True, False, True]))
    torch.testing.assert_close(out, torch.tensor([-2 / math.sqrt(8), 0.0, 2 / math.sqrt(8)]))


def test_normalize_advantages_matches_reference_and_handles_empty():
    g = torch.Generator().manual_seed(2)
    a = torch.randn(16, generator=g, dtype=torch.float64)
    torch.testing.assert_close(normalize_advantages(a), (a - a.mean()) / (a.std() + 1e-8))
    empty = normalize_advantages(torch.full((3,), NAN), torch.zeros(3, dtype=torch.bool))
    assert empty.eq(0).all()
    with pytest.raises(ValueError, match="mask"):
        normalize_advantages(torch.zeros(2, 3), torch.ones(2, dtype=torch.bool))


def test_soft_overlong_penalty_hand_values():
    # max 100, buffer 20: the ramp starts after 100 - 20 = 80
    lengths = torch.tensor([50, 80, 81, 90, 100, 120])
    # 50, 80: no penalty; 81: (80 - 81) / 20 = -0.05; 90: (80 - 90) / 20 = -0.5 (TRL's docstring example);
    # 100: (80 - 100) / 20 = -1; 120: beyond max -> -1
    expected = torch.tensor([0.0, 0.0, -0.05, -0.5, -1.0, -1.0])
    out = soft_overlong_penalty(lengths, 100, 20)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, expected)
    # factor 0.5 scales everything: -0.025, -0.25, -0.5, -0.5
    torch.testing.assert_close(soft_overlong_penalty(lengths, 100, 20, factor=0.5), expected * 0.5)
    # floating lengths keep their dtype
    assert soft_overlong_penalty(lengths.double(), 100, 20).dtype == torch.float64


def test_soft_overlong_penalty_no_buffer_and_errors():
    torch.testing.assert_close(soft_overlong_penalty(torch.tensor([10, 100]), 100, 0), torch.zeros(2))
    # a buffer as long as max_length ramps from length 0: 50 -> -50 / 100 = -0.5
    torch.testing.assert_close(
        soft_overlong_penalty(torch.tensor([0, 50]), 100, 100), torch.tensor([0.0, -0.5])
    )
    with pytest.raises(ValueError, match="buffer_length"):
        soft_overlong_penalty(torch.tensor([1]), 100, -1)
    with pytest.raises(ValueError, match="buffer_length"):
        soft_overlong_penalty(torch.tensor([1]), 100, 101)
