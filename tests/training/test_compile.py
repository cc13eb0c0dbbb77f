"""rloo.training.compile: the aten ops a training micro-batch runs per decoder layer (the host-bound cost
of an eager step on a GPU), autocast's weight casts, and compiled decoder layers: same loss and
gradients as eager, one graph for all layers, checkpoints unchanged."""

from __future__ import annotations

import collections
import contextlib
import copy
import functools
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch._dynamo.testing import CompileCounter
from torch.utils._python_dispatch import TorchDispatchMode

from rloo.algo import selective_log_softmax
from rloo.demo.tiny import build_causal_lm, build_tokenizer
from rloo.forward import response_logits
from rloo.models import load_causal_lm
from rloo.training.compile import compile_decoder_layers, count_aten_ops, decoder_layers, is_compiled
from rloo.training.trainer import enable_activation_checkpointing

CAST = "aten._to_copy.default"
# Inductor's CPU code needs a C++ compiler; without one the compiled-vs-eager test checks graph capture
# and AOT autograd only.
BACKEND = "inductor" if shutil.which(os.environ.get("CXX", "g++")) else "aot_eager"


def _bf16() -> contextlib.AbstractContextManager[Any]:
    return torch.autocast("cpu", dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def make_lm(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., nn.Module]:
    """A fresh tiny causal LM (hidden 32, 4 heads, fp32) with ``layers`` decoder layers; built once per
    (arch, layers), loaded anew at every call (tests compile them in place)."""
    root = tmp_path_factory.mktemp("compile")
    tok = build_tokenizer(root / "tok")
    assert tok is not None
    built: dict[tuple[str, int], Path] = {}

    def make(arch: str = "qwen2", layers: int = 2) -> nn.Module:
        if (arch, layers) not in built:
            built[arch, layers] = build_causal_lm(
                root / f"{arch}-{layers}", root / "tok", arch=arch, num_layers=layers, hidden_size=32, seed=0
            )
        return load_causal_lm(str(built[arch, layers]), flag="model_name_or_path")

    return make


def _batch(width: int = 6, t: int = 5) -> tuple[torch.Tensor, ...]:
    """Two left-padded prompts of ``width`` tokens, two responses of ``t`` tokens to each."""
    g = torch.Generator().manual_seed(100 * width + t)
    prompt_ids = torch.randint(5, 300, (2, width), generator=g)  # (P, L)
    prompt_mask = torch.ones_like(prompt_ids)
    prompt_mask[0, :2] = 0  # left padding
    rows = torch.tensor([0, 0, 1, 1])  # (b,)
    responses = torch.randint(5, 300, (4, t), generator=g)  # (b, T)
    return prompt_ids, prompt_mask, rows, responses


def _step(
    model: nn.Module, batch: tuple[torch.Tensor, ...], *, share: bool = False, autocast: Any = None
) -> torch.Tensor:
    """One training micro-batch: response logits, log-probs, a sum loss, backward. The loss."""
    model.zero_grad(set_to_none=True)
    logits = response_logits(model, *batch, share_prefix=share, autocast=autocast)  # (b, T, V)
    loss = selective_log_softmax(logits.float(), batch[3]).sum()
    loss.backward()
    return loss.detach()


def _one_region_step(model: nn.Module, share: bool) -> None:
    """The forward in one autocast region around the whole of response_logits (as the trainer runs it)."""
    batch = _batch()
    model.zero_grad(set_to_none=True)
    with _bf16():
        logits = response_logits(model, *batch, share_prefix=share, autocast=None)
    selective_log_softmax(logits.float(), batch[3]).sum().backward()


# ----------------------------------------------------------------------------------------------------
# op counts


def test_count_aten_ops_counts_forward_and_backward() -> None:
    a = torch.randn(3, 4, requires_grad=True)
    b = torch.randn(4, 5)
    forward = count_aten_ops(lambda: a @ b)
    both = count_aten_ops(lambda: (a @ b).sum().backward())
    assert forward["aten.mm.default"] == 1
    assert both["aten.mm.default"] == 2  # grad_a = grad @ b.T
    assert both["aten.sum.default"] == 1


# Measured with torch 2.13 (CPU), transformers 5.23, sdpa attention, qwen2 (q/k/v biases), one
# micro-batch (4 rows, 6 prompt + 5 response tokens) forward + backward under one bf16 autocast region,
# per decoder layer:
#   share_prefix=False: 263 aten ops, 40 of them casts (aten._to_copy)
#   share_prefix=True:  537 aten ops, 68 casts (two model calls: prefill, then the responses)
# With share_prefix=True and an autocast region per model call (response_logits(autocast=ctx), what the
# trainer passed before it opened one region per micro-batch; the H100 profile's 88) it is 557 ops and 88
# casts: each weight cast to bf16 twice, and its gradient cast back twice. Budgets: the measurement + ~10%.
BUDGETS = {False: (290, 44), True: (590, 75)}  # share_prefix: (ops, casts) per layer


@pytest.mark.parametrize("share", [False, True], ids=["full-rows", "share-prefix"])
def test_aten_ops_per_decoder_layer_within_budget(make_lm: Callable[..., nn.Module], share: bool) -> None:
    # Two models that differ only in their layer count: the difference of their counts is the layers'
    # own, without the outer constant (embeddings, masks, output layer, log-softmax, loss).
    counts = {
        n: count_aten_ops(functools.partial(_one_region_step, make_lm(layers=n), share)) for n in (1, 3)
    }
    ops = (counts[3].total() - counts[1].total()) / 2
    casts = (counts[3][CAST] - counts[1][CAST]) / 2
    budget_ops, budget_casts = BUDGETS[share]
    measured = f"measured {ops:g} aten ops per layer, {casts:g} casts (share_prefix={share})"
    print(measured)
    assert ops <= budget_ops, f"{measured}: over the budget of {budget_ops} ops"
    assert casts <= budget_casts, f"{measured}: over the budget of {budget_casts} casts"


class _WeightCasts(TorchDispatchMode):
    """How often each parameter is cast (autocast's low-precision weight copies), by name."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.names = {id(p): n for n, p in model.named_parameters()}
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        if func is torch.ops.aten._to_copy.default and id(args[0]) in self.names:
            self.counts[self.names[id(args[0])]] += 1
        return func(*args, **(kwargs or {}))


def test_one_autocast_region_casts_each_layer_weight_once(make_lm: Callable[..., nn.Module]) -> None:
    # The share-prefix forward makes two model calls. Autocast caches its casts of leaf parameters only
    # within one region, so a region per call (response_logits(autocast=ctx)) casts every weight twice;
    # one region around the whole call (autocast=None inside it) casts each once: 10 fewer forward and
    # 10 fewer backward casts per qwen2 layer (88 -> 68).
    model = make_lm(layers=2)
    prefixes = tuple(f"{n}." for n, m in model.named_modules() if m is decoder_layers(model))
    batch = _batch()

    def layer_casts(one_region: bool) -> dict[str, int]:
        mode = _WeightCasts(model)
        with mode:
            if one_region:
                with _bf16():
                    response_logits(model, *batch, share_prefix=True, autocast=None)
            else:
                response_logits(model, *batch, share_prefix=True, autocast=_bf16)
        return {n: c for n, c in mode.counts.items() if n.startswith(prefixes)}

    two, one = layer_casts(one_region=False), layer_casts(one_region=True)
    # qwen2: q, k, v, o, gate, up, down weights and the q/k/v biases; the norms' weights stay fp32
    assert len(one) == len(two) == 2 * 10, sorted(one)
    # response_logits(autocast=ctx) enters ctx per model call (were it to enter it once, this reads {1})
    assert set(two.values()) == {2}, f"a region per model call: {two}"
    assert set(one.values()) == {1}, f"one region around response_logits: {one}"


# ----------------------------------------------------------------------------------------------------
# decoder layers


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")  # PEFT's call
@pytest.mark.parametrize(
    ("arch", "block"),
    [("qwen2", "Qwen2DecoderLayer"), ("llama", "LlamaDecoderLayer"), ("gpt_neox", "GPTNeoXLayer")],
)
def test_decoder_layers_found_through_wrappers(
    make_lm: Callable[..., nn.Module], arch: str, block: str
) -> None:
    model = make_lm(arch=arch, layers=3)
    layers = decoder_layers(model)
    assert isinstance(layers, nn.ModuleList)
    assert len(layers) == 3 and type(layers[0]).__name__ == block

    class Engine(nn.Module):  # a DeepSpeed engine or DDP wrapper: the model in `.module`
        def __init__(self, module: nn.Module) -> None:
            super().__init__()
            self.module = module

    assert decoder_layers(Engine(model)) is layers
    peft = pytest.importorskip("peft")
    wrapped = peft.get_peft_model(model, peft.LoraConfig(task_type="CAUSAL_LM", r=2, lora_alpha=4))
    assert decoder_layers(wrapped) is layers  # PEFT swaps the projections inside the same blocks


def test_decoder_layers_of_a_model_without_blocks_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"no decoder layers .* in Sequential; turn layer compilation off"):
        decoder_layers(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))


# ----------------------------------------------------------------------------------------------------
# compiled layers


@pytest.fixture(scope="module")
def compiled(make_lm: Callable[..., nn.Module]) -> dict[str, Any]:
    """A 2-layer model compiled with BACKEND and an eager copy, each after one fp32 training step."""
    eager = make_lm(layers=2)
    model = copy.deepcopy(eager)
    keys, params = list(model.state_dict()), list(model.parameters())
    count = compile_decoder_layers(model, backend=BACKEND)
    start = time.perf_counter()
    loss = _step(model, _batch())  # compiles (lazily) here: forward and backward graphs
    seconds = time.perf_counter() - start
    print(f"first compiled step ({BACKEND}): {seconds:.1f}s")
    return {
        "model": model,
        "eager": eager,
        "loss": loss,
        "eager_loss": _step(eager, _batch()),
        "count": count,
        "keys": keys,
        "params": params,
    }


def test_compiled_layers_match_eager_in_fp32(compiled: dict[str, Any]) -> None:
    model, eager = compiled["model"], compiled["eager"]
    assert compiled["count"] == 2 and all(is_compiled(layer) for layer in decoder_layers(model))
    torch.testing.assert_close(compiled["loss"], compiled["eager_loss"], rtol=1e-5, atol=1e-5)
    grads = dict(model.named_parameters())
    for name, p in eager.named_parameters():
        assert grads[name].grad is not None, name
        torch.testing.assert_close(grads[name].grad, p.grad, rtol=1e-5, atol=1e-5, msg=name)


def test_compiling_in_place_keeps_parameters_and_state_dict(compiled: dict[str, Any]) -> None:
    model = compiled["model"]
    assert list(model.state_dict()) == compiled["keys"]  # checkpoints and the optimizer see no wrapper
    assert all(a is b for a, b in zip(model.parameters(), compiled["params"], strict=True))
    layers = decoder_layers(model)
    calls = [layer._compiled_call_impl for layer in layers]
    assert compile_decoder_layers(model, backend=BACKEND) == 2  # a second call: nothing changes
    assert all(layer._compiled_call_impl is c for layer, c in zip(layers, calls, strict=True))


def test_compiled_model_saves_and_reloads(compiled: dict[str, Any], tmp_path: Path) -> None:
    model = compiled["model"]
    model.save_pretrained(tmp_path / "saved")
    reloaded = load_causal_lm(str(tmp_path / "saved"), flag="model_name_or_path")
    expected = model.state_dict()
    got = reloaded.state_dict()
    assert list(got) == list(expected)
    for name, tensor in expected.items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=0, msg=name)


def test_layers_share_one_graph_and_cache_calls_run_eager(make_lm: Callable[..., nn.Module]) -> None:
    # A plain counting backend (no codegen): how many graphs the three layers compile. Calls with a KV
    # cache (the share-prefix forward) run eager; they would specialise per layer.
    model = make_lm(layers=3)
    eager = copy.deepcopy(model)
    counter = CompileCounter()
    compile_decoder_layers(model, backend=counter)
    for shape in [(6, 5), (9, 5)]:
        batch = _batch(*shape)
        torch.testing.assert_close(_step(model, batch, share=True), _step(eager, batch, share=True))
    assert counter.frame_count == 0
    for shape in [(6, 5), (9, 5), (8, 7)]:
        batch = _batch(*shape)
        torch.testing.assert_close(_step(model, batch), _step(eager, batch))
    # one static graph for the first shape, one shape-generic graph after the second: for all 3 layers
    assert counter.frame_count == 2


def test_compiled_layers_with_activation_checkpointing_match_eager(make_lm: Callable[..., nn.Module]) -> None:
    # transformers checkpoints inside the layer's forward: the checkpoint is traced into the graph
    model = make_lm(layers=2)
    eager = copy.deepcopy(model)
    for m in (model, eager):
        enable_activation_checkpointing(m)
        m.train()
    compile_decoder_layers(model, backend="aot_eager")
    torch.testing.assert_close(_step(model, _batch()), _step(eager, _batch()), rtol=1e-5, atol=1e-5)
    grads = dict(model.named_parameters())
    for name, p in eager.named_parameters():
        torch.testing.assert_close(grads[name].grad, p.grad, rtol=1e-5, atol=1e-5, msg=name)
