import math

import pytest
import torch

from rloo.algo import entropy_from_logits, selective_log_softmax


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
