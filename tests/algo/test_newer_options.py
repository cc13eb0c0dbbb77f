"""The newer algorithm options' formulas on hand-computed values: CISPO, SAPO and GMPO surrogates, off-policy
sequence masking, the bias-corrected KL, per-source reward normalisation (GDPO) and adaptive entropy
control. Each expected number is worked out in the comment beside it, not read from the code."""

from __future__ import annotations

import math

import pytest
import torch

from rloo import algo


def _leaf(values: list[list[float]]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64, requires_grad=True)


def test_cispo_on_the_summed_sequence_ratio() -> None:
    # b0: new sums to -2, old to -2.5 -> ratio e^0.5 = 1.65 > cap 1.5 -> weight 1.5; b1: ratio 1, weight 1
    new = _leaf([[-1.0, -1.0], [-0.5, -0.5]])
    old = torch.tensor([[-1.5, -1.0], [-0.5, -0.5]], dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    mask = torch.ones(2, 2, dtype=torch.bool)
    loss, st = algo.policy_loss(new, old, adv, mask, 0.2, loss_type="cispo", cispo_max=1.5)
    # loss_b = -w A sum(logp): b0 -1.5 * 1 * -2 = 3, b1 -1 * -1 * -1 = -1; mean 1
    assert loss.item() == pytest.approx(1.0)
    loss.backward()
    # the weight is a constant: d/dlogp = -w A / B -> b0 -0.75 per token, b1 +0.5 per token
    assert new.grad.flatten().tolist() == pytest.approx([-0.75, -0.75, 0.5, 0.5])
    assert st.clipfrac.item() == pytest.approx(0.5)  # b0's weight was capped


def test_cispo_per_token_keeps_the_gradient_where_ppo_clips() -> None:
    # one token with ratio 2 and A > 0: PPO's clip (0.2) zeroes its gradient, CISPO's cap (5) does not
    new = _leaf([[math.log(0.5)]])
    old = torch.tensor([[math.log(0.25)]], dtype=torch.float64)
    adv = torch.tensor([1.0], dtype=torch.float64)
    mask = torch.ones(1, 1, dtype=torch.bool)
    ppo, _ = algo.policy_loss(new, old, adv, mask, 0.2, loss_agg_mode="token-mean")
    (g_ppo,) = torch.autograd.grad(ppo, new)
    assert g_ppo.item() == 0.0
    cispo, _ = algo.policy_loss(new, old, adv, mask, 0.2, loss_agg_mode="token-mean", loss_type="cispo")
    (g_cispo,) = torch.autograd.grad(cispo, new)
    assert g_cispo.item() == pytest.approx(-2.0)  # -sg(min(2, 5)) * A


def test_sapo_soft_gate_values_and_its_gradient_at_ratio_one() -> None:
    # token 0: ratio 1.2, A = 1, tau_pos 1 -> -4 sigmoid(0.2); token 1: ratio 0.9, A = -1, tau_neg 1.05 ->
    # +(4 / 1.05) sigmoid(-0.105); token-mean over the two
    new = _leaf([[math.log(1.2)], [math.log(0.9)]])
    old = torch.zeros(2, 1, dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    mask = torch.ones(2, 1, dtype=torch.bool)
    loss, st = algo.policy_loss(new, old, adv, mask, 0.2, loss_agg_mode="token-mean", loss_type="sapo")
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    expected = (-4 * sig(0.2) + 4 / 1.05 * sig(-0.105)) / 2
    assert loss.item() == pytest.approx(expected)
    assert st.clipfrac.item() == 0.0  # a soft gate clips nothing
    # at ratio 1 the gate's slope is tau * 1/4 * 4 / tau = 1: the gradient is PPO's, -A / n
    at_one = _leaf([[0.0], [0.0]])
    sapo, _ = algo.policy_loss(at_one, old, adv, mask, 0.2, loss_agg_mode="token-mean", loss_type="sapo")
    (g,) = torch.autograd.grad(sapo, at_one)
    assert g.flatten().tolist() == pytest.approx([-0.5, 0.5])


@pytest.mark.parametrize(
    ("a", "loss", "grad", "clipped"),
    [
        # A = 1: min(l, clip(l)) = [min(0.5, 0.2), min(-0.5, -0.2)] = [0.2, -0.5]; mean -0.15 -> -e^-0.15;
        # token 0 is clipped (no gradient), token 1: -A e^-0.15 / 2
        (1.0, -math.exp(-0.15), [0.0, -math.exp(-0.15) / 2], 0.5),
        # A = -1: -min(-l, -clip(l)) = [0.5, -0.2]; mean 0.15 -> +e^0.15; token 1 clipped, token 0: e^0.15 / 2
        (-1.0, math.exp(0.15), [math.exp(0.15) / 2, 0.0], 0.5),
    ],
)
def test_gmpo_geometric_mean_of_log_clipped_ratios(
    a: float, loss: float, grad: list[float], clipped: float
) -> None:
    new = _leaf([[0.5, -0.5]])
    old = torch.zeros(1, 2, dtype=torch.float64)
    mask = torch.ones(1, 2, dtype=torch.bool)
    adv = torch.tensor([a], dtype=torch.float64)
    out, st = algo.policy_loss(
        new, old, adv, mask, 0.2, loss_agg_mode="seq-mean-token-mean", loss_type="gmpo"
    )
    assert out.item() == pytest.approx(loss)
    (g,) = torch.autograd.grad(out, new)
    assert g.flatten().tolist() == pytest.approx(grad)
    assert st.clipfrac.item() == pytest.approx(clipped)


def test_gmpo_ignores_padding_and_refuses_ppo_only_bounds() -> None:
    new = _leaf([[0.1, 99.0]])
    old = torch.tensor([[0.0, -99.0]], dtype=torch.float64)
    mask = torch.tensor([[True, False]])
    adv = torch.tensor([2.0], dtype=torch.float64)
    out, _ = algo.policy_loss(new, old, adv, mask, 0.2, loss_agg_mode="seq-mean-token-mean", loss_type="gmpo")
    assert out.item() == pytest.approx(-2 * math.exp(0.1))  # the padded token is out of the mean
    with pytest.raises(ValueError, match="delta and clip_ratio_c bound PPO"):
        algo.policy_loss(new, old, adv, mask, 0.2, loss_type="gmpo", clip_ratio_c=3.0)
    with pytest.raises(ValueError, match="loss_type must be one of"):
        algo.policy_loss(new, old, adv, mask, 0.2, loss_type="vespo")
    with pytest.raises(ValueError, match="cispo_max must be a finite number > 1"):
        algo.policy_loss(new, old, adv, mask, 0.2, loss_type="cispo", cispo_max=0.28)
    # the other surrogates ignore CISPO's cap (a run passes --cliprange_high whatever its loss)
    algo.policy_loss(new, old, adv, mask, 0.2, loss_type="clip", cispo_max=0.28)


def test_clip_is_unchanged_by_the_new_surrogates() -> None:
    """The default ``clip`` is the classic loss, bit for bit (the surrogates only add paths)."""
    g = torch.Generator().manual_seed(0)
    new = torch.randn(4, 5, generator=g, dtype=torch.float64)
    old = new + 0.1 * torch.randn(4, 5, generator=g, dtype=torch.float64)
    adv = torch.randn(4, generator=g, dtype=torch.float64)
    mask = torch.rand(4, 5, generator=g) > 0.3
    for agg in algo.LOSS_AGG_MODES:
        a, _ = algo.policy_loss(new, old, adv, mask, 0.2, loss_agg_mode=agg)
        b, _ = algo.policy_loss(new, old, adv, mask, 0.2, loss_agg_mode=agg, loss_type="clip")
        assert torch.equal(a, b)


def test_off_policy_sequence_mask_drops_drifted_negative_sequences_only() -> None:
    # drift = sampler - current: 0.8 per token for b0 and b1, 0 for b2; threshold 0.5
    current = torch.full((3, 2), -1.0)
    sampler = torch.tensor([[-0.2, -0.2], [-0.2, -0.2], [-1.0, -1.0]])
    mask = torch.ones(3, 2, dtype=torch.bool)
    adv = torch.tensor([1.0, -1.0, -1.0])
    keep = algo.off_policy_sequence_mask(adv, current, sampler, mask, 0.5)
    assert keep.tolist() == [True, False, True]  # b0: A >= 0; b1: A < 0 and drifted; b2: on policy
    # padding's garbage is no drift: b1's second token masked leaves a mean of 0.8 - still dropped; with
    # its first token masked instead the mean is over nothing: 0 and kept
    keep = algo.off_policy_sequence_mask(
        adv,
        current,
        torch.tensor([[0.0, 0.0], [-0.2, 50.0], [50.0, -1.0]]),
        torch.tensor([[1, 1], [1, 0], [0, 1]]).bool(),
        0.5,
    )
    assert keep.tolist() == [True, False, True]


def test_bias_corrected_kl_weighs_each_token_by_the_ratio() -> None:
    # k3 at p = 0.5, ref = 0.25: 0.5 - ln 0.5 - 1 = 0.19315; times the ratio 2
    lp = torch.tensor([[math.log(0.5)]], dtype=torch.float64)
    ref = torch.tensor([[math.log(0.25)]], dtype=torch.float64)
    mask = torch.ones(1, 1, dtype=torch.bool)
    plain = algo.kl_loss(lp, ref, mask, "k3")
    assert plain.item() == pytest.approx(0.5 + math.log(2) - 1)
    weighted = algo.kl_loss(lp, ref, mask, "k3", importance_ratio=torch.tensor([[2.0]], dtype=torch.float64))
    assert weighted.item() == pytest.approx(2 * (0.5 + math.log(2) - 1))
    # the ratio pi/pi_old carries the gradient too: at ratio 1, d/dlogp (r * k3) = k3 + dk3/dlogp
    x = torch.tensor([[math.log(0.5)]], dtype=torch.float64, requires_grad=True)
    ratio = torch.exp(x - x.detach())  # value 1, gradient 1
    (g,) = torch.autograd.grad(algo.kl_loss(x, ref, mask, "k3", importance_ratio=ratio), x)
    k3 = 0.5 + math.log(2) - 1
    dk3 = -0.5 + 1  # d/dlogp [exp(ref - logp) - (ref - logp) - 1] = -exp(ref - logp) + 1
    assert g.item() == pytest.approx(k3 + dk3)


def test_each_reward_source_normalised_within_its_group() -> None:
    # one group of K = 3; source 0 = [0, 1, 2] -> mean 1, std 1 -> [-1, 0, 1] / (1 + 1e-4);
    # source 1 = [10, 10, None] -> std 0 -> [0, 0, NaN]; a second group of constants -> zeros
    per_source = torch.tensor(
        [[0.0, 10.0], [1.0, 10.0], [2.0, math.nan], [5.0, 1.0], [5.0, 1.0], [5.0, 1.0]], dtype=torch.float64
    )
    out = algo.normalize_reward_sources(per_source, 3)
    d = 1 + 1e-4
    assert out[:, 0].tolist() == pytest.approx([-1 / d, 0.0, 1 / d, 0.0, 0.0, 0.0])
    assert out[:2, 1].tolist() == [0.0, 0.0] and math.isnan(out[2, 1].item())
    # then the weighted sum skips the NaN as for raw scores: a large-scale source no longer dominates
    combined, valid = algo.combine_reward_sources(out, torch.tensor([1.0, 1.0], dtype=torch.float64))
    assert combined[:3].tolist() == pytest.approx([-1 / d, 0.0, 1 / d]) and bool(valid.all())
    with pytest.raises(ValueError, match="k must be >= 1 and divide"):
        algo.normalize_reward_sources(per_source, 4)


def test_adaptive_entropy_coefficient_steps() -> None:
    kw = dict(target=0.2, delta=0.05, coef_min=0.0, coef_max=0.12)
    assert algo.next_entropy_coef(0.1, 0.1, **kw) == pytest.approx(0.12)  # below target: up, to the ceiling
    assert algo.next_entropy_coef(0.1, 0.2, **kw) == pytest.approx(0.12)  # at the target counts as below
    assert algo.next_entropy_coef(0.1, 0.3, **kw) == pytest.approx(0.05)  # above: down by delta
    assert algo.next_entropy_coef(0.02, 0.3, **kw) == 0.0  # not below the floor
    assert algo.next_entropy_coef(0.07, math.nan, **kw) == 0.07  # nothing measured: unchanged
    assert algo.applied_entropy_coef(0.07, math.inf, 0.2) == 0.0  # before any measurement: off
    assert algo.applied_entropy_coef(0.07, 0.15, 0.2) == 0.07  # at or below the target: on
    assert algo.applied_entropy_coef(0.07, 0.25, 0.2) == 0.0  # above: off
    with pytest.raises(ValueError):
        algo.next_entropy_coef(0.1, 0.1, target=0.2, delta=0.05, coef_min=0.5, coef_max=0.1)
