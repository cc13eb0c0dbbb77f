import math

import pytest
import torch

from rloo.algo import pearson_correlation

NAN = math.nan


def test_pearson_hand_values():
    # perfectly linear: +1 and -1
    assert pearson_correlation(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([2.0, 4.0, 6.0])).item() == 1.0
    assert pearson_correlation(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([6.0, 4.0, 2.0])).item() == -1.0
    # x [1, 2, 3, 4] (mean 2.5, deviations [-1.5, -0.5, 0.5, 1.5]), y [1, 3, 2, 4] (deviations
    # [-1.5, 0.5, -0.5, 1.5]): cov sum 2.25 - 0.25 - 0.25 + 2.25 = 4, variance sums 5 and 5 -> 4 / 5 = 0.8
    out = pearson_correlation(torch.tensor([1, 2, 3, 4]), torch.tensor([1.0, 3.0, 2.0, 4.0]))
    assert out.dim() == 0 and out.item() == pytest.approx(0.8)


def test_pearson_masked_entries_are_left_out():
    # over the first three: x [1, 2, 3] (deviations [-1, 0, 1]), y [1, 3, 2] (deviations [-1, 1, 0]):
    # cov 1, variance sums 2 and 2 -> 1 / 2 = 0.5; the outlier and the NaN are masked out
    x = torch.tensor([1.0, 2.0, 3.0, 100.0])
    y = torch.tensor([1.0, 3.0, 2.0, NAN])
    mask = torch.tensor([True, True, True, False])
    assert pearson_correlation(x, y, mask).item() == pytest.approx(0.5)


def test_pearson_degenerate_inputs_give_zero():
    y = torch.tensor([1.0, 3.0, 2.0])
    # a constant whose mean is not exactly representable (0.1 * 3 / 3): still 0, not a spurious +-1
    assert pearson_correlation(torch.full((3,), 0.1), y).item() == 0.0
    assert pearson_correlation(y, torch.full((3,), 7.0)).item() == 0.0
    # fewer than two entries, and no entry at all
    one = torch.tensor([True, False, False])
    assert pearson_correlation(torch.tensor([1.0, 2.0, 3.0]), y, one).item() == 0.0
    assert pearson_correlation(torch.tensor([]), torch.tensor([])).item() == 0.0
    # integer lengths against rewards: the default float dtype
    assert pearson_correlation(torch.tensor([1, 2]), torch.tensor([3, 5])).dtype == torch.float32


def test_pearson_matches_torch_corrcoef():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, generator=g, dtype=torch.float64)
    y = 0.3 * x + torch.randn(50, generator=g, dtype=torch.float64)
    expected = torch.corrcoef(torch.stack([x, y]))[0, 1]
    torch.testing.assert_close(pearson_correlation(x, y), expected)


def test_pearson_errors():
    with pytest.raises(ValueError, match="y shape"):
        pearson_correlation(torch.zeros(3), torch.zeros(4))
    with pytest.raises(ValueError, match="mask shape"):
        pearson_correlation(torch.zeros(3), torch.zeros(3), torch.ones(4, dtype=torch.bool))
    with pytest.raises(ValueError, match="bool"):
        pearson_correlation(torch.zeros(3), torch.zeros(3), torch.ones(3))
