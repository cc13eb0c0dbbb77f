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
import torch._dynamo.utils
from torch import nn
from torch._dynamo.testing import CompileCounter, CompileCounterWithBackend
from torch.utils._python_dispatch import TorchDispatchMode

from rloo.algo import selective_log_softmax
from rloo.demo.tiny import build_causal_lm, build_tokenizer
from rloo.forward import response_logits
from rloo.models import load_causal_lm
from rloo.training.compile import compile_decoder_layers, count_aten_ops, decoder_layers, is_compiled
from rloo.training.completion_logprobs import LogProbs
from rloo.training.trainer import enable_activation_checkpointing
from tests.fixtures.logprob_inputs import Completions, NoAutocast

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
    model: nn.Module,
    batch: tuple[torch.Tensor, ...],
    *,
    share: bool = False,
    packed: bool = False,
    autocast: Any = None,
    width_multiple: int = 1,
) -> torch.Tensor:
    """One training micro-batch: response logits, log-probs, a sum loss, backward. The loss. ``share``
    without ``packed``: through the KV cache."""
    model.zero_grad(set_to_none=True)
    logits = response_logits(
        model, *batch, share_prefix=share, packed=packed, autocast=autocast, width_multiple=width_multiple
    )  # (b, T, V)
    loss = selective_log_softmax(logits.float(), batch[3]).sum()
    loss.backward()
    return loss.detach()


def _one_region_step(model: nn.Module, plan: str) -> None:
    """The forward in one autocast region around the whole of response_logits (as the trainer runs it);
    ``plan``: "full-rows", "kv-cache" or "packed"."""
    batch = _batch()
    model.zero_grad(set_to_none=True)
    with _bf16():
        logits = response_logits(
            model, *batch, share_prefix=plan != "full-rows", packed=plan == "packed", autocast=None
        )
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
#   full rows:          263 aten ops, 40 of them casts (aten._to_copy)
#   KV-cache sharing:   537 aten ops, 68 casts (two model calls: prefill, then the responses)
#   packed rows:        263 aten ops, 40 casts (one call, a 4D mask: the same layer code as full rows)
# With KV-cache sharing and an autocast region per model call (response_logits(autocast=ctx), what the
# trainer passed before it opened one region per micro-batch; the H100 profile's 88) it is 557 ops and 88
# casts: each weight cast to bf16 twice, and its gradient cast back twice. Budgets: the measurement + ~10%.
BUDGETS = {"full-rows": (290, 44), "kv-cache": (590, 75), "packed": (290, 44)}  # (ops, casts) per layer


@pytest.mark.parametrize("plan", list(BUDGETS))
def test_aten_ops_per_decoder_layer_within_budget(make_lm: Callable[..., nn.Module], plan: str) -> None:
    # Two models that differ only in their layer count: the difference of their counts is the layers'
    # own, without the outer constant (embeddings, masks, output layer, log-softmax, loss).
    counts = {n: count_aten_ops(functools.partial(_one_region_step, make_lm(layers=n), plan)) for n in (1, 3)}
    ops = (counts[3].total() - counts[1].total()) / 2
    casts = (counts[3][CAST] - counts[1][CAST]) / 2
    budget_ops, budget_casts = BUDGETS[plan]
    measured = f"measured {ops:g} aten ops per layer, {casts:g} casts ({plan})"
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
                    response_logits(model, *batch, share_prefix=True, packed=False, autocast=None)
            else:
                response_logits(model, *batch, share_prefix=True, packed=False, autocast=_bf16)
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
    # cache (the KV-cache share-prefix forward) run eager; they would specialise per layer.
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
    # rows and columns marked dynamic from the first call: one shape-generic graph for all 3 layers and
    # every shape (torch.compile's default alone compiles the first shape static, then a generic one)
    assert counter.frame_count == 1


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


# ----------------------------------------------------------------------------------------------------
# packed rows under compiled layers


def test_packed_rows_run_compiled_and_match_eager(make_lm: Callable[..., nn.Module]) -> None:
    # Packed rows share each prompt without a KV cache: the compiled graph runs them (no eager fallback)
    # and gives eager's loss and gradients.
    model = make_lm(layers=2)
    eager = copy.deepcopy(model)
    counter = CompileCounterWithBackend("aot_eager")
    compile_decoder_layers(model, backend=counter)
    batch = _batch(9, 5)
    got = _step(model, batch, share=True, packed=True, width_multiple=64)
    want = _step(eager, batch)  # plain rows, eager
    assert counter.frame_count == 1
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    grads = dict(model.named_parameters())
    for name, p in eager.named_parameters():
        torch.testing.assert_close(grads[name].grad, p.grad, rtol=1e-5, atol=1e-5, msg=name)


def _completions(width: int, *, groups: int, left_padded: bool, seed: int, k: int = 2) -> Completions:
    """``groups`` prompts of ``width`` tokens (all left-padded, or none), K responses of 5 tokens each."""
    g = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(5, 300, (groups, width), generator=g)  # (P, L)
    prompt_mask = torch.ones_like(prompt_ids)
    if left_padded:
        prompt_mask[:, : width // 2] = 0
    rows = torch.arange(groups).repeat_interleave(k)  # (b,)
    responses = torch.randint(5, 300, (groups * k, 5), generator=g)  # (b, T)
    return Completions(prompt_ids, prompt_mask, rows, responses)


@pytest.mark.parametrize("share", [True, False], ids=["shared", "plain"])
def test_no_recompiles_after_the_first_update(make_lm: Callable[..., nn.Module], share: bool) -> None:
    # Each update as the trainer runs it: the producer's no-grad log-probs (eval mode), then the update's
    # forward and backward per micro-batch (train mode), through LogProbs. Prompt widths and left padding
    # (or none: a 2D mask would become None) change every update; the batch's shape does not (as in
    # training: the same rollout and micro-batch sizes every update), and its 3 groups split 2 + 1 into
    # chunks and micro-batches, so the rows of a call vary too (one row is its own graph, compiled once).
    # The graphs of the first update serve all the others.
    model = make_lm(layers=2)
    counter = CompileCounterWithBackend("aot_eager")
    compile_decoder_layers(model, backend=counter)
    lp = LogProbs(
        NoAutocast(), model, temperature=1.0, cache_free=True, compiled_layers=True, rloo_k=2, chunk_size=4
    )
    plan = [(6, True), (40, False), (9, False), (70, True), (20, True), (100, False)]
    graphs = []
    for update, (width, left_padded) in enumerate(plan):
        ro = _completions(width, groups=3, left_padded=left_padded, seed=update)
        if not share:  # short prompts, long responses: nothing worth sharing, plain rows packed one per row
            ro = _completions(2 + update % 2, groups=3, left_padded=left_padded, seed=update)
            ro.responses = torch.randint(5, 300, (6, 20 + 10 * update))
        model.eval()
        lp.batched(model, ro)
        model.train()
        for mb in torch.arange(6).split(4):
            logprobs, _ = lp.forward(model, ro, mb, entropy=True)
            logprobs.sum().backward()
        graphs.append((counter.frame_count, torch._dynamo.utils.counters["stats"]["unique_graphs"]))
    assert counter.frame_count > 0
    assert graphs[1:] == graphs[:1] * (len(plan) - 1), graphs
