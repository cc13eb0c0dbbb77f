"""Compile the decoder layers of the policy, one graph for all of them, and count the ops a step runs.

The training step on a GPU is host-bound: eager PyTorch launches every aten op of every layer on its
own (a few hundred per decoder layer per micro-batch, forward and backward), and the GPU waits on
Python. Compiling fuses most of them. Layer by layer rather than the whole model because every layer
runs the same code: one compiled graph serves them all (the graph takes the layer's parameters as inputs,
``torch._dynamo.config.inline_inbuilt_nn_modules``), so it compiles once per shape class, not once per
layer; and the model's outer code (masks, position embeddings, cache objects), where graph breaks and
recompiles live, stays eager. ``nn.Module.compile`` compiles in place: parameters, ``state_dict`` keys,
``save_pretrained``, optimizer parameter groups and gradient hooks see the same modules as before.

A layer called with a KV cache runs eager (see :func:`compile_decoder_layers`); ``rloo.forward``'s packed
rows share each prompt without one, so the training forward compiles and shares.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["RECOMPILE_LIMIT", "compile_decoder_layers", "count_aten_ops", "decoder_layers", "is_compiled"]

# Graph variants the layers' one code object may hold (torch's default: 8). Every layer shares them, and
# a training run needs a static and a shape-generic graph for each kind of call: grad, no-grad/inference
# (old and reference log-probs), and with LoRA also the first layer (its input needs no grad) and the
# adapters switched off: 8 already. Past the limit dynamo runs the new variants eager, silently slow.
RECOMPILE_LIMIT = 32


def _numel(p: torch.Tensor) -> int:
    """Elements of a parameter, also when ZeRO-3 has partitioned it away (``ds_numel``)."""
    return int(getattr(p, "ds_numel", p.numel()))


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The repeated transformer blocks of a causal LM (``model.model.layers`` for Llama/Qwen2,
    ``gpt_neox.layers`` for GPT-NeoX, ...), found the same way through a PEFT wrapper, a DeepSpeed engine
    or a DDP ``.module``: the ``nn.ModuleList`` whose children all share one class, preferring classes the
    model names in ``_no_split_modules`` (transformers' "a block is one unit" list), the largest by
    parameter count when several qualify (e.g. a vision tower beside the text decoder)."""
    no_split: set[str] = set()
    for m in model.modules():
        no_split.update(getattr(m, "_no_split_modules", None) or ())
    lists = [
        m
        for m in model.modules()
        if isinstance(m, nn.ModuleList) and len(m) > 0 and len({type(c) for c in m}) == 1
    ]
    blocks = [m for m in lists if type(m[0]).__name__ in no_split] or lists
    if not blocks:
        raise ValueError(
            f"no decoder layers (an nn.ModuleList of identical blocks) found in {type(model).__name__}; "
            "turn layer compilation off for this model"
        )
    return max(blocks, key=lambda m: sum(_numel(p) for p in m.parameters()))


# The dims of a decoder layer's tensor arguments that follow the batch's rows and columns (sequence
# length); the rest (hidden size, head dim) are the model's and stay static.
_ROW_DIMS = {
    "hidden_states": (0, 1),  # (R, W, H)
    "attention_mask": (0, -2, -1),  # (R, 1, W, W) 4D, or (R, W)
    "position_ids": (0, 1),  # (R, W)
    "position_embeddings": (0, 1),  # cos, sin: (R, W, D) each
}


def _mark_row_dims(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Mark the row and column dims of a layer call's tensors dynamic before its first compile.

    Left to torch.compile's default, the first call compiles a graph static in every dim and the first
    other width (or row count) recompiles a shape-generic one: a recompile in the second update, or any
    later one that first brings a new row count. Marked up front, the first graph already serves every
    later shape (size 0 and 1 still specialise: one more graph for a one-row call)."""
    import torch._dynamo

    named = dict(kwargs)
    if args:
        named["hidden_states"] = args[0]
    for name, dims in _ROW_DIMS.items():
        value = named.get(name)
        tensors = value if isinstance(value, tuple) else (value,)
        for t in tensors:
            if isinstance(t, torch.Tensor):
                for d in dims:
                    if -t.dim() <= d < t.dim():
                        torch._dynamo.maybe_mark_dynamic(t, d % t.dim())


class _EagerWithCache:
    """A layer's ``_compiled_call_impl``: the compiled call, except when the layer gets a KV cache.

    A layer that updates a cache indexes it by its own ``layer_idx`` and branches on the cache layer's
    state, so dynamo specialises the graph per layer: a model of N layers recompiles N times per call
    shape (2N for prefill then decode) until ``recompile_limit``, then falls back to eager, and the
    variants spent on the cache calls (generation, the KV-cache share-prefix forward) leave none for
    training. Cache calls therefore run eager here; cache-free calls (``use_cache=False``, packed rows)
    all share one graph. With ``mark_dynamic`` the rows and columns of every compiled call are dynamic
    from the first (:func:`_mark_row_dims`).
    """

    def __init__(
        self, compiled: Callable[..., Any], eager: Callable[..., Any], *, mark_dynamic: bool
    ) -> None:
        from transformers.cache_utils import Cache

        self.compiled = compiled
        self.eager = eager
        self.cache_type = Cache
        self.mark_dynamic = mark_dynamic

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        cache = self.cache_type
        if any(isinstance(v, cache) for v in kwargs.values()) or any(isinstance(a, cache) for a in args):
            return self.eager(*args, **kwargs)
        if self.mark_dynamic:
            _mark_row_dims(args, kwargs)
        return self.compiled(*args, **kwargs)


def is_compiled(layer: nn.Module) -> bool:
    """Whether :func:`compile_decoder_layers` compiled this layer."""
    return isinstance(layer._compiled_call_impl, _EagerWithCache)


def compile_decoder_layers(
    model: nn.Module, *, dynamic: bool | None = None, backend: str | Callable[..., Any] = "inductor"
) -> int:
    """Compile every decoder layer of ``model`` in place (``nn.Module.compile``); return how many
    layers are compiled. Lazy: each graph compiles at its first call. A second call changes nothing.

    ``dynamic=None`` (torch.compile's default, with the batch's row and column dims marked dynamic at
    every call, :func:`_mark_row_dims`) compiles one shape-generic graph per mode (grad/no-grad,
    train/eval; a one-row call specialises once more), whatever the number of layers and lengths.
    ``dynamic=False`` compiles each shape static; ``True`` makes every dim generic, the model's too.
    ``backend`` is torch.compile's ("aot_eager" to check graph capture without inductor's C++/Triton
    compile).

    Calls that pass a KV cache (``transformers.Cache``: generation, ``rloo.forward``'s KV-cache
    share-prefix path) run the layer eager: compiling them specialises per layer and spends the recompile
    budget (see :class:`_EagerWithCache`). ``rloo.forward``'s packed rows take no cache and compile; with
    their widths padded to a multiple of 64 and a 4D mask at every call (never None for an unpadded
    batch), every update after the first replays the graphs (``rloo.training.completion_logprobs``).
    Activation checkpointing (transformers >= 5 checkpoints inside the layer's ``forward``) is traced
    into the graph. ``copy.deepcopy`` and pickling drop the compilation (``Module.__getstate__``).
    Raises dynamo's ``recompile_limit`` (process-wide) to at least :data:`RECOMPILE_LIMIT`.
    """
    import torch._dynamo

    layers = decoder_layers(model)
    dynamo_config = torch._dynamo.config
    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, RECOMPILE_LIMIT)
    for layer in layers:
        if is_compiled(layer):
            continue
        layer.compile(dynamic=dynamic, backend=backend)
        compiled = layer._compiled_call_impl
        assert compiled is not None  # set by nn.Module.compile
        layer._compiled_call_impl = _EagerWithCache(compiled, layer._call_impl, mark_dynamic=dynamic is None)
    return len(layers)


class _AtenCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        self.counts[str(func)] += 1  # the overload: "aten.mm.default", "aten._to_copy.default"
        return func(*args, **(kwargs or {}))


def count_aten_ops(fn: Callable[[], Any]) -> collections.Counter[str]:
    """Run ``fn()`` and count the aten overloads it dispatches, keyed like ``"aten.mm.default"``: the
    ops eager mode launches one by one (views and other metadata-only ops included, as they cost host
    time too). Backward ops count when ``fn`` runs the backward (the mode follows autograd's threads).
    Autocast's casts show up as ``aten._to_copy.default``."""
    mode = _AtenCounter()
    with mode:
        fn()
    return mode.counts
