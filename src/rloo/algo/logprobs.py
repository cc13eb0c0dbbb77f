"""Log-probabilities and entropies from logits, without a full (B, T, V) temporary where avoidable.

Also the high-entropy token selection of "Beyond the 80/20 rule" (Wang et al. 2025, TRL's
``top_entropy_quantile``): train only on the "forking" tokens whose entropy is in the top quantile.

Memory contract of :func:`selective_log_softmax`, :func:`entropy_from_logits` and
:func:`entropy_with_grad`: the logits are read in chunks of ``_ROW_CHUNK`` rows of the flattened
(N, V) logits, so no float32 (float64 for float64 input) temporary larger than a few (_ROW_CHUNK, V)
ever exists, whatever the logits' dtype and temperature; autograd keeps only the logits themselves (in
their own dtype) and O(N) per-row statistics for backward. Callers should therefore pass the model's
raw logits (bf16 included) and the temperature, not ``(logits.float() / temperature)``, which would
materialise the full float32 (B, T, V) tensor this module exists to avoid.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

__all__ = [
    "entropy_from_logits",
    "entropy_quantile_threshold",
    "entropy_with_grad",
    "selective_log_softmax",
    "top_entropy_mask",
]

# Rows of the flattened (N, V) logits processed at once, forward and backward: bounds every float32
# temporary to _ROW_CHUNK * V elements (128 * 151,936 * 4 bytes = 78 MB for a Qwen vocabulary), while
# keeping the kernel launches per batch few (B * T / 128 chunks; B * ceil(T / 128) for a logits view whose
# (B, T) dims cannot be merged, see _row_chunks).
_ROW_CHUNK = 128

_FULL_PRECISION = (torch.float32, torch.float64)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # Half-precision softmax statistics lose the digits the sequence-level ratio exp(sum new - sum old)
    # needs; float64 input asks for float64 math, everything else gets float32.
    return dtype if dtype in _FULL_PRECISION else torch.float32


def _check_temperature(temperature: float) -> None:
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(
            f"temperature must be a finite number > 0 (got {temperature}); pass the sampling temperature"
        )


def _scaled_rows(chunk: Tensor, temperature: float) -> Tensor:
    """``chunk / temperature`` in the compute dtype, costing at most one (n, V) temporary.

    At temperature exactly 1 full-precision rows are returned as they are (a view of the logits): the
    division would be a full pass for nothing.
    """
    dtype = _compute_dtype(chunk.dtype)
    if chunk.dtype != dtype:
        up = chunk.to(dtype)  # (n, V) fresh copy, so dividing in place touches no caller tensor
        return up if temperature == 1.0 else up.div_(temperature)
    return chunk if temperature == 1.0 else chunk / temperature  # (n, V)


def _row_chunks(x: Tensor) -> Iterator[tuple[slice, Tensor]]:
    """``(rows, chunk)`` pairs covering the flattened (N, V) rows of ``x`` in order, without copying.

    ``rows`` is the chunk's slice of the N flattened rows and ``chunk`` an (n, V) view of ``x`` with
    n <= _ROW_CHUNK. ``x.reshape(-1, V)`` would copy the whole tensor when the leading dims cannot be
    merged, as for the trainer's ``logits[:, :-1]`` of a (B, T + 1, V) model output; then the first dim is
    walked one index at a time instead, each sub-tensor chunked the same way.
    """
    v = x.shape[-1]
    try:
        flat = x.view(-1, v)  # (N, V)
    except RuntimeError:
        per_index = math.prod(x.shape[1:-1])
        for i, sub in enumerate(x):
            for rows, chunk in _row_chunks(sub):
                yield slice(i * per_index + rows.start, i * per_index + rows.stop), chunk
        return
    for start in range(0, flat.shape[0], _ROW_CHUNK):
        chunk = flat[start : start + _ROW_CHUNK]  # (n, V)
        yield slice(start, start + chunk.shape[0]), chunk


def selective_log_softmax(logits: Tensor, index: Tensor, *, temperature: float = 1.0) -> Tensor:
    """Log-probability of the indexed token under ``softmax(logits / temperature)``.

    ``log_softmax(logits / temperature, -1).gather(-1, index)``, computed as ``z[index] - logsumexp(z)``
    with ``z = logits / temperature`` taken ``_ROW_CHUNK`` rows of the flattened (N, V) logits at a time
    in float32 (float64 for float64 input). Half-precision logits are upcast per chunk because
    ``x - logsumexp`` in bf16 loses most of the digits that the sequence-level ratio
    ``exp(sum new - sum old)`` needs.

    Memory: no float32 temporary larger than a few (_ROW_CHUNK, V) exists in forward or backward, and
    autograd saves only ``logits`` (in their own dtype, not upcast), ``index`` and the (N,) logsumexp.
    Backward recomputes the softmax per chunk and returns a gradient of the logits' dtype. The
    ``temperature`` is the divisor itself (pass ``temperature + 1e-7`` if that is the scoring rule); at
    exactly 1.0 no division is done.

    Args:
        logits: (B, T, V) (any number of leading dims >= 1 besides V), any floating dtype.
        index: (B, T) long token ids, same shape as ``logits.shape[:-1]``.
        temperature: divisor of the logits, finite and > 0.

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
    _check_temperature(temperature)
    if logits.shape[0] == 0:
        return logits.new_zeros(index.shape, dtype=_compute_dtype(logits.dtype))
    out: Tensor = _SelectiveLogSoftmax.apply(logits, index, float(temperature))  # (B, T)
    return out


class _SelectiveLogSoftmax(torch.autograd.Function):
    """``z[index] - logsumexp(z)``, ``z = logits / temperature``, chunked, with a one-pass backward.

    Autograd through ``log_softmax(logits.float() / t).gather`` would keep the float32 (B, T, V) input
    and output alive until backward, and its backward builds a zero (B, T, V) tensor for the gather,
    scatters into it and adds the softmax: several full passes and temporaries. Here forward saves the
    logits as given plus the (N,) logsumexp, and backward writes
    ``(onehot(index) - softmax(z)) * grad_out / temperature`` one chunk of rows at a time: one
    ``exp(z - lse)`` (the softmax, which becomes the gradient chunk itself) scaled in place, plus a
    scatter of the incoming gradient at the indexed tokens.
    """

    @staticmethod
    def forward(ctx: Any, logits: Tensor, index: Tensor, temperature: float) -> Tensor:
        flat_index = index.reshape(-1, 1)  # (N, 1)
        dtype = _compute_dtype(logits.dtype)
        lse = torch.empty(index.numel(), dtype=dtype, device=logits.device)  # (N,)
        out = torch.empty(index.numel(), dtype=dtype, device=logits.device)  # (N,)
        for rows, chunk in _row_chunks(logits):
            z = _scaled_rows(chunk, temperature)  # (n, V) compute dtype
            lse[rows] = torch.logsumexp(z, dim=-1)
            # Gathered from the same scaled chunk, so z[index] and lse see identical rounding.
            out[rows] = z.gather(-1, flat_index[rows]).squeeze(-1) - lse[rows]
        ctx.save_for_backward(logits, index, lse)
        ctx.temperature = temperature
        return out.reshape(index.shape)  # (B, T)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor, None, None]:
        logits, index, lse = ctx.saved_tensors
        temperature: float = ctx.temperature
        flat_index = index.reshape(-1, 1)  # (N, 1)
        dtype = _compute_dtype(logits.dtype)
        # d z / d logits = 1 / temperature: folded into the (N,) incoming gradient, not a (N, V) pass.
        g_rows = grad_out.reshape(-1, 1).to(dtype)  # (N, 1)
        if temperature != 1.0:
            g_rows = g_rows / temperature
        # (N, V) in the logits' dtype and contiguous even for a non-contiguous logits view
        grad = logits.new_empty(index.numel(), logits.shape[-1])
        for rows, chunk in _row_chunks(logits):
            g = g_rows[rows]  # (n, 1)
            z = _scaled_rows(chunk, temperature)  # (n, V)
            lse_rows = lse[rows].unsqueeze(-1)  # (n, 1)
            # z is the logits' own chunk (full precision, temperature 1) or a fresh copy that may be reused
            p = torch.sub(z, lse_rows) if z is chunk else z.sub_(lse_rows)  # (n, V) log-softmax
            p.exp_().mul_(-g)  # (n, V) softmax * -grad_out
            p.scatter_add_(-1, flat_index[rows], g)
            grad[rows] = p  # cast to the logits' dtype on write
        return grad.reshape(logits.shape), None, None


def entropy_from_logits(logits: Tensor, *, temperature: float = 1.0) -> Tensor:
    """Entropy of ``softmax(logits / temperature)`` over the last dimension.

    ``logsumexp(z) - sum(softmax(z) * z)`` with ``z = logits / temperature``, computed ``_ROW_CHUNK``
    rows of the flattened (N, V) logits at a time in float32 (float64 for float64 input), so no
    float32 temporary larger than a few (_ROW_CHUNK, V) exists. ``-inf`` logits (masked-out vocabulary
    entries) contribute 0, not NaN. At temperature exactly 1.0 no division is done.

    Args:
        logits: (..., V).
        temperature: divisor of the logits, finite and > 0.

    Returns:
        (...) entropies in nats; dtype of ``logits`` for float32/float64, float32 for half precision.
    """
    if logits.dim() < 1:
        raise ValueError("logits must have at least one dimension (the vocabulary); pass a (..., V) tensor")
    _check_temperature(temperature)
    lead = logits.shape[:-1]
    out = []
    for _, chunk in _row_chunks(logits):
        c = _scaled_rows(chunk, temperature)  # (n, V)
        probs = torch.softmax(c, dim=-1)  # (n, V)
        # p * l is 0 * -inf = NaN for masked vocab entries; their true contribution is 0. Clamping -inf to
        # the lowest finite value makes it 0 * finite = 0 in one pass (no mask, no zeros tensor).
        finite = c.clamp(min=torch.finfo(c.dtype).min)  # (n, V)
        out.append(torch.logsumexp(c, dim=-1) - (probs * finite).sum(-1))  # (n,)
    if not out:
        return logits.new_zeros(lead, dtype=_compute_dtype(logits.dtype))
    return torch.cat(out).reshape(lead)  # (...)


class _EntropyWithGrad(torch.autograd.Function):
    """:func:`entropy_from_logits` with a chunked backward that saves only the logits.

    Autograd through the plain formula would keep softmax and log-softmax, two full (B, T, V) float32
    tensors, alive until backward. Here backward recomputes them one chunk of rows at a time:
    ``dH/dz_j = -p_j * (log p_j + H)``, and ``dz/dlogits = 1 / temperature``.
    """

    @staticmethod
    def forward(ctx: Any, logits: Tensor, temperature: float) -> Tensor:
        ctx.save_for_backward(logits)
        ctx.temperature = temperature
        return entropy_from_logits(logits, temperature=temperature)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor, None]:
        (logits,) = ctx.saved_tensors
        temperature: float = ctx.temperature
        # The 1 / temperature of dz/dlogits goes on the (N,) incoming gradient, not on a (N, V) chunk.
        g_rows = grad_out.reshape(-1, 1).to(_compute_dtype(logits.dtype))  # (N, 1)
        if temperature != 1.0:
            g_rows = g_rows / temperature
        # (N, V) in the logits' dtype and contiguous even for a non-contiguous logits view
        grad = logits.new_empty(grad_out.numel(), logits.shape[-1])
        for rows, chunk in _row_chunks(logits):
            c = _scaled_rows(chunk, temperature)  # (n, V)
            # Clamped -inf (as in entropy_from_logits): log p stays finite, so p * (log p + H) = 0 * finite
            # = 0 for masked vocabulary entries instead of 0 * -inf = NaN.
            finite = c.clamp(min=torch.finfo(c.dtype).min)  # (n, V)
            log_p = finite - torch.logsumexp(c, dim=-1, keepdim=True)  # (n, V)
            p = torch.softmax(c, dim=-1)  # (n, V)
            h = -(p * log_p).sum(-1, keepdim=True)  # (n, 1)
            grad[rows] = -p * (log_p + h) * g_rows[rows]  # cast to the logits' dtype on write
        return grad.reshape(logits.shape), None


def entropy_with_grad(logits: Tensor, *, temperature: float = 1.0) -> Tensor:
    """Entropy of ``softmax(logits / temperature)`` over the last dimension, differentiable w.r.t. ``logits``.

    The values are :func:`entropy_from_logits`'s (row chunks, float32 for half-precision input, ``-inf``
    logits contribute 0). Memory: backward saves only ``logits`` (their own dtype) and recomputes the
    softmax one chunk of rows at a time, so an entropy bonus costs no (B, T, V) activation beyond the
    logits themselves and no float32 temporary larger than a few (_ROW_CHUNK, V). The gradient w.r.t.
    the raw logits carries the extra ``1 / temperature`` factor.

    Args:
        logits: (..., V), e.g. (B, T, V).
        temperature: divisor of the logits, finite and > 0.

    Returns:
        (...) entropies in nats, e.g. (B, T); dtype of ``logits`` for float32/float64, float32 for half
        precision. The gradient reaching ``logits`` has their dtype.
    """
    if logits.dim() < 1:
        raise ValueError("logits must have at least one dimension (the vocabulary); pass a (..., V) tensor")
    _check_temperature(temperature)
    out: Tensor = _EntropyWithGrad.apply(logits, float(temperature))  # (...)
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
