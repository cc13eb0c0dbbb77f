import math

import pytest
import torch

from rloo.algo import (
    IMPORTANCE_SAMPLING_LEVELS,
    LOSS_AGG_MODES,
    PolicyLossStats,
    agg_loss,
    kl_loss,
    leave_one_out_advantages,
    normalize_advantages,
    policy_loss,
)

NAN, INF = math.nan, math.inf


def test_sequence_level_hand_values():
    new = torch.tensor([[-1.0, -1.0], [-2.0, NAN]], requires_grad=True)
    old = torch.tensor([[-1.1, -1.0], [-2.5, INF]])
    mask = torch.tensor([[True, True], [True, False]])
    adv = torch.tensor([1.0, 2.0])
    loss, stats = policy_loss(new, old, adv, mask, cliprange=0.2)
    # row 0: logratio = -2 - (-2.1) = 0.1, ratio e^0.1 = 1.10517 (inside [0.8, 1.2]) -> loss -1.10517
    # row 1: logratio = -2 - (-2.5) = 0.5, ratio e^0.5 = 1.64872; -2*1.64872 = -3.29744 vs -2*1.2 = -2.4
    #        -> max = -2.4 (clipped)
    r0, r1 = math.exp(0.1), math.exp(0.5)
    assert loss.item() == pytest.approx((-r0 - 2.4) / 2)
    assert stats.clipfrac.item() == pytest.approx(0.5)
    assert stats.approxkl.item() == pytest.approx(0.5 * (0.1**2 + 0.5**2) / 2)  # 0.065
    assert stats.ratio_mean.item() == pytest.approx((r0 + r1) / 2)
    assert stats.ratio_var.item() == pytest.approx((r0 - r1) ** 2 / 2)  # unbiased over 2
    assert stats.clip_high_frac.item() == pytest.approx(0.5)  # row 1: ratio > 1.2 with A > 0
    assert stats.clip_low_frac.item() == 0.0
    assert stats.ratio_min.item() == pytest.approx(r0)
    assert stats.ratio_max.item() == pytest.approx(r1)
    loss.backward()
    # d/dnew of row 0 = -A0 * r0 / B on each token; row 1 clipped -> 0; padding -> 0, not NaN
    torch.testing.assert_close(new.grad, torch.tensor([[-r0 / 2, -r0 / 2], [0.0, 0.0]]))


def test_sequence_level_low_clip():
    new = torch.tensor([[-1.5]])
    old = torch.tensor([[-1.0]])
    # ratio e^-0.5 = 0.60653, A = -1: -A*ratio = 0.60653 vs -A*0.8 = 0.8 -> 0.8, clipped at the low bound
    loss, stats = policy_loss(new, old, torch.tensor([-1.0]), torch.ones(1, 1, dtype=torch.bool), 0.2)
    assert loss.item() == pytest.approx(0.8)
    assert stats.clip_low_frac.item() == 1.0 and stats.clip_high_frac.item() == 0.0
    assert stats.clipfrac.item() == 1.0
    assert stats.ratio_var.item() == 0.0  # B == 1


def test_stats_are_detached_scalars():
    new = torch.randn(3, 4, requires_grad=True)
    _, stats = policy_loss(new, new.detach() + 0.1, torch.ones(3), torch.ones(3, 4, dtype=torch.bool), 0.2)
    assert isinstance(stats, PolicyLossStats)
    for value in vars(stats).values():
        assert value.dim() == 0 and not value.requires_grad


def _loop_policy_loss(new, old, adv, mask, c):
    b, t = new.shape
    losses, ratios, clipped_flags = [], [], []
    if adv.dim() == 1:
        for i in range(b):
            lr = sum(new[i, s] - old[i, s] for s in range(t) if mask[i, s])
            ratio = math.exp(lr)
            u, cl = -adv[i].item() * ratio, -adv[i].item() * min(max(ratio, 1 - c), 1 + c)
            losses.append(max(u, cl))
            ratios.append(ratio)
            clipped_flags.append(cl > u)
        return sum(losses) / b, ratios, clipped_flags
    total = 0.0
    for i in range(b):
        for s in range(t):
            if not mask[i, s]:
                continue
            ratio = math.exp(new[i, s] - old[i, s])
            a = adv[i, s].item()
            u, cl = -a * ratio, -a * min(max(ratio, 1 - c), 1 + c)
            total += max(u, cl)
            ratios.append(ratio)
            clipped_flags.append(cl > u)
    return total / b, ratios, clipped_flags


@pytest.mark.parametrize("level", ["sequence", "token"])
def test_policy_loss_matches_loop_reference(level):
    g = torch.Generator().manual_seed(0)
    b, t = 8, 6
    old = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    new = old + torch.randn(b, t, generator=g, dtype=torch.float64) * 0.15
    mask = torch.arange(t) < torch.randint(1, t + 1, (b, 1), generator=g)
    new, old = new.masked_fill(~mask, NAN), old.masked_fill(~mask, -INF)
    adv = torch.randn(b, generator=g, dtype=torch.float64)
    if level == "token":
        adv = torch.randn(b, t, generator=g, dtype=torch.float64).masked_fill(~mask, NAN)
    loss, stats = policy_loss(new, old, adv, mask, 0.1)
    expected, ratios, flags = _loop_policy_loss(new, old, adv, mask, 0.1)
    assert any(flags) and not all(flags)  # the draw exercises both branches
    assert loss.item() == pytest.approx(expected)
    r = torch.tensor(ratios, dtype=torch.float64)
    assert stats.clipfrac.item() == pytest.approx(sum(flags) / len(flags))
    assert stats.ratio_mean.item() == pytest.approx(r.mean().item())
    assert stats.ratio_var.item() == pytest.approx(r.var().item())
    assert stats.approxkl.item() == pytest.approx((0.5 * r.log() ** 2).mean().item())
    assert stats.ratio_min.item() == pytest.approx(r.min().item())
    assert stats.ratio_max.item() == pytest.approx(r.max().item())


def test_token_level_hand_values_and_stats_over_unmasked_tokens():
    new = torch.tensor([[0.0, math.log(2.0), NAN]])
    old = torch.zeros(1, 3)
    mask = torch.tensor([[True, True, False]])
    adv = torch.tensor([[1.0, -1.0, 5.0]])
    loss, stats = policy_loss(new, old, adv, mask, 0.2)
    # token 0: ratio 1, A=1 -> -1; token 1: ratio 2, A=-1 -> max(2, 1.2) = 2 (unclipped side)
    # sum over tokens -1 + 2 = 1, mean over 1 sequence = 1
    assert loss.item() == pytest.approx(1.0)
    # stats over the 2 unmasked tokens: ratios [1, 2]
    assert stats.ratio_mean.item() == pytest.approx(1.5)
    assert stats.ratio_var.item() == pytest.approx(0.5)
    assert stats.clipfrac.item() == 0.0
    assert stats.clip_high_frac.item() == 0.0  # ratio 2 > 1.2 but A < 0: not clipped
    assert stats.approxkl.item() == pytest.approx(0.5 * math.log(2.0) ** 2 / 2)


def test_token_level_gradient_equals_sequence_level_at_ratio_one():
    g = torch.Generator().manual_seed(1)
    b, t = 5, 7
    old = -torch.rand(b, t, generator=g, dtype=torch.float64)
    mask = torch.arange(t) < torch.randint(1, t + 1, (b, 1), generator=g)
    adv = torch.randn(b, generator=g, dtype=torch.float64)
    new_seq = old.clone().requires_grad_()
    new_tok = old.clone().requires_grad_()
    loss_seq, _ = policy_loss(new_seq, old, adv, mask, 0.2)
    loss_tok, _ = policy_loss(new_tok, old, adv.unsqueeze(1).expand(b, t), mask, 0.2)
    loss_seq.backward()
    loss_tok.backward()
    # both: d loss / d new_{i,t} = -A_i / B on completion tokens, 0 on padding
    expected = torch.where(mask, -adv.unsqueeze(1) / b, torch.zeros_like(old))
    torch.testing.assert_close(new_seq.grad, expected)
    torch.testing.assert_close(new_tok.grad, expected)


@pytest.mark.parametrize("level", ["sequence", "token"])
def test_garbage_at_padding_has_no_influence(level):
    mask = torch.tensor([[True, True, False, False], [True, False, False, False]])
    base_new = torch.tensor([[-1.0, -0.5, -0.2, -0.3], [-2.0, -0.1, -0.1, -0.1]])
    old = torch.tensor([[-1.1, -0.4, -0.3, -0.3], [-1.5, -0.1, -0.1, -0.1]])
    adv = (
        torch.tensor([0.7, -1.3])
        if level == "sequence"
        else torch.tensor([[0.7, -0.2, 0.0, 0.0], [1.0, 0, 0, 0]])
    )
    garbage = torch.tensor([[0.0, 0.0, NAN, INF], [0.0, -INF, NAN, 1e30]])
    results = []
    for new0, old0, adv0 in [(base_new, old, adv), (base_new + garbage, old - garbage, adv)]:
        if level == "token":
            adv0 = torch.where(mask, adv0, torch.full_like(adv0, NAN))
        new0 = new0.clone().requires_grad_()
        loss, stats = policy_loss(new0, old0, adv0, mask, 0.2)
        loss.backward()
        results.append((loss.detach(), new0.grad, vars(stats)))
    (l1, g1, s1), (l2, g2, s2) = results
    torch.testing.assert_close(l1, l2)
    torch.testing.assert_close(g1, g2)
    assert torch.isfinite(g2).all() and g2[~mask].eq(0).all()
    for name in s1:
        torch.testing.assert_close(s1[name], s2[name])


def test_empty_mask_and_all_invalid_groups_give_no_nan():
    rewards = torch.tensor([[NAN, NAN], [1.0, 2.0]])
    valid = ~rewards.isnan()
    adv = normalize_advantages(leave_one_out_advantages(rewards, valid).flatten(), valid.flatten())
    # group 1: LOO [-1, 1]; group 0 invalid -> over valid entries [-1, 1], std sqrt(2)
    torch.testing.assert_close(adv, torch.tensor([0.0, 0.0, -1 / math.sqrt(2), 1 / math.sqrt(2)]))
    mask = torch.zeros(4, 3, dtype=torch.bool)  # no completion tokens at all
    logprobs = torch.full((4, 3), NAN, requires_grad=True)
    for a in (adv, adv.unsqueeze(1).expand(4, 3)):
        loss, stats = policy_loss(logprobs, torch.full((4, 3), NAN), a, mask, 0.2)
        assert torch.isfinite(loss)
        assert all(torch.isfinite(v) for v in vars(stats).values())


def test_policy_loss_errors():
    x = torch.zeros(2, 3)
    mask = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="cliprange"):
        policy_loss(x, x, torch.zeros(2), mask, -0.1)
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(x, x, torch.zeros(3), mask, 0.2)
    with pytest.raises(ValueError, match="mask"):
        policy_loss(x, x, torch.zeros(2), mask.float(), 0.2)
    with pytest.raises(ValueError, match="cliprange_high"):
        policy_loss(x, x, torch.zeros(2), mask, 0.2, cliprange_high=math.nan)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        policy_loss(x, x, torch.zeros(2), mask, 0.2, loss_agg_mode="sum")


# --- loss aggregation (verl's loss_agg_mode) ---------------------------------------------------------
AGG_LOSSES = torch.tensor([[1.0, 2.0, 3.0, NAN], [4.0, INF, NAN, NAN], [NAN, NAN, NAN, NAN]])
AGG_MASK = torch.tensor([[True, True, True, False], [True, False, False, False], [False] * 4])


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        # per-sequence sums [6, 4, 0] (the empty row counts), mean over 3 sequences = 10 / 3
        ("seq-mean-token-sum", 10 / 3),
        # 4 unmasked tokens 1 + 2 + 3 + 4 = 10, mean 10 / 4 = 2.5
        ("token-mean", 2.5),
        # per-sequence means [2, 4, 0], mean over 3 sequences = 2
        ("seq-mean-token-mean", 2.0),
        # per-sequence sums / T = [6/4, 4/4, 0], mean over 3 sequences = 2.5 / 3
        ("seq-mean-token-sum-norm", 2.5 / 3),
    ],
)
def test_agg_loss_hand_values(mode, expected):
    assert agg_loss(AGG_LOSSES, AGG_MASK, mode).item() == pytest.approx(expected)


def test_token_mean_with_a_mini_batch_token_count():
    # A mini-batch split into two micro-batches: rows 0-1 (4 tokens, sum 1+2+3+4 = 10) and a second one
    # with 2 tokens summing to 8. The mini-batch token mean is (10 + 8) / 6 = 3; the trainer averages the
    # two micro-batch losses, so each gets num_tokens = 6 / 2 = 3: (10 / 3 + 8 / 3) / 2 = 3.
    second = torch.tensor([[5.0, 3.0]])
    first_loss = agg_loss(AGG_LOSSES, AGG_MASK, "token-mean", num_tokens=3.0)
    second_loss = agg_loss(second, torch.ones(1, 2, dtype=torch.bool), "token-mean", num_tokens=3.0)
    assert ((first_loss + second_loss) / 2).item() == pytest.approx(3.0)
    # without it each micro-batch takes its own mean: (2.5 + 4) / 2 = 3.25, not the mini-batch's 3
    own = (
        agg_loss(AGG_LOSSES, AGG_MASK, "token-mean") + agg_loss(second, torch.ones(1, 2).bool(), "token-mean")
    ) / 2
    assert own.item() == pytest.approx(3.25)


def test_agg_loss_norm_uses_the_given_constant():
    # sums [6, 4, 0] / 10 = [0.6, 0.4, 0], mean over 3 sequences = 1 / 3
    assert agg_loss(AGG_LOSSES, AGG_MASK, "seq-mean-token-sum-norm", 10).item() == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        agg_loss(AGG_LOSSES, AGG_MASK, "seq-sum")


def test_default_mode_is_the_classic_sequence_ratio_bit_for_bit():
    g = torch.Generator().manual_seed(2)
    old = -torch.rand(6, 5, generator=g)
    new = (old + torch.randn(6, 5, generator=g) * 0.3).requires_grad_()
    mask = torch.arange(5) < torch.randint(1, 6, (6, 1), generator=g)
    adv = torch.randn(6, generator=g)
    loss, _ = policy_loss(new, old, adv, mask, 0.2)
    explicit, _ = policy_loss(
        new, old, adv, mask, 0.2, loss_agg_mode="seq-mean-token-sum", cliprange_high=0.2
    )
    # the classic formula written out: exp(sum new - sum old), PPO clip, mean over sequences
    ratio = torch.exp((new * mask).sum(1) - (old * mask).sum(1))
    classic = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2)).mean()
    assert torch.equal(loss, explicit)
    torch.testing.assert_close(loss, classic)


def test_token_modes_with_sequence_advantages_hand_values():
    # two sequences; ratio 1 everywhere (new == old), so each token's loss is -A_b
    new = torch.zeros(2, 3, requires_grad=True)
    mask = torch.tensor([[True, True, True], [True, False, False]])
    adv = torch.tensor([1.0, -2.0])
    # token losses: row 0 [-1, -1, -1], row 1 [2]
    cases = {
        "token-mean": (-3 + 2) / 4,  # 4 tokens: -0.25
        "seq-mean-token-mean": (-1 + 2) / 2,  # per-sequence means [-1, 2]: 0.5
        "seq-mean-token-sum-norm": (-3 / 3 + 2 / 3) / 2,  # sums [-3, 2] / T=3, mean: -1/6
    }
    for mode, expected in cases.items():
        loss, stats = policy_loss(new, torch.zeros(2, 3), adv, mask, 0.2, loss_agg_mode=mode)
        assert loss.item() == pytest.approx(expected), mode
        assert stats.ratio_mean.item() == 1.0  # stats over the 4 unmasked tokens
    # gradient of token-mean: d/dnew_t (-A_b * r_t) / 4 = -A_b / 4 -> row 0 -0.25, row 1 +0.5
    new.grad = None
    loss, _ = policy_loss(new, torch.zeros(2, 3), adv, mask, 0.2, loss_agg_mode="token-mean")
    loss.backward()
    torch.testing.assert_close(new.grad, torch.tensor([[-0.25, -0.25, -0.25], [0.5, 0.0, 0.0]]))


def test_asymmetric_clip_hand_values():
    # ratios e^0.25 = 1.28403 (A = 1) and e^-0.25 = 0.77880 (A = -1), cliprange 0.2, cliprange_high 0.28
    new = torch.tensor([[0.25], [-0.25]])
    old = torch.zeros(2, 1)
    mask = torch.ones(2, 1, dtype=torch.bool)
    adv = torch.tensor([1.0, -1.0])
    loss, stats = policy_loss(new, old, adv, mask, 0.2, cliprange_high=0.28)
    # row 0: 1.28403 > 1.28 -> clipped at the high bound: max(-1.28403, -1.28) = -1.28
    # row 1: 0.77880 < 0.8 -> clipped at the low bound: max(0.77880, 0.8) = 0.8
    assert loss.item() == pytest.approx((-1.28 + 0.8) / 2)
    assert stats.clip_high_frac.item() == 0.5 and stats.clip_low_frac.item() == 0.5
    # with cliprange_high 0.3 the upper bound 1.3 no longer binds: row 0 loss -1.28403
    loss, stats = policy_loss(new, old, adv, mask, 0.2, cliprange_high=0.3)
    assert loss.item() == pytest.approx((-math.exp(0.25) + 0.8) / 2)
    assert stats.clip_high_frac.item() == 0.0 and stats.clipfrac.item() == 0.5


def test_is_weights_scale_each_surrogate():
    new = torch.zeros(2, 2, requires_grad=True)
    mask = torch.tensor([[True, True], [True, False]])
    adv = torch.tensor([1.0, 1.0])
    # sequence ratio 1: losses [-1, -1], weights [2, 0.5] -> (-2 - 0.5) / 2 = -1.25
    loss, _ = policy_loss(new, torch.zeros(2, 2), adv, mask, 0.2, is_weights=torch.tensor([2.0, 0.5]))
    assert loss.item() == pytest.approx(-1.25)
    # token-level: token losses [[-1, -1], [-1]] x weights [[2, 0.5], [1]] summed per sequence [-2.5, -1],
    # mean -1.75; the weight at padding (NaN) is ignored
    w = torch.tensor([[2.0, 0.5], [1.0, NAN]])
    loss, _ = policy_loss(new, torch.zeros(2, 2), adv[:, None].expand(2, 2), mask, 0.2, is_weights=w)
    assert loss.item() == pytest.approx(-1.75)
    loss.backward()
    # weights are constants: d/dnew = -A * r * w per token, / 2 sequences
    torch.testing.assert_close(new.grad, torch.tensor([[-1.0, -0.25], [-0.5, 0.0]]))
    with pytest.raises(ValueError, match="is_weights"):
        policy_loss(new, torch.zeros(2, 2), adv, mask, 0.2, is_weights=w)  # per-token with a sequence ratio


def test_sequence_without_tokens_contributes_nothing():
    # row 1 has no completion token (a masked truncated completion): its loss is 0 rather than -A * 1,
    # it still counts in the mean over sequences, and the stats cover row 0 only
    new = torch.tensor([[0.1, 0.0], [5.0, 5.0]], requires_grad=True)
    mask = torch.tensor([[True, False], [False, False]])
    loss, stats = policy_loss(new, torch.zeros(2, 2), torch.tensor([1.0, 3.0]), mask, 0.2)
    assert loss.item() == pytest.approx(-math.exp(0.1) / 2)  # (-1 * e^0.1 + 0) / 2
    assert stats.ratio_mean.item() == pytest.approx(math.exp(0.1))
    loss.backward()
    assert new.grad[1].eq(0).all()


def test_kl_loss_hand_values_and_gradient():
    logp = torch.tensor([[-1.0, -2.0, 9.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0, NAN]])
    mask = torch.tensor([[True, True, False]])
    # k2 per token [0.125, 0.5]; seq-mean-token-sum: 0.625; token-mean: 0.3125
    assert kl_loss(logp, ref, mask, "k2").item() == pytest.approx(0.625)
    assert kl_loss(logp, ref, mask, "k2", "token-mean").item() == pytest.approx(0.3125)
    # k3 with d = ref - logp = [-0.5, 1]: [e^-0.5 - 1 + 0.5, e - 1 - 1], summed
    k3 = math.exp(-0.5) - 0.5 + math.e - 2
    loss = kl_loss(logp, ref, mask, "k3")
    assert loss.item() == pytest.approx(k3)
    loss.backward()
    # d k3 / d logp = 1 - e^(ref - logp) = [1 - e^-0.5, 1 - e]; padding 0
    torch.testing.assert_close(
        logp.grad, torch.tensor([[1 - math.exp(-0.5), 1 - math.e, 0.0]]), rtol=1e-6, atol=1e-6
    )


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_every_mode_ignores_garbage_at_padding(mode):
    mask = torch.tensor([[True, True, False], [True, False, False]])
    old = torch.tensor([[-1.0, -0.5, NAN], [-0.3, INF, -INF]])
    new = torch.tensor([[-0.9, -0.6, INF], [-0.2, NAN, 1e30]], requires_grad=True)
    loss, stats = policy_loss(new, old, torch.tensor([0.5, -1.0]), mask, 0.2, loss_agg_mode=mode)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(new.grad).all() and new.grad[~mask].eq(0).all()
    assert all(torch.isfinite(v) for v in vars(stats).values())


def test_token_level_forced_with_sequence_advantages():
    # one sequence, per-token log-ratios [0, ln 2], A = 1, cliprange 0.2
    new = torch.tensor([[0.0, math.log(2.0)]], requires_grad=True)
    old = torch.zeros(1, 2)
    mask = torch.ones(1, 2, dtype=torch.bool)
    adv = torch.tensor([1.0])
    # auto: one summed ratio e^(0 + ln 2) = 2 > 1.2 -> max(-2, -1.2) = -1.2
    auto, _ = policy_loss(new, old, adv, mask, 0.2)
    assert auto.item() == pytest.approx(-1.2)
    # token: ratios [1, 2] -> token losses [-1, max(-2, -1.2) = -1.2], summed -2.2
    loss, stats = policy_loss(new, old, adv, mask, 0.2, importance_sampling_level="token")
    assert loss.item() == pytest.approx(-2.2)
    assert stats.ratio_mean.item() == pytest.approx(1.5)  # over the 2 tokens
    assert stats.clipfrac.item() == pytest.approx(0.5)
    loss.backward()
    # token 0: d(-r)/dnew = -1; token 1 clipped -> 0
    torch.testing.assert_close(new.grad, torch.tensor([[-1.0, 0.0]]))


def test_gspo_sequence_ratio_hand_values():
    new = torch.tensor([[0.2, 0.0, NAN], [0.5, INF, 0.0]], requires_grad=True)
    old = torch.zeros(2, 3)
    mask = torch.tensor([[True, True, False], [True, False, False]])
    adv = torch.tensor([1.0, 2.0])
    # row 0: mean log-ratio (0.2 + 0) / 2 = 0.1 -> s0 = e^0.1 = 1.10517, inside [0.8, 1.2] -> -1.10517
    #        per token, 2 tokens; row 1: s1 = e^0.5 = 1.64872 > 1.2, A = 2 -> max(-3.297, -2.4) = -2.4
    s0, s1 = math.exp(0.1), math.exp(0.5)
    loss, stats = policy_loss(new, old, adv, mask, 0.2, importance_sampling_level="sequence")
    # seq-mean-token-sum: sums [-2 * s0, -2.4], mean over 2 sequences
    assert loss.item() == pytest.approx((-2 * s0 - 2.4) / 2)
    # the summed ratio would differ: row 0 e^0.2 = 1.2214 > 1.2 -> clipped
    auto, _ = policy_loss(new, old, adv, mask, 0.2)
    assert auto.item() == pytest.approx((-1.2 - 2.4) / 2)
    # stats over the 2 sequences
    assert stats.ratio_mean.item() == pytest.approx((s0 + s1) / 2)
    assert stats.approxkl.item() == pytest.approx(0.5 * (0.1**2 + 0.5**2) / 2)
    assert stats.clipfrac.item() == pytest.approx(0.5)
    assert stats.clip_high_frac.item() == pytest.approx(0.5)
    assert stats.ratio_min.item() == pytest.approx(s0) and stats.ratio_max.item() == pytest.approx(s1)
    loss.backward()
    # row 0 loss -2 * s0 with s0 = exp((new_00 + new_01) / 2): d/dnew_0t = -2 * s0 / 2 = -s0, / 2 sequences
    # row 1 is clipped -> 0; padding (NaN, INF) -> 0
    torch.testing.assert_close(new.grad, torch.tensor([[-s0 / 2, -s0 / 2, 0.0], [0.0, 0.0, 0.0]]))
    # token-mean over the 3 tokens: (-2 * s0 - 2.4) / 3
    loss, _ = policy_loss(
        new, old, adv, mask, 0.2, importance_sampling_level="sequence", loss_agg_mode="token-mean"
    )
    assert loss.item() == pytest.approx((-2 * s0 - 2.4) / 3)


def test_gspo_with_token_advantages_hand_values():
    # one sequence, both log-ratios 0.5: s = e^0.5 = 1.64872 for both tokens
    new = torch.tensor([[0.5, 0.5]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    adv = torch.tensor([[1.0, -2.0]])
    loss, stats = policy_loss(new, torch.zeros(1, 2), adv, mask, 0.2, importance_sampling_level="sequence")
    # token 0, A = 1: max(-1.64872, -1.2) = -1.2 (clipped high); token 1, A = -2: max(3.29744, 2.4) = 3.29744
    s = math.exp(0.5)
    assert loss.item() == pytest.approx(-1.2 + 2 * s)
    # clip fractions: the sequence's share of clipped tokens (1 of 2), averaged over the 1 sequence
    assert stats.clipfrac.item() == pytest.approx(0.5)
    assert stats.clip_high_frac.item() == pytest.approx(0.5)
    assert stats.clip_low_frac.item() == 0.0
    assert stats.ratio_mean.item() == pytest.approx(s)


def test_gspo_gradient_equals_sequence_level_at_ratio_one():
    g = torch.Generator().manual_seed(6)
    b, t = 5, 7
    old = -torch.rand(b, t, generator=g, dtype=torch.float64)
    mask = torch.arange(t) < torch.randint(1, t + 1, (b, 1), generator=g)
    adv = torch.randn(b, generator=g, dtype=torch.float64)
    new = old.clone().requires_grad_()
    loss, _ = policy_loss(new, old, adv, mask, 0.2, importance_sampling_level="sequence")
    loss.backward()
    # row loss -A * n_b * s_b, ds_b/dnew = s_b / n_b = 1 / n_b at s_b = 1: -A_b per token, / B sequences
    expected = torch.where(mask, -adv.unsqueeze(1) / b, torch.zeros_like(old))
    torch.testing.assert_close(new.grad, expected)


def test_gspo_is_weights_per_sequence_and_per_token():
    new = torch.zeros(2, 2)
    old = torch.zeros(2, 2)
    mask = torch.tensor([[True, True], [True, False]])
    adv = torch.tensor([1.0, 1.0])
    # s = 1 everywhere: token losses [[-1, -1], [-1]]
    # (B,) weights [2, 0.5]: sums [-4, -0.5], mean -2.25
    loss, _ = policy_loss(
        new, old, adv, mask, 0.2, importance_sampling_level="sequence", is_weights=torch.tensor([2.0, 0.5])
    )
    assert loss.item() == pytest.approx(-2.25)
    # (B, T) weights [[2, 0.5], [1, NaN at padding]]: sums [-2.5, -1], mean -1.75
    w = torch.tensor([[2.0, 0.5], [1.0, NAN]])
    loss, _ = policy_loss(new, old, adv, mask, 0.2, importance_sampling_level="sequence", is_weights=w)
    assert loss.item() == pytest.approx(-1.75)


def _three_cases():
    # per-sequence ratios [5, 2, 5] with A = [-1, -1, 1], one token each
    new = torch.tensor([[math.log(5.0)], [math.log(2.0)], [math.log(5.0)]], requires_grad=True)
    return new, torch.zeros(3, 1), torch.tensor([-1.0, -1.0, 1.0]), torch.ones(3, 1, dtype=torch.bool)


@pytest.mark.parametrize("level", ["auto", "token", "sequence"])
def test_dual_clip_hand_values(level):
    new, old, adv, mask = _three_cases()
    # plain PPO: A=-1, r=5: max(5, 0.8) = 5; A=-1, r=2: 2; A=1, r=5: max(-5, -1.2) = -1.2
    plain, stats = policy_loss(new, old, adv, mask, 0.2, importance_sampling_level=level)
    assert plain.item() == pytest.approx((5 + 2 - 1.2) / 3)
    assert stats.dual_clip_frac.item() == 0.0
    # dual clip c = 3: A < 0 entries bounded by -A * 3 = 3: [min(5, 3), min(2, 3), -1.2] = [3, 2, -1.2]
    loss, stats = policy_loss(new, old, adv, mask, 0.2, importance_sampling_level=level, clip_ratio_c=3.0)
    assert loss.item() == pytest.approx((3 + 2 - 1.2) / 3)
    assert stats.dual_clip_frac.item() == pytest.approx(1 / 3)
    loss.backward()
    # row 0 at the constant bound and row 2 clipped: no gradient; row 1: d(-A r)/dnew = r = 2, / 3
    torch.testing.assert_close(new.grad, torch.tensor([[0.0], [2 / 3], [0.0]]))


@pytest.mark.parametrize("level", ["auto", "token", "sequence"])
def test_delta_caps_the_unclipped_ratio(level):
    new, old, adv, mask = _three_cases()
    loss, stats = policy_loss(new, old, adv, mask, 0.2, importance_sampling_level=level, delta=3.0)
    # A=-1, r=5: max(-A * min(5, 3), -A * clip(5)) = max(3, 1.2) = 3; A=-1, r=2: max(2, 1.2) = 2;
    # A=1, r=5: max(-3, -1.2) = -1.2
    assert loss.item() == pytest.approx((3 + 2 - 1.2) / 3)
    # the clipped side is active only for row 2 (-1.2 > -3)
    assert stats.clipfrac.item() == pytest.approx(1 / 3)
    assert stats.dual_clip_frac.item() == 0.0
    loss.backward()
    # row 0: the capped ratio is constant -> 0; row 1: r = 2 -> 2 / 3; row 2 clipped -> 0
    torch.testing.assert_close(new.grad, torch.tensor([[0.0], [2 / 3], [0.0]]))


def test_delta_with_a_wide_clip_higher():
    # cliprange 0.2, cliprange_high 3.0 (so delta must exceed 4), delta 4.5; A = -1, r = e^1.6 = 4.953
    # unclipped: -A * min(4.953, 4.5) = 4.5; clipped: -A * clamp(4.953, 0.8, 4.0) = 4.0 -> 4.5
    new = torch.tensor([[1.6]])
    loss, _ = policy_loss(
        new,
        torch.zeros(1, 1),
        torch.tensor([-1.0]),
        torch.ones(1, 1, dtype=torch.bool),
        0.2,
        cliprange_high=3.0,
        delta=4.5,
    )
    assert loss.item() == pytest.approx(4.5)


def test_new_options_errors():
    x = torch.zeros(2, 3)
    mask = torch.ones(2, 3, dtype=torch.bool)
    adv = torch.zeros(2)
    with pytest.raises(ValueError, match="importance_sampling_level"):
        policy_loss(x, x, adv, mask, 0.2, importance_sampling_level="seq")
    with pytest.raises(ValueError, match="clip_ratio_c"):
        policy_loss(x, x, adv, mask, 0.2, clip_ratio_c=1.0)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        policy_loss(x, x, adv, mask, 0.2, clip_ratio_c=math.inf)
    # delta must exceed 1 + cliprange_high = 1.28
    with pytest.raises(ValueError, match="delta"):
        policy_loss(x, x, adv, mask, 0.2, cliprange_high=0.28, delta=1.28)
    with pytest.raises(ValueError, match="delta"):
        policy_loss(x, x, adv, mask, 0.2, delta=math.nan)
    # per-token weights are fine with the sequence level, not with the summed ratio
    policy_loss(x, x, adv, mask, 0.2, importance_sampling_level="sequence", is_weights=torch.ones(2, 3))
    with pytest.raises(ValueError, match="is_weights"):
        policy_loss(x, x, adv, mask, 0.2, is_weights=torch.ones(2, 3))
    assert IMPORTANCE_SAMPLING_LEVELS == ("auto", "token", "sequence")


@pytest.mark.parametrize("level", IMPORTANCE_SAMPLING_LEVELS)
@pytest.mark.parametrize("adv_dim", [1, 2])
def test_every_level_ignores_garbage_at_padding_with_all_options(level, adv_dim):
    mask = torch.tensor([[True, True, False], [True, False, False], [False, False, False]])
    old = torch.tensor([[-1.0, -0.5, NAN], [-0.3, INF, -INF], [NAN, NAN, NAN]])
    new = torch.tensor([[0.9, -0.6, INF], [-0.2, NAN, 1e30], [INF, NAN, -INF]], requires_grad=True)
    adv = torch.tensor([0.5, -1.0, 2.0])
    if adv_dim == 2:
        adv = torch.tensor([[0.5, -0.4, NAN], [-1.0, INF, NAN], [NAN, NAN, NAN]])
    w = torch.tensor([1.0, 2.0, 3.0]) if adv_dim == 1 else None
    loss, stats = policy_loss(
        new, old, adv, mask, 0.2, importance_sampling_level=level, clip_ratio_c=3.0, delta=2.0, is_weights=w
    )
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(new.grad).all() and new.grad[~mask].eq(0).all()
    assert all(torch.isfinite(v) for v in vars(stats).values())


def test_gspo_ratio_over_the_whole_completion_while_the_loss_trains_some_tokens() -> None:
    # one completion of 3 tokens, log-ratios 0.3, 0.0, -0.6: over all of them the mean is -0.1, so
    # s = e^-0.1 = 0.9048; over the first token alone it would be e^0.3. The loss trains token 0 only
    # (a top-entropy mask): A = 1, seq-mean-token-sum -> loss = -A * s = -0.9048 (inside the clip range)
    new = torch.tensor([[0.3, 0.0, -0.6]], requires_grad=True)
    old = torch.zeros(1, 3)
    trained = torch.tensor([[True, False, False]])
    whole = torch.ones(1, 3, dtype=torch.bool)
    adv = torch.tensor([1.0])
    loss, _ = policy_loss(new, old, adv, trained, 0.2, importance_sampling_level="sequence", ratio_mask=whole)
    assert loss.item() == pytest.approx(-math.exp(-0.1), rel=1e-6)
    without, _ = policy_loss(new, old, adv, trained, 0.2, importance_sampling_level="sequence")
    # the ratio of the trained token alone, e^0.3 = 1.35, is clipped at 1.2: loss -1.2
    assert without.item() == pytest.approx(-1.2, rel=1e-6)
    with pytest.raises(ValueError, match="ratio_mask must be a bool tensor"):
        policy_loss(
            new, old, adv, trained, 0.2, importance_sampling_level="sequence", ratio_mask=whole.float()
        )
