"""The optimizer: AdamW, with PyTorch's fused kernel where the parameters' device has one."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


def make_adamw(params: Iterable[torch.nn.Parameter], **kwargs: Any) -> torch.optim.AdamW:
    """``torch.optim.AdamW(params, **kwargs)``, fused when every parameter is a floating-point tensor on a
    device with fused kernels (CPU and CUDA in recent PyTorch): one kernel per parameter instead of a
    dozen element-wise passes, the same update up to float rounding. Falls back to the default
    implementation where fused is unsupported (e.g. an older PyTorch or another accelerator)."""
    params = [p for p in params]
    if params and all(p.is_floating_point() for p in params):
        try:
            return torch.optim.AdamW(params, fused=True, **kwargs)
        except (RuntimeError, TypeError, ValueError):
            pass  # this build or device has no fused AdamW
    return torch.optim.AdamW(params, **kwargs)
