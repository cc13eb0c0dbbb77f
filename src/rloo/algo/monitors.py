"""Training-health monitors: scalar diagnostics that never enter the loss."""

from __future__ import annotations

import torch
from torch import Tensor

from .masking import _check_mask, masked_mean, masked_sum

__all__ = ["pearson_correlation"]


def pearson_correlation(x: Tensor, y: Tensor, mask: Tensor | None = None) -> Tensor:
    """Pearson correlation of ``x`` and ``y`` over the entries where ``mask`` is True.

    A reward-hacking monitor: the correlation of rewards with completion lengths creeping towards 1 says
    the policy is being paid for length.

    With fewer than two entries, or when ``x`` or ``y`` is constant over them, no linear relation is
    measurable: the result is 0, not NaN. Constancy is tested exactly (max == min), so rounding in the
    mean cannot turn a constant into a spurious correlation of +-1.

    Args:
        x: (...) values (integer or floating).
        y: (...) values, same shape as ``x``.
        mask: bool with the shape of ``x``; default all True.

    Returns:
        0-dim correlation in ``[-1, 1]``, detached; dtype of ``x`` and ``y`` promoted if floating, else
        the default float.
    """
    if x.shape != y.shape:
        raise ValueError(
            f"x shape {tuple(x.shape)} must equal y shape {tuple(y.shape)}; pass one value of each per entry"
        )
    if mask is None:
        mask = torch.ones_like(x, dtype=torch.bool)
    elif mask.shape != x.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} must equal x shape {tuple(x.shape)}; align them")
    mask = _check_mask(x, mask)
    dtype = torch.promote_types(x.dtype, y.dtype)
    dtype = dtype if dtype.is_floating_point else torch.get_default_dtype()
    with torch.no_grad():
        xs, ys = x.detach().to(dtype), y.detach().to(dtype)
        zero = torch.zeros((), dtype=dtype, device=x.device)
        if x.numel() == 0:
            return zero
        inf = torch.full((), torch.inf, dtype=dtype, device=x.device)
        # Tensor conditions rather than Python ifs: no host sync when used as a per-step metric.
        degenerate = (mask.sum() < 2) | torch.stack(
            [torch.where(mask, v, -inf).max() == torch.where(mask, v, inf).min() for v in (xs, ys)]
        ).any()
        dx = torch.where(mask, xs - masked_mean(xs, mask), zero)  # (...)
        dy = torch.where(mask, ys - masked_mean(ys, mask), zero)  # (...)
        cov = masked_sum(dx * dy, mask)
        # The n - 1 (or n) of the covariance and the variances cancels, so plain sums suffice.
        denom = torch.sqrt(masked_sum(dx * dx, mask) * masked_sum(dy * dy, mask))
        # denom == 0 despite distinct values: squares of tiny deviations underflowed.
        degenerate = degenerate | (denom == 0)
        r = (cov / torch.where(degenerate, torch.ones_like(denom), denom)).clamp(-1.0, 1.0)
        return torch.where(degenerate, zero, r)
