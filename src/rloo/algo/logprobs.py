"""Log-probabilities and entropies from logits, without a full (B, T, V) temporary where avoidable."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["entropy_from_logits", "selective_log_softmax"]

# Rows of the flattened (N, V) logits processed at once by entropy_from_logits: bounds the float32
# temporaries to ~_ENTROPY_CHUNK * V elements.
_ENTROPY_CHUNK = 128

_FULL_PRECISION = (torch.float32, torch.float64)


def selective_log_softmax(logits: Tensor, index: Tensor) -> Tensor:
    """Log-probability of the indexed token: ``log_softmax(logits, -1).gather(-1, index)``.

    float32/float64: ``logits[index] - logsumexp(logits)``, the logsumexp taken one batch row at a time,
    so no full (B, T, V) log-softmax is ever held. Half precision (bf16/fp16): log_softmax of one batch
    row at a time, upcast to float32, because ``x - logsumexp`` in bf16 loses most of the digits that
    the sequence-level ratio ``exp(sum new - sum old)`` needs; the result is then float32.

    Args:
        logits: (B, T, V) (any number of leading dims >= 1 besides V).
        index: (B, T) long token ids, same shape as ``logits.shape[:-1]``.

    Returns:
        (B, T) log-probabilities; dtype of ``logits`` for float32/float64, float32 for half precision.
        Differentiable w.r.t. ``logits``.
    """
    if logits.dim() < 2:
        raise ValueError(f"logits must have shape (B, ..., V) (got {tuple(logits.shape)}); add a batch dim")
    if tuple(index.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"index shape {tuple(index.shape)} must equal logits.shape[:-1] {tuple(logits.shape[:-1])}; "
            "pass one token id per logits row"
        )
    if logits.shape[0] == 0:
        out_dtype = logits.dtype if logits.dtype in _FULL_PRECISION else torch.float32
        return logits.new_zeros(index.shape, dtype=out_dtype)
    if logits.dtype in _FULL_PRECISION:
        out = _SelectiveLogSoftmax.apply(logits, index)  # (B, T)
        return out
    rows = []
    for row_logits, row_index in zip(logits, index, strict=True):
        row_logp = torch.log_softmax(row_logits.float(), dim=-1)  # (T, V) float32
        rows.append(row_logp.gather(-1, row_index.unsqueeze(-1)).squeeze(-1))  # (T,)
    return torch.stack(rows)  # (B, T)


class _SelectiveLogSoftmax(torch.autograd.Function):
    """``logits[index] - logsumexp(logits)`` with a one-pass backward.

    Autograd's own backward of that expression builds a zero (B, T, V) tensor for the gather, scatters
    into it, computes softmax for the logsumexp and adds the two: three full passes and a temporary.
    The gradient is ``onehot(index) - softmax(logits)`` times the incoming gradient, written here as one
    ``exp(logits - lse)`` (which is the gradient tensor itself) scaled in place, plus a scatter of the
    incoming gradient at the indexed tokens.
    """

    @staticmethod
    def forward(ctx: Any, logits: Tensor, index: Tensor) -> Tensor:
        selected = torch.gather(logits, -1, index.unsqueeze(-1)).squeeze(-1)  # (B, T)
        # Per batch row: logsumexp's exp() temporary is (T, V), not (B, T, V).
        lse = torch.stack([torch.logsumexp(row, dim=-1) for row in logits])  # (B, T)
        ctx.save_for_backward(logits, index, lse)
        return selected - lse

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor, None]:
        logits, index, lse = ctx.saved_tensors
        grad = torch.sub(logits, lse.unsqueeze(-1)).exp_()  # (B, T, V) softmax
        grad.mul_(-grad_out.unsqueeze(-1))
        grad.scatter_add_(-1, index.unsqueeze(-1), grad_out.unsqueeze(-1))
        return grad, None


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of ``softmax(logits)`` over the last dimension: ``logsumexp(l) - sum(softmax(l) * l)``.

    Computed in row chunks (and in float32 for half-precision input). ``-inf`` logits (masked-out
    vocabulary entries) contribute 0, not NaN.

    Args:
        logits: (..., V).

    Returns:
        (...) entropies in nats; dtype of ``logits`` for float32/float64, float32 for half precision.
    """
    if logits.dim() < 1:
        raise ValueError("logits must have at least one dimension (the vocabulary); pass a (..., V) tensor")
    lead, v = logits.shape[:-1], logits.shape[-1]
    flat = logits.reshape(-1, v)  # (N, V)
    out = []
    for chunk in flat.split(_ENTROPY_CHUNK):
        c = chunk if chunk.dtype in _FULL_PRECISION else chunk.float()  # (n, V)
        probs = torch.softmax(c, dim=-1)  # (n, V)
        # p * l is 0 * -inf = NaN for masked vocab entries; their true contribution is 0. Clamping -inf to
        # the lowest finite value makes it 0 * finite = 0 in one pass (no mask, no zeros tensor).
        finite = c.clamp(min=torch.finfo(c.dtype).min)  # (n, V)
        out.append(torch.logsumexp(c, dim=-1) - (probs * finite).sum(-1))  # (n,)
    if not out:
        dtype = logits.dtype if logits.dtype in _FULL_PRECISION else torch.float32
        return logits.new_zeros(lead, dtype=dtype)
    return torch.cat(out).reshape(lead)  # (...)
