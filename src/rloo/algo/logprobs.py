"""Log-probabilities and entropies from logits, without a full (B, T, V) temporary where avoidable.

Also the high-entropy token selection of "Beyond the 80/20 rule" (Wang et al. 2025, TRL's
``top_entropy_quantile``): train only on the "forking" tokens whose entropy is in the top quantile.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "entropy_from_logits",
    "entropy_quantile_threshold",
    "entropy_with_grad",
    "selective_log_softmax",
    "top_entropy_mask",
]

# Rows of the flattened (N, V) logits processed at once by entropy_from_logits and entropy_with_grad's
# backward: bounds the float32 temporaries to ~_ENTROPY_CHUNK * V elements.
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


class _EntropyWithGrad(torch.autograd.Function):
    """:func:`entropy_from_logits` with a chunked backward that saves only the logits.

    Autograd through the plain formula would keep softmax and log-softmax, two full (B, T, V) float32
    tensors, alive until backward. Here backward recomputes them one chunk of rows at a time:
    ``dH/dz_j = -p_j * (log p_j + H)``.
    """

    @staticmethod
    def forward(ctx: Any, logits: Tensor) -> Tensor:
        ctx.save_for_backward(logits)
        return entropy_from_logits(logits)

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> Tensor:
        (logits,) = ctx.saved_tensors
        v = logits.shape[-1]
        flat = logits.reshape(-1, v)  # (N, V)
        grad_rows = grad_out.reshape(-1)  # (N,)
        grad = torch.empty_like(flat)  # (N, V), dtype of logits
        for start in range(0, flat.shape[0], _ENTROPY_CHUNK):
            chunk = flat[start : start + _ENTROPY_CHUNK]
            c = chunk if chunk.dtype in _FULL_PRECISION else chunk.float()  # (n, V)
            # Clamped -inf (as in entropy_from_logits): log p stays finite, so p * (log p + H) = 0 * finite
            # = 0 for masked vocabulary entries instead of 0 * -inf = NaN.
            finite = c.clamp(min=torch.finfo(c.dtype).min)  # (n, V)
            log_p = finite - torch.logsumexp(c, dim=-1, keepdim=True)  # (n, V)
            p = torch.softmax(c, dim=-1)  # (n, V)
            h = -(p * log_p).sum(-1, keepdim=True)  # (n, 1)
            g = grad_rows[start : start + _ENTROPY_CHUNK].unsqueeze(-1).to(c.dtype)  # (n, 1)
            grad[start : start + _ENTROPY_CHUNK] = (-p * (log_p + h) * g).to(grad.dtype)
        return grad.reshape(logits.shape)


def entropy_with_grad(logits: Tensor) -> Tensor:
    """Entropy of ``softmax(logits)`` over the last dimension, differentiable w.r.t. ``logits``.

    The values are :func:`entropy_from_logits`'s (row chunks, float32 for half-precision input, ``-inf``
    logits contribute 0). Backward saves only ``logits`` and recomputes the softmax one chunk of rows at
    a time, so an entropy bonus costs no (B, T, V) activation beyond the logits themselves.

    Args:
        logits: (..., V), e.g. (B, T, V).

    Returns:
        (...) entropies in nats, e.g. (B, T); dtype of ``logits`` for float32/float64, float32 for half
        precision. The gradient reaching ``logits`` has their dtype.
    """
    if logits.dim() < 1:
        raise ValueError("logits must have at least one dimension (the vocabulary); pass a (..., V) tensor")
    out: Tensor = _EntropyWithGrad.apply(logits)  # (...)
    return out


def entropy_quantile_threshold(values_1d: Tensor, quantile: float) -> Tensor:
    """The entropy at or above which a token is among the top ``quantile`` fraction of ``values_1d``.

    The ``1 - quantile`` quantile with ``torch.quantile``'s linear interpolation (as TRL's
    ``get_high_entropy_mask``), computed by sorting, so it has no ``torch.quantile`` input-size limit
    (2**24 elements). For a threshold shared by every rank, pass all ranks' unmasked entropies.

    Args:
        values_1d: (N,) entropies of the unmasked tokens.
        quantile: fraction of tokens to keep, in (0, 1]; 0.2 keeps the top 20%.

    Returns:
        0-dim threshold, float32 (float64 for float64 input); ``-inf`` (keep everything) when
        ``quantile`` is 1 or ``values_1d`` is empty.
    """
    if not 0 < quantile <= 1:
        raise ValueError(f"quantile must be in (0, 1] (got {quantile}); 0.2 keeps the top 20% of tokens")
    if values_1d.dim() != 1:
        raise ValueError(
            f"values_1d must be 1-D (got shape {tuple(values_1d.shape)}); pass entropy[mask] (gathered)"
        )
    v = values_1d.detach()
    v = v if v.dtype in _FULL_PRECISION else v.float()  # (N,)
    if quantile == 1 or v.numel() == 0:
        return torch.full((), -math.inf, dtype=v.dtype, device=v.device)
    ordered = v.sort().values  # (N,)
    # torch.quantile's own steps: rank = q * (N - 1) in the input dtype, then lerp between neighbours.
    rank = torch.tensor(1 - quantile, dtype=v.dtype, device=v.device) * (v.numel() - 1)
    below = rank.long()
    above = rank.ceil().long()
    return torch.lerp(ordered[below], ordered[above], rank - below.to(v.dtype))


def top_entropy_mask(
    entropy: Tensor, mask: Tensor, quantile: float, threshold: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Keep only the tokens of ``mask`` whose entropy is in the top ``quantile`` (``entropy >= threshold``).

    Pass the result as the loss's mask to train on high-entropy tokens only (TRL's
    ``top_entropy_quantile``; TRL takes the threshold over every rank's tokens).

    Args:
        entropy: (B, T) per-token entropies (their gradient is not used).
        mask: (B, T) bool completion mask.
        quantile: fraction of tokens to keep, in (0, 1]; 1 keeps every token of ``mask``.
        threshold: 0-dim threshold, e.g. :func:`entropy_quantile_threshold` of every rank's gathered
            ``entropy[mask]``; default this call's own, from ``entropy[mask]``.

    Returns:
        ``(kept, threshold)``: (B, T) bool ``mask & (entropy >= threshold)`` and the 0-dim threshold used.
        With ``quantile`` 1 they are ``mask`` itself and ``-inf``; a ``mask`` with no True entry is
        returned unchanged in value (with threshold ``-inf`` when computed here).
    """
    if not 0 < quantile <= 1:
        raise ValueError(f"quantile must be in (0, 1] (got {quantile}); 0.2 keeps the top 20% of tokens")
    if mask.dtype != torch.bool:
        raise ValueError(f"mask must be a bool tensor (got {mask.dtype}); pass mask.bool()")
    if mask.shape != entropy.shape:
        raise ValueError(
            f"mask shape {tuple(mask.shape)} must equal entropy shape {tuple(entropy.shape)}; align them"
        )
    if threshold is not None and threshold.dim() != 0:
        raise ValueError(f"threshold must be 0-dim (got shape {tuple(threshold.shape)}); pass one value")
    e = entropy.detach()
    e = e if e.dtype in _FULL_PRECISION else e.float()  # (B, T)
    if quantile == 1:
        return mask, torch.full((), -math.inf, dtype=e.dtype, device=e.device)
    if threshold is None:
        # No masked-in token gives -inf, and mask & True is mask: nothing to special-case.
        threshold = entropy_quantile_threshold(e[mask], quantile)
    threshold = threshold.detach().to(device=e.device, dtype=e.dtype)
    return mask & (e >= threshold), threshold  # (B, T)
