import math

import pytest
import torch

from rloo.algo import (
    entropy_from_logits,
    entropy_quantile_threshold,
    entropy_with_grad,
    selective_log_softmax,
    top_entropy_mask,
)


def _reference(logits, index):
    return torch.log_softmax(logits, dim=-1).gather(-1, index.unsqueeze(-1)).squeeze(-1)


def test_selective_log_softmax_hand_value():
    logits = torch.tensor([[[0.0, math.log(3.0)]]])  # probs [1/4, 3/4]
    out = selective_log_softmax(logits, torch.tensor([[1]]))
    assert out.shape == (1, 1)
    assert out.item() == pytest.approx(math.log(0.75))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_selective_log_softmax_matches_full_log_softmax(dtype):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 5, 11, generator=g) * 4).to(dtype).requires_grad_()
    index = torch.randint(0, 11, (3, 5), generator=g)
    out = selective_log_softmax(logits, index)
    assert out.dtype == dtype
    expected = _reference(logits, index)
    torch.testing.assert_close(out, expected)
    # same gradient as the full log_softmax
    w = torch.randn(3, 5, generator=g, dtype=dtype)
    (grad,) = torch.autograd.grad((out * w).sum(), logits)
    (expected_grad,) = torch.autograd.grad((expected * w).sum(), logits)
    torch.testing.assert_close(grad, expected_grad)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_selective_log_softmax_half_precision_is_float32_exact(dtype):
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(2, 4, 50, generator=g) * 5).to(dtype)
    index = torch.randint(0, 50, (2, 4), generator=g)
    out = selective_log_softmax(logits, index)
    assert out.dtype == torch.float32
    # computed on the upcast logits, so it matches the float32 reference tightly (not bf16 rounding)
    torch.testing.assert_close(out, _reference(logits.float(), index), atol=1e-6, rtol=1e-6)


def test_selective_log_softmax_gradient_is_exact_and_masked_vocab_safe():
    # float64 gradcheck against finite differences, with repeated token ids across rows
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 3, 7, generator=g, dtype=torch.float64, requires_grad=True)
    index = torch.tensor([[1, 1, 6], [0, 3, 1]])
    assert torch.autograd.gradcheck(lambda x: selective_log_softmax(x, index), (logits,))
    # a vocabulary entry masked to -inf gets probability 0 and gradient 0, never NaN
    masked = torch.randn(1, 2, 5, generator=g).index_fill(-1, torch.tensor([4]), float("-inf"))
    masked.requires_grad_()
    out = selective_log_softmax(masked, torch.tensor([[0, 2]]))
    (grad,) = torch.autograd.grad(out.sum(), masked)
    assert torch.isfinite(grad).all() and (grad[..., 4] == 0).all()
    # d/dlogit_j of log p_i = 1[j == i] - p_j: each row's gradient sums to 0
    torch.testing.assert_close(grad.sum(-1), torch.zeros(1, 2), atol=1e-6, rtol=0)


def test_selective_log_softmax_shape_error():
    with pytest.raises(ValueError, match="index"):
        selective_log_softmax(torch.zeros(2, 3, 4), torch.zeros(2, 4, dtype=torch.long))


def test_entropy_hand_values():
    # uniform over 4 -> ln 4; one certain token (others -inf) -> 0, and no NaN from 0 * -inf
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [5.0, -math.inf, -math.inf, -math.inf]])
    torch.testing.assert_close(entropy_from_logits(logits), torch.tensor([math.log(4.0), 0.0]))
    # probs [1/4, 3/4]: -(1/4 ln 1/4 + 3/4 ln 3/4)
    two = torch.tensor([0.0, math.log(3.0)])
    expected = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    assert entropy_from_logits(two).item() == pytest.approx(expected)


def test_entropy_matches_definition_on_random_and_keeps_shape():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 70, 9, generator=g, dtype=torch.float64) * 3  # 210 rows > one chunk
    p = torch.softmax(logits, -1)
    expected = -(p * torch.log_softmax(logits, -1)).sum(-1)
    out = entropy_from_logits(logits)
    assert out.shape == (3, 70)
    torch.testing.assert_close(out, expected)
    half = entropy_from_logits(logits.to(torch.bfloat16))
    assert half.dtype == torch.float32
    torch.testing.assert_close(half, entropy_from_logits(logits.to(torch.bfloat16).float()))


def _plain_entropy(logits):
    return -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)


def test_entropy_with_grad_hand_values_and_gradient():
    # probs [1/4, 3/4] (logits [0, ln 3]): H = -(1/4 ln 1/4 + 3/4 ln 3/4) = 0.34657 + 0.21576 = 0.56233
    # dH/dz_j = -p_j (ln p_j + H): z_0: -1/4 (-1.38629 + 0.56233) = 0.20599; z_1: -3/4 (-0.28768 + 0.56233)
    # = -0.20599 (the two sum to 0: adding a constant to every logit changes nothing)
    h = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    two = torch.tensor([[0.0, math.log(3.0)]], requires_grad=True)
    out = entropy_with_grad(two)
    assert out.item() == pytest.approx(h)
    out.sum().backward()
    g0 = -0.25 * (math.log(0.25) + h)
    g1 = -0.75 * (math.log(0.75) + h)
    torch.testing.assert_close(two.grad, torch.tensor([[g0, g1]]))
    assert g0 == pytest.approx(-g1)
    # uniform over 4: H = ln 4, the maximum, so the gradient -1/4 (ln 1/4 + ln 4) = 0
    # one certain token (others -inf): H = 0 and a finite gradient, 0 at the -inf entries
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [5.0, -math.inf, -math.inf, -math.inf]], requires_grad=True)
    out = entropy_with_grad(logits)
    torch.testing.assert_close(out, torch.tensor([math.log(4.0), 0.0]), atol=1e-6, rtol=0)
    out.sum().backward()
    torch.testing.assert_close(logits.grad, torch.zeros(2, 4), atol=1e-6, rtol=0)


def test_entropy_with_grad_gradcheck_and_chunks_match_autograd():
    g = torch.Generator().manual_seed(3)
    small = torch.randn(2, 3, 7, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(entropy_with_grad, (small,))
    # 210 rows span two chunks: values and gradient equal autograd through the plain formula
    logits = (torch.randn(3, 70, 9, generator=g, dtype=torch.float64) * 3).requires_grad_()
    w = torch.randn(3, 70, generator=g, dtype=torch.float64)
    out = entropy_with_grad(logits)
    assert out.shape == (3, 70)
    (grad,) = torch.autograd.grad((out * w).sum(), logits)
    expected = _plain_entropy(logits)
    (expected_grad,) = torch.autograd.grad((expected * w).sum(), logits)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(grad, expected_grad)


def test_entropy_with_grad_half_precision():
    g = torch.Generator().manual_seed(4)
    logits32 = torch.randn(2, 5, 33, generator=g) * 4
    logits = logits32.to(torch.bfloat16).requires_grad_()
    out = entropy_with_grad(logits)
    # float32 math on the upcast logits, like entropy_from_logits
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, entropy_from_logits(logits.detach()))
    out.sum().backward()
    assert logits.grad.dtype == torch.bfloat16
    up = logits.detach().float().requires_grad_()
    (expected,) = torch.autograd.grad(_plain_entropy(up).sum(), up)
    torch.testing.assert_close(logits.grad, expected.to(torch.bfloat16))  # bf16 tolerances


# 10 completion tokens with entropies 0.1 .. 1.0, and padding holding larger entropies
ENTROPY = torch.tensor([[0.1, 0.2, 0.3, 0.4, 0.5, 9.0], [0.6, 0.7, 0.8, 0.9, 1.0, 9.0]], dtype=torch.float64)
ENTROPY_MASK = torch.tensor([[True] * 5 + [False], [True] * 5 + [False]])


def test_top_entropy_mask_keeps_the_top_quantile():
    # quantile 0.2 -> the 0.8 quantile of the 10 values: rank 0.8 * 9 = 7.2, between sorted[7] = 0.8 and
    # sorted[8] = 0.9: 0.8 + 0.2 * 0.1 = 0.82 -> keeps 0.9 and 1.0 (the top 20%), never the padding's 9.0
    kept, threshold = top_entropy_mask(ENTROPY, ENTROPY_MASK, 0.2)
    assert threshold.item() == pytest.approx(0.82)
    expected = torch.zeros(2, 6, dtype=torch.bool)
    expected[1, 3:5] = True
    torch.testing.assert_close(kept, expected)
    # quantile 0.5 -> the median: rank 4.5, 0.5 + 0.5 * 0.1 = 0.55 -> keeps 0.6 .. 1.0 (5 tokens)
    kept, threshold = top_entropy_mask(ENTROPY, ENTROPY_MASK, 0.5)
    assert threshold.item() == pytest.approx(0.55)
    assert kept.sum().item() == 5 and kept[1, :5].all()


def test_top_entropy_mask_given_threshold_quantile_one_and_empty_mask():
    # a threshold from every rank's tokens wins over this call's: 0.35 keeps 0.4 .. 1.0 (7 tokens)
    kept, threshold = top_entropy_mask(ENTROPY, ENTROPY_MASK, 0.2, torch.tensor(0.35))
    assert kept.sum().item() == 7 and not kept[0, :3].any()
    assert threshold.item() == pytest.approx(0.35)
    # quantile 1 keeps every masked token
    kept, threshold = top_entropy_mask(ENTROPY, ENTROPY_MASK, 1.0)
    assert kept is ENTROPY_MASK and threshold.item() == -math.inf
    # no masked token: nothing kept, no error from an empty quantile
    none = torch.zeros(2, 6, dtype=torch.bool)
    kept, threshold = top_entropy_mask(ENTROPY, none, 0.2)
    assert not kept.any() and threshold.item() == -math.inf


def test_entropy_quantile_threshold_hand_values_and_torch_quantile():
    values = torch.tensor([5.0, 1.0, 4.0, 2.0, 3.0])
    # quantile 0.5 -> median of sorted [1, 2, 3, 4, 5] = 3 (rank 0.5 * 4 = 2)
    assert entropy_quantile_threshold(values, 0.5).item() == 3.0
    # quantile 0.3 -> the 0.7 quantile: rank 0.7 * 4 = 2.8, 3 + 0.8 * (4 - 3) = 3.8
    assert entropy_quantile_threshold(values, 0.3).item() == pytest.approx(3.8)
    assert entropy_quantile_threshold(torch.tensor([]), 0.2).item() == -math.inf
    # the same linear interpolation as torch.quantile (TRL's), bit for bit
    g = torch.Generator().manual_seed(5)
    v = torch.rand(1001, generator=g)
    for q in (0.01, 0.2, 0.33, 0.5, 0.9):
        assert torch.equal(entropy_quantile_threshold(v, q), torch.quantile(v, 1 - q)), q


def test_top_entropy_errors():
    with pytest.raises(ValueError, match="quantile"):
        top_entropy_mask(ENTROPY, ENTROPY_MASK, 0.0)
    with pytest.raises(ValueError, match="quantile"):
        entropy_quantile_threshold(torch.ones(3), 1.5)
    with pytest.raises(ValueError, match="mask"):
        top_entropy_mask(ENTROPY, ENTROPY_MASK.double(), 0.2)
    with pytest.raises(ValueError, match="mask shape"):
        top_entropy_mask(ENTROPY, ENTROPY_MASK[:, :3], 0.2)
    with pytest.raises(ValueError, match="1-D"):
        entropy_quantile_threshold(ENTROPY, 0.2)
