import math

import pytest
import torch

from rloo.algo import (
    completion_mask,
    first_true_index,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    truncate_after_stop,
    truncated_completions,
)

NAN, INF = math.nan, math.inf


def test_masked_sum_and_mean_hand_values_ignore_garbage():
    x = torch.tensor([[1.0, 2.0, NAN], [4.0, INF, 6.0]])
    mask = torch.tensor([[True, True, False], [True, False, True]])
    # all: 1 + 2 + 4 + 6 = 13 over 4 entries
    assert masked_sum(x, mask).item() == 13.0
    assert masked_mean(x, mask).item() == pytest.approx(13 / 4)
    # rows: [1+2, 4+6] = [3, 10]; means [3/2, 10/2]
    torch.testing.assert_close(masked_sum(x, mask, dim=1), torch.tensor([3.0, 10.0]))
    torch.testing.assert_close(masked_mean(x, mask, dim=1), torch.tensor([1.5, 5.0]))
    # columns: [1+4, 2, 6]
    torch.testing.assert_close(masked_sum(x, mask, dim=0), torch.tensor([5.0, 2.0, 6.0]))


def test_masked_mean_empty_mask_is_zero_not_nan():
    x = torch.tensor([[NAN, 1.0], [2.0, 3.0]])
    mask = torch.tensor([[False, False], [True, True]])
    # row 0 has no entry -> 0; row 1: (2+3)/2
    torch.testing.assert_close(masked_mean(x, mask, dim=1), torch.tensor([0.0, 2.5]))
    assert masked_mean(x, torch.zeros_like(mask)).item() == 0.0


def test_masked_var_hand_values():
    x = torch.tensor([1.0, 2.0, 3.0, 100.0])
    mask = torch.tensor([True, True, True, False])
    # mean 2, squared deviations 1 + 0 + 1 = 2; unbiased 2/2 = 1, biased 2/3
    assert masked_var(x, mask).item() == pytest.approx(1.0)
    assert masked_var(x, mask, unbiased=False).item() == pytest.approx(2 / 3)
    # a single entry: unbiased variance undefined -> 0 (torch.var would be NaN)
    assert masked_var(x, torch.tensor([True, False, False, False])).item() == 0.0


def test_masked_var_matches_torch_var_on_random():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 7, generator=g, dtype=torch.float64)
    mask = torch.rand(6, 7, generator=g) > 0.4
    torch.testing.assert_close(masked_var(x, mask), x[mask].var())
    torch.testing.assert_close(masked_var(x, mask, unbiased=False), x[mask].var(unbiased=False))


def test_masked_whiten_hand_values():
    x = torch.tensor([2.0, 4.0, 6.0, NAN])
    mask = torch.tensor([True, True, True, False])
    # mean 4, unbiased var ((-2)^2 + 0 + 2^2)/2 = 4, std 2 -> [-1, 0, 1], masked -> 0
    torch.testing.assert_close(masked_whiten(x, mask), torch.tensor([-1.0, 0.0, 1.0, 0.0]))
    # shift_mean=False adds the mean 4 back: [3, 4, 5]
    torch.testing.assert_close(masked_whiten(x, mask, shift_mean=False), torch.tensor([3.0, 4.0, 5.0, 0.0]))


def test_masked_reductions_give_zero_grad_to_garbage_positions():
    x = torch.tensor([1.0, 2.0, INF, NAN], requires_grad=True)
    mask = torch.tensor([True, True, False, False])
    (masked_mean(x, mask) + masked_var(x, mask) + masked_whiten(x, mask).sum()).backward()
    assert torch.isfinite(x.grad).all()
    assert x.grad[2:].eq(0).all()
    # d/dx of mean = 1/2 each; var = ((x1-x2)^2)/2 -> d/dx1 = (x1-x2) = -1, d/dx2 = +1; whiten sums to 0
    torch.testing.assert_close(x.grad[:2], torch.tensor([0.5 - 1.0, 0.5 + 1.0]))


def test_mask_must_be_bool():
    with pytest.raises(ValueError, match="bool"):
        masked_sum(torch.ones(3), torch.ones(3))
    with pytest.raises(ValueError, match="broadcast"):
        masked_mean(torch.ones(3), torch.ones(4, dtype=torch.bool))


def test_first_true_index():
    flags = torch.tensor([[False, True, True], [False, False, False], [True, False, True]])
    # first True at 1; none -> T = 3; first True at 0
    torch.testing.assert_close(first_true_index(flags), torch.tensor([1, 3, 0]))
    assert first_true_index(flags).dtype == torch.long


def test_completion_mask_hand_values():
    ids = torch.tensor([[5, 2, 7, 2], [5, 6, 7, 8], [2, 2, 2, 2]])
    # row 0: stop (2) at 1 -> keep 0..1; row 1: no stop -> all; row 2 (pad == eos): only the first token
    expected = torch.tensor(
        [[True, True, False, False], [True, True, True, True], [True, False, False, False]]
    )
    torch.testing.assert_close(completion_mask(ids, 2), expected)
    assert completion_mask(ids, None).all()


def test_truncate_after_stop_hand_values():
    ids = torch.tensor([[5, 2, 7, 2], [5, 6, 7, 8]])
    torch.testing.assert_close(truncate_after_stop(ids, 2, 0), torch.tensor([[5, 2, 0, 0], [5, 6, 7, 8]]))
    # pad == eos: everything after the stop becomes the stop id
    torch.testing.assert_close(truncate_after_stop(ids, 2, 2), torch.tensor([[5, 2, 2, 2], [5, 6, 7, 8]]))
    # input untouched
    assert ids[0, 2].item() == 7


def _loop_truncate(ids, stop, pad):
    out, mask = ids.clone(), torch.zeros_like(ids, dtype=torch.bool)
    for b in range(ids.shape[0]):
        seen = False
        for t in range(ids.shape[1]):
            if seen:
                out[b, t] = pad
            else:
                mask[b, t] = True
                seen = ids[b, t].item() == stop
    return out, mask


def test_truncate_and_mask_match_loop_reference():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 5, (40, 9), generator=g)  # stop id 3 appears ~20% of the time
    expected_ids, expected_mask = _loop_truncate(ids, 3, 0)
    assert not expected_mask.all() and (~expected_mask).any(dim=1).sum() < 40  # both kinds of rows
    torch.testing.assert_close(truncate_after_stop(ids, 3, 0), expected_ids)
    torch.testing.assert_close(completion_mask(ids, 3), expected_mask)


def test_truncated_completions_are_rows_without_a_stop_token():
    ids = torch.tensor([[5, 2, 0], [5, 6, 7], [2, 2, 2], [0, 0, 0]])
    # stop token 2: rows 0 and 2 contain it; rows 1 and 3 ran to the length limit without it
    assert truncated_completions(ids, 2).tolist() == [False, True, False, True]
    # after truncate_after_stop with pad 0 the answer is the same (the stop token itself is kept)
    assert truncated_completions(truncate_after_stop(ids, 2, 0), 2).tolist() == [False, True, False, True]
