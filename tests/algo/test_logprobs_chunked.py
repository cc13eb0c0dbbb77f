"""Chunked, temperature-aware selective_log_softmax / entropies: exact values, gradients and the memory
contract (no float32 (B, T, V) temporary or saved activation for half-precision logits)."""

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from rloo.algo import entropy_from_logits, entropy_with_grad, selective_log_softmax
from rloo.algo.logprobs import _ROW_CHUNK

TEMPERATURES = [1.0, 0.7]


def _reference_logp(logits, index, temperature):
    # the plain formula the chunked Function must equal, autograd through it for the gradient
    return torch.log_softmax(logits / temperature, dim=-1).gather(-1, index.unsqueeze(-1)).squeeze(-1)


def _reference_entropy(logits, temperature):
    z = logits / temperature
    # -inf logits: p = 0 and log p = -inf; their contribution is 0, written without the NaN of 0 * -inf
    log_p = torch.log_softmax(z, dim=-1).masked_fill(torch.isneginf(z), 0.0)
    return -(torch.softmax(z, dim=-1) * log_p).sum(-1)


def _masked_logits(b, t, v, *, seed, dtype=torch.float64):
    """(b, t, v) random logits with some vocabulary entries masked to -inf, spanning several row chunks."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, t, v, generator=g, dtype=torch.float64) * 3
    masked = torch.rand(b, t, v, generator=g) < 0.3
    masked[..., 0] = False  # keep one finite entry per row
    logits = logits.masked_fill(masked, -math.inf)
    # index a finite token of every row: the first unmasked one at or after a random start
    start = torch.randint(0, v, (b, t), generator=g)
    order = (torch.arange(v) - start.unsqueeze(-1)) % v  # (b, t, v) distance from start
    index = torch.where(masked, v, order).argmin(-1)  # (b, t)
    return logits.to(dtype), index, masked


# --- hand-computed ------------------------------------------------------------------------------------


def test_hand_values_at_temperature_one_and_two():
    # logits [0, ln 2, ln 3]: exp = [1, 2, 3], probs [1/6, 2/6, 3/6]; token 2 -> ln(1/2) = -0.693147
    logits = torch.tensor([[0.0, math.log(2.0), math.log(3.0)]], dtype=torch.float64, requires_grad=True)
    index = torch.tensor([2])
    out = selective_log_softmax(logits, index)
    assert out.shape == (1,)
    assert out.item() == pytest.approx(math.log(0.5), abs=1e-15)
    # gradient onehot - p = [-1/6, -2/6, 1 - 3/6]
    (grad,) = torch.autograd.grad(out.sum(), logits)
    torch.testing.assert_close(grad, torch.tensor([[-1 / 6, -2 / 6, 1 / 2]], dtype=torch.float64))
    # temperature 2: z = [0, ln 2 / 2, ln 3 / 2], exp = [1, sqrt 2, sqrt 3], sum S = 1 + 1.414214 + 1.732051
    # = 4.146264; p_2 = sqrt 3 / S = 0.417738, ln p_2 = ln 0.4 + ln 1.044345 = -0.916291 + 0.043389 = -0.872902
    s = 1 + math.sqrt(2) + math.sqrt(3)
    out = selective_log_softmax(logits, index, temperature=2.0)
    assert out.item() == pytest.approx(math.log(math.sqrt(3) / s), abs=1e-15)
    assert out.item() == pytest.approx(-0.872902, abs=1e-6)
    # d/dlogit_j = (onehot_j - p_j) / 2 = [-1/S, -sqrt 2 / S, 1 - sqrt 3 / S] / 2
    (grad,) = torch.autograd.grad(out.sum(), logits)
    expected = torch.tensor([[-1 / s, -math.sqrt(2) / s, 1 - math.sqrt(3) / s]], dtype=torch.float64) / 2
    torch.testing.assert_close(grad, expected)
    # entropies of the same rows: T = 1: ln 6 / 6 + ln 3 / 3 + ln 2 / 2 = 0.298627 + 0.366204 + 0.346574
    h1 = math.log(6) / 6 + math.log(3) / 3 + math.log(2) / 2
    assert entropy_from_logits(logits.detach()).item() == pytest.approx(1.011404, abs=1e-6)
    assert entropy_with_grad(logits).item() == pytest.approx(h1, abs=1e-15)
    # T = 2: p = [1, sqrt 2, sqrt 3] / S, H = ln S - (sqrt 2 ln 2 / 2 + sqrt 3 ln 3 / 2) / S
    h2 = math.log(s) - (math.sqrt(2) * math.log(2) / 2 + math.sqrt(3) * math.log(3) / 2) / s
    assert entropy_from_logits(logits.detach(), temperature=2.0).item() == pytest.approx(h2, abs=1e-15)
    assert entropy_with_grad(logits, temperature=2.0).item() == pytest.approx(h2, abs=1e-15)


# --- float64: exact against the plain formula -----------------------------------------------------------


@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_float64_values_and_gradients_match_reference_across_chunks(temperature):
    # 2 * 70 = 140 rows > _ROW_CHUNK: two chunks, the second partial; about 30% of the vocabulary -inf
    logits, index, masked = _masked_logits(2, 70, 13, seed=0)
    assert _ROW_CHUNK < 2 * 70 and masked.any()
    logits.requires_grad_()
    w = torch.randn(2, 70, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    out = selective_log_softmax(logits, index, temperature=temperature)
    expected = _reference_logp(logits, index, temperature)
    assert out.dtype == torch.float64 and torch.isfinite(out).all()
    torch.testing.assert_close(out, expected, atol=1e-12, rtol=0)
    (grad,) = torch.autograd.grad((out * w).sum(), logits)
    (expected_grad,) = torch.autograd.grad((expected * w).sum(), logits)
    assert torch.isfinite(grad).all() and (grad[masked] == 0).all()
    torch.testing.assert_close(grad, expected_grad, atol=1e-12, rtol=0)


def test_float64_temperature_changes_the_answer():
    # guards the tests above against a temperature that is silently ignored
    logits, index, _ = _masked_logits(1, 4, 9, seed=2)
    hot = selective_log_softmax(logits, index, temperature=0.7)
    cold = selective_log_softmax(logits, index)
    assert (hot - cold).abs().max() > 1e-2


@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_gradcheck_float64(temperature):
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 3, 5, generator=g, dtype=torch.float64, requires_grad=True)
    index = torch.tensor([[0, 4, 4], [2, 1, 0]])
    assert torch.autograd.gradcheck(
        lambda x: selective_log_softmax(x, index, temperature=temperature), (logits,)
    )
    assert torch.autograd.gradcheck(lambda x: entropy_with_grad(x, temperature=temperature), (logits,))


@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_entropies_float64_match_reference_across_chunks(temperature):
    logits, _, masked = _masked_logits(2, 70, 13, seed=4)
    logits.requires_grad_()
    w = torch.randn(2, 70, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    expected = _reference_entropy(logits, temperature)
    torch.testing.assert_close(
        entropy_from_logits(logits.detach(), temperature=temperature), expected.detach(), atol=1e-12, rtol=0
    )
    out = entropy_with_grad(logits, temperature=temperature)
    torch.testing.assert_close(out, expected, atol=1e-12, rtol=0)
    (grad,) = torch.autograd.grad((out * w).sum(), logits)
    (expected_grad,) = torch.autograd.grad((expected * w).sum(), logits)
    assert torch.isfinite(grad).all() and (grad[masked] == 0).all()
    torch.testing.assert_close(grad, expected_grad, atol=1e-12, rtol=0)


# --- bfloat16: float32 math, bf16 gradient ------------------------------------------------------------


@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_bfloat16_values_and_gradient(temperature):
    logits64, index, _ = _masked_logits(2, 70, 50, seed=6)
    logits = logits64.to(torch.bfloat16).requires_grad_()
    up = logits.detach().double().requires_grad_()  # the same bf16 values, exactly, in float64
    w = torch.randn(2, 70, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    out = selective_log_softmax(logits, index, temperature=temperature)
    expected = _reference_logp(up, index, temperature)
    assert out.dtype == torch.float32
    # float32 chunks: far inside the brief's 1e-2 (bf16 arithmetic would miss even 1e-2 on these rows)
    torch.testing.assert_close(out.double(), expected.detach(), atol=1e-5, rtol=0)
    (grad,) = torch.autograd.grad((out * w.float()).sum(), logits)
    (expected_grad,) = torch.autograd.grad((expected * w).sum(), up)
    assert grad.dtype == torch.bfloat16
    # stored in bf16: off by its rounding, a relative 2**-9, beyond the absolute 1e-2
    torch.testing.assert_close(grad.double(), expected_grad, atol=1e-2, rtol=2**-8)
    # entropies: float32 values, bf16 gradient
    ent = entropy_with_grad(logits, temperature=temperature)
    expected_ent = _reference_entropy(up, temperature)
    assert ent.dtype == torch.float32
    torch.testing.assert_close(ent.double(), expected_ent.detach(), atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy_from_logits(logits.detach(), temperature=temperature), ent.detach())
    (grad,) = torch.autograd.grad((ent * w.float()).sum(), logits)
    (expected_grad,) = torch.autograd.grad((expected_ent * w).sum(), up)
    assert grad.dtype == torch.bfloat16
    # stored in bf16: off by its rounding, a relative 2**-9, beyond the absolute 1e-2
    torch.testing.assert_close(grad.double(), expected_grad, atol=1e-2, rtol=2**-8)


def test_non_contiguous_logits_view():
    # the trainer's logits[:, :-1] of a (B, T + 1, V) output: leading dims that cannot be merged
    g = torch.Generator().manual_seed(8)
    full = (torch.randn(3, 71, 17, generator=g, dtype=torch.float64) * 2).requires_grad_()
    logits = full[:, :-1]
    index = torch.randint(0, 17, (3, 70), generator=g)
    w = torch.randn(3, 70, generator=g, dtype=torch.float64)
    out = selective_log_softmax(logits, index, temperature=0.7)
    expected = _reference_logp(logits, index, 0.7)
    torch.testing.assert_close(out, expected, atol=1e-12, rtol=0)
    (grad,) = torch.autograd.grad((out * w).sum(), full)
    (expected_grad,) = torch.autograd.grad((expected * w).sum(), full)
    torch.testing.assert_close(grad, expected_grad, atol=1e-12, rtol=0)
    ent = entropy_with_grad(logits, temperature=0.7)
    expected_ent = _reference_entropy(logits, 0.7)
    torch.testing.assert_close(ent, expected_ent, atol=1e-12, rtol=0)
    (grad,) = torch.autograd.grad((ent * w).sum(), full)
    (expected_grad,) = torch.autograd.grad((expected_ent * w).sum(), full)
    torch.testing.assert_close(grad, expected_grad, atol=1e-12, rtol=0)


def test_temperature_must_be_positive_and_finite():
    logits = torch.zeros(1, 2, 3)
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="temperature"):
            selective_log_softmax(logits, torch.zeros(1, 2, dtype=torch.long), temperature=bad)
        with pytest.raises(ValueError, match="temperature"):
            entropy_from_logits(logits, temperature=bad)
        with pytest.raises(ValueError, match="temperature"):
            entropy_with_grad(logits, temperature=bad)


# --- memory contract ------------------------------------------------------------------------------------


def _saved_for_backward(fn):
    """Run ``fn()`` and list (shape, dtype, bytes) of every tensor autograd saves for its backward."""
    saved = []

    def pack(t):
        saved.append((tuple(t.shape), t.dtype, t.numel() * t.element_size()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, saved


@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_saved_for_backward_is_the_bf16_logits_plus_per_row_stats(temperature):
    b, t, v = 3, 70, 1000
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(b, t, v, generator=g).to(torch.bfloat16).requires_grad_()
    index = torch.randint(0, v, (b, t), generator=g)
    bound = logits.numel() * logits.element_size() + 16 * b * t  # the logits + O(B*T) (index int64, lse)
    out, saved = _saved_for_backward(lambda: selective_log_softmax(logits, index, temperature=temperature))
    assert sum(nbytes for _, _, nbytes in saved) <= bound, saved
    assert not [s for s in saved if s[1] == torch.float32 and s[0][-1] == v], saved
    out.sum().backward()  # the saved tensors suffice
    _, saved = _saved_for_backward(lambda: entropy_with_grad(logits, temperature=temperature))
    assert sum(nbytes for _, _, nbytes in saved) <= bound, saved
    # the detector itself: the old recipe (upcast, divide, log_softmax) saves float32 (B, T, V) tensors
    _, saved = _saved_for_backward(lambda: _reference_logp(logits.float(), index, temperature))
    assert sum(nbytes for _, _, nbytes in saved) > bound + 4 * b * t * v


class _LargestTensors(TorchDispatchMode):
    """Largest float32 tensor (in elements) and largest tensor of any dtype that any op allocates.

    View ops are left out (they allocate nothing). Temporaries inside one kernel (e.g. logsumexp's exp)
    are not seen, only what each op returns; those are no larger than the op's own (n, V) input here.
    """

    def __init__(self):
        super().__init__()
        self.float32 = 0
        self.any = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self.any = max(self.any, t.numel())
                    if t.dtype == torch.float32:
                        self.float32 = max(self.float32, t.numel())
        return out


@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_no_float32_temporary_beyond_one_chunk(temperature):
    b, t, v = 3, 101, 1000  # 303 rows: chunks of 128, 128, 47 (contiguous); 101 + 0 per batch row (view)
    g = torch.Generator().manual_seed(10)
    full = torch.randn(b, t + 1, v, generator=g).to(torch.bfloat16)
    index = torch.randint(0, v, (b, t), generator=g)
    chunk = _ROW_CHUNK * v
    assert chunk < b * t * v
    for logits in (full[:, :-1].contiguous(), full[:, :-1]):  # a contiguous tensor and the trainer's view
        logits = logits.detach().requires_grad_()
        w = torch.randn(b, t, generator=g)
        mode = _LargestTensors()
        with mode:
            out = selective_log_softmax(logits, index, temperature=temperature)
        # float32 upcasts of one chunk at most; nothing else (no reshape copy of the bf16 logits either)
        assert 0 < mode.float32 <= chunk and mode.any <= chunk, (mode.float32, mode.any)
        mode = _LargestTensors()
        with mode:
            (grad,) = torch.autograd.grad((out * w).sum(), logits)
        # backward: float32 chunks plus the bf16 gradient itself
        assert 0 < mode.float32 <= chunk and mode.any == b * t * v, (mode.float32, mode.any)
        assert grad.dtype == torch.bfloat16
        for fn in (entropy_from_logits, entropy_with_grad):
            mode = _LargestTensors()
            with mode:
                ent = fn(logits, temperature=temperature)
            assert 0 < mode.float32 <= chunk and mode.any <= chunk, (fn.__name__, mode.float32, mode.any)
        mode = _LargestTensors()
        with mode:
            (grad,) = torch.autograd.grad((ent * w).sum(), logits)
        assert 0 < mode.float32 <= chunk and mode.any == b * t * v, (mode.float32, mode.any)
    # the detector itself: the old recipe's upcast is one float32 (B, T, V) tensor
    mode = _LargestTensors()
    with mode:
        _reference_logp(full.float(), torch.zeros(b, t + 1, dtype=torch.long), temperature)
    assert mode.float32 == b * (t + 1) * v
