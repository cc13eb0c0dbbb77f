"""DeepSpeed (ZeRO-2/3) glue for the trainer, behind plain functions that are no-ops without DeepSpeed.

``deepspeed`` is imported lazily, only on paths that run under an accelerate DeepSpeed launch: importing it
initialises its accelerator detection and can interfere with other backends (vLLM), and it is not a
dependency of the project.

Under ZeRO-3 every rank holds a shard of each weight. Generating from the sharded model works (each forward
all-gathers layer by layer) but is slow and makes every forward a collective, so ranks must run the same
number of forwards; gathering the whole model once per rollout (``ds3_gather_for_generation``, the default)
is much faster when one full copy fits on a GPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

__all__ = [
    "checkpoint_safe_globals",
    "fill_deepspeed_config",
    "gather_for_generation",
    "gathered",
    "generation_needs_synced_steps",
    "is_deepspeed",
    "is_zero3",
    "prepare_reference_model",
    "unwrap_for_generation",
    "zero_stage",
]


def _plugin(accelerator: Any) -> Any:
    state = getattr(accelerator, "state", None)
    return getattr(state, "deepspeed_plugin", None)


def is_deepspeed(accelerator: Any) -> bool:
    """Whether the accelerator runs under DeepSpeed (any ZeRO stage)."""
    return _plugin(accelerator) is not None


def zero_stage(accelerator: Any) -> int:
    """The ZeRO stage in force: 0 without DeepSpeed."""
    plugin = _plugin(accelerator)
    if plugin is None:
        return 0
    # The resolved config is what DeepSpeed will use; the plugin attribute is what the launch config said.
    stage = (getattr(plugin, "deepspeed_config", None) or {}).get("zero_optimization", {}).get("stage")
    if stage is None:
        stage = getattr(plugin, "zero_stage", 0)
    return int(stage or 0)


def is_zero3(accelerator: Any) -> bool:
    return zero_stage(accelerator) == 3


def generation_needs_synced_steps(accelerator: Any, *, gather: bool) -> bool:
    """True when every rank must run the same number of generation forwards.

    Sharded ZeRO-3 generation all-gathers each layer inside every forward, a collective: a rank that stops
    early (all its rows hit the stop token) would leave the others waiting forever. The generator must then
    run all ``max_new_tokens`` steps (or agree on stopping) instead of breaking out on its own.
    """
    return is_zero3(accelerator) and not gather


@contextlib.contextmanager
def gathered(
    params: Iterable[Any], accelerator: Any, *, enabled: bool = True, modifier_rank: int | None = None
) -> Iterator[None]:
    """Materialise full copies of ZeRO-3 sharded ``params`` on every rank; a no-op otherwise.

    Read-only by default (``modifier_rank=None``: nothing is broadcast back into the shards on exit). With
    ``modifier_rank=0`` what rank 0 wrote into the full copies is broadcast and re-partitioned on exit.
    """
    if not (enabled and is_zero3(accelerator)):
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(params), modifier_rank=modifier_rank):
        yield


@contextlib.contextmanager
def gather_for_generation(model: Any, accelerator: Any, enabled: bool) -> Iterator[None]:
    """Gather the whole ZeRO-3 model for generation when ``enabled``; a no-op otherwise.

    ``model`` is the prepared model (the DeepSpeed engine). While gathered, ZeRO-3's per-module
    fetch/release hooks are taken off: with the weights already whole they only cost time on each of the
    hundreds of small decode forwards. They are put back, and the parameter-fetch trace reset, on exit.
    """
    if not (enabled and is_zero3(accelerator)):
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None):
        removed = _remove_zero3_hooks(model)
        try:
            yield
        finally:
            if removed:
                _add_zero3_hooks(model)


@contextlib.contextmanager
def unwrap_for_generation(model: Any, accelerator: Any, *, gather: bool = True) -> Iterator[Any]:
    """The bare model to generate with, gathered under ZeRO-3 when ``gather`` (see gather_for_generation)."""
    with gather_for_generation(model, accelerator, gather):
        yield accelerator.unwrap_model(model)


def fill_deepspeed_config(
    accelerator: Any,
    *,
    micro_batch_size: int,
    gradient_accumulation_steps: int,
    max_grad_norm: float,
) -> None:
    """Fill the DeepSpeed config values accelerate cannot infer here; call before ``accelerator.prepare``.

    accelerate takes ``train_micro_batch_size_per_gpu`` from a prepared dataloader and the trainer prepares
    none, so without this ``prepare`` fails. The accumulation steps must be the trainer's (DeepSpeed scales
    the loss and decides the optimizer-step boundary from them), and clipping happens inside DeepSpeed's
    step, so ``max_grad_norm`` goes into its config (0 = off). A no-op without DeepSpeed.
    """
    plugin = _plugin(accelerator)
    if plugin is None:
        return
    cfg = plugin.deepspeed_config
    world = int(getattr(accelerator, "num_processes", 1))
    cfg["train_micro_batch_size_per_gpu"] = micro_batch_size
    cfg["gradient_accumulation_steps"] = gradient_accumulation_steps
    cfg["train_batch_size"] = micro_batch_size * gradient_accumulation_steps * world
    cfg["gradient_clipping"] = float(max_grad_norm)


def checkpoint_safe_globals() -> list[Any]:
    """What DeepSpeed's checkpoint files name besides tensors and plain containers (the ZeRO stage, the loss
    scaler, the partitions' bookkeeping): allowed when they are read with ``torch.load(weights_only=True)``.
    Each is rebuilt from plain values (an enum member, an object's attributes), which runs no code of the
    file's choosing."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [ZeroStageEnum, LossScaler, DynamicLossScaler, fragment_address]


def prepare_reference_model(model: Any, accelerator: Any) -> Any:
    """Place the frozen reference model: sharded like the policy under ZeRO-3, a plain copy otherwise.

    Under ZeRO-3 the reference is as large as the policy, so it is sharded too (a DeepSpeed inference
    engine: no optimizer, no training blocks of the config); under ZeRO-2, DDP or one process it simply
    moves to the device.
    """
    if not is_zero3(accelerator):
        return model.to(accelerator.device)
    import copy

    import deepspeed

    config = copy.deepcopy(_plugin(accelerator).deepspeed_config)
    # No optimizer is given below: DeepSpeed would otherwise try to build the configured one (or its
    # CPU offload) for parameters that never train.
    config.pop("optimizer", None)
    config.pop("scheduler", None)
    config.get("zero_optimization", {}).pop("offload_optimizer", None)
    engine, *_ = deepspeed.initialize(model=model, config=config)
    engine.eval()
    return engine


# ------------------------------------------------------------------------------------------------------
# ZeRO-3 hook handling (DeepSpeed internals, kept in one place)
def _zero3_offload(model: Any) -> Any:
    opt = getattr(model, "optimizer", None)  # the engine has no optimizer attribute before its first step
    if opt is None:
        return None
    return getattr(opt, "parameter_offload", opt)


def _remove_zero3_hooks(model: Any) -> bool:
    offload = _zero3_offload(model)
    if offload is None or not hasattr(offload, "forward_hooks"):
        return False
    for _, param in offload.module.named_parameters(recurse=True):
        active = getattr(param, "ds_active_sub_modules", None)
        if active is not None:
            active.clear()
    for hook in [*offload.forward_hooks, *offload.backward_hooks]:
        hook.remove()
    offload.forward_hooks, offload.backward_hooks = [], []
    return True


def _add_zero3_hooks(model: Any) -> None:
    offload = _zero3_offload(model)
    if offload is None:
        return
    coordinator = getattr(offload, "param_coordinator", None)
    # The recorded fetch order predates generation's forwards; a stale trace makes prefetching fetch the
    # wrong modules, so it is invalidated and re-recorded on the next training forward.
    if coordinator is not None and not coordinator.is_invalid_trace():
        coordinator._invalidate_trace()
    offload._register_deepspeed_module(offload.module)
