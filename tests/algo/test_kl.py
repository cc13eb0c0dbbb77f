import math

import pytest
import torch

from rloo.algo import KL_ESTIMATORS, per_token_kl, sequence_kl


def test_k1_and_k3_hand_values():
    logp = torch.tensor([[-1.0, -2.0]])
    ref = torch.tensor([[-1.5, -1.0]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    # k1 = logp - ref = [-1 + 1.5, -2 + 1] = [0.5, -1]
    torch.testing.assert_close(per_token_kl(logp, ref, mask, "k1"), torch.tensor([[0.5, -1.0]]))
    # d = ref - logp = [-0.5, 1]: k3 = e^d - 1 - d = [e^-0.5 - 0.5, e - 2]
    expected = torch.tensor([[math.exp(-0.5) - 0.5, math.e - 2.0]])
    torch.testing.assert_close(per_token_kl(logp, ref, mask, "k3"), expected)
    # the default estimator is k1
    torch.testing.assert_close(per_token_kl(logp, ref, mask), torch.tensor([[0.5, -1.0]]))


@pytest.mark.parametrize("estimator", ["k1", "k3"])  # k2 is biased: see test_k2_hand_values_and_bias
def test_estimators_are_unbiased_in_exact_expectation(estimator):
    # E_{x~p}[estimate(x)] summed exactly over the vocabulary must be KL(p || q)
    g = torch.Generator().manual_seed(0)
    logp = torch.log_softmax(torch.randn(6, generator=g, dtype=torch.float64), -1)
    logq = torch.log_softmax(torch.randn(6, generator=g, dtype=torch.float64), -1)
    kl = (logp.exp() * (logp - logq)).sum()
    est = per_token_kl(logp[None], logq[None], torch.ones(1, 6, dtype=torch.bool), estimator)[0]
    torch.testing.assert_close((logp.exp() * est).sum(), kl)


def test_k2_hand_values_and_bias():
    logp = torch.tensor([[-1.0, -2.0]])
    ref = torch.tensor([[-1.5, -1.0]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    # logp - ref = [0.5, -1]: k2 = 0.5 * [0.25, 1] = [0.125, 0.5]
    torch.testing.assert_close(per_token_kl(logp, ref, mask, "k2"), torch.tensor([[0.125, 0.5]]))
    # Exact expectation over a 2-token vocabulary p = [0.5, 0.5], q = [0.25, 0.75]:
    # KL = 0.5 ln 2 + 0.5 ln(2/3) = 0.5 ln(4/3) = 0.143841
    # E[k2] = 0.5 * (0.5 * ln(2)^2 + 0.5 * ln(2/3)^2) = 0.25 * (0.480453 + 0.164402) = 0.161214: biased
    p, q = torch.tensor([0.5, 0.5], dtype=torch.float64), torch.tensor([0.25, 0.75], dtype=torch.float64)
    k2 = per_token_kl(p.log()[None], q.log()[None], torch.ones(1, 2, dtype=torch.bool), "k2")[0]
    expected = 0.25 * (math.log(2) ** 2 + math.log(2 / 3) ** 2)
    assert (p * k2).sum().item() == pytest.approx(expected)
    assert expected != pytest.approx(0.5 * math.log(4 / 3))


def test_k2_gradient_is_the_log_ratio():
    # d/dlogp 0.5 (logp - ref)^2 = logp - ref: [0.5, -1], and 0 at padding
    logp = torch.tensor([[-1.0, -2.0, 7.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0, math.nan]])
    mask = torch.tensor([[True, True, False]])
    per_token_kl(logp, ref, mask, "k2").sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.5, -1.0, 0.0]]))


@pytest.mark.parametrize("estimator", ["k2", "k3"])
def test_k2_and_k3_are_non_negative(estimator):
    g = torch.Generator().manual_seed(1)
    logp, ref = torch.randn(5, 8, generator=g), torch.randn(5, 8, generator=g)
    assert (per_token_kl(logp, ref, torch.ones(5, 8, dtype=torch.bool), estimator) >= 0).all()


def test_k3_is_non_negative():
    g = torch.Generator().manual_seed(1)
    logp, ref = torch.randn(5, 8, generator=g), torch.randn(5, 8, generator=g)
    assert (per_token_kl(logp, ref, torch.ones(5, 8, dtype=torch.bool), "k3") >= 0).all()


@pytest.mark.parametrize("estimator", KL_ESTIMATORS)
def test_masked_positions_are_exactly_zero_with_garbage(estimator):
    logp = torch.tensor([[-1.0, math.inf, math.nan], [-0.5, -math.inf, 0.0]], requires_grad=True)
    ref = torch.tensor([[-2.0, -math.inf, 1.0], [-0.5, math.inf, math.nan]])
    mask = torch.tensor([[True, False, False], [True, False, False]])
    kl = per_token_kl(logp, ref, mask, estimator)
    assert kl[~mask].eq(0).all()
    assert torch.isfinite(kl).all()
    kl.sum().backward()
    assert torch.isfinite(logp.grad).all()
    assert logp.grad[~mask].eq(0).all()


def test_unknown_estimator_raises():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="estimator"):
        per_token_kl(x, x, torch.ones(1, 2, dtype=torch.bool), "k4")


def test_sequence_kl_hand_values():
    kl = torch.tensor([[0.1, 0.2, 9.0], [0.3, math.nan, 0.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    # [0.1 + 0.2, 0.3]
    torch.testing.assert_close(sequence_kl(kl, mask), torch.tensor([0.3, 0.3]))
