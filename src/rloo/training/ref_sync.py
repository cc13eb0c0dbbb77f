"""Reference-model sync (TR-DPO style, TRL's ``sync_ref_model``): every N updates the reference moves toward
the policy, ``ref = alpha * policy + (1 - alpha) * ref``, parameter by parameter, in place, in the
reference's dtype; and the moved reference's weights, saved with a checkpoint and read back on resume.

LoRA is refused: there the reference is the policy's own base model with its adapters off, so it cannot move
without moving the policy's base weights too (which the adapters were trained against).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from rloo.training import deepspeed_utils

__all__ = [
    "REFERENCE_FILE",
    "load_reference",
    "matched_parameters",
    "mix_into",
    "reference_state_dict",
    "save_reference_state",
    "should_sync",
    "sync_reference",
]

# the reference's weights inside a checkpoint directory
REFERENCE_FILE = "reference/model.safetensors"
# safetensors metadata key: {name: the name it shares its storage with}, for tensors written once (tied)
_TIED_KEY = "rloo_tied"

Pair = tuple[str, torch.nn.Parameter, torch.nn.Parameter]


def should_sync(update: int, every: int) -> bool:
    """Whether to sync once update ``update`` (0-based) has completed: after every ``every``-th update."""
    return every > 0 and (update + 1) % every == 0


def _check_alpha(alpha: float) -> None:
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"the mixup alpha must be within [0, 1], got {alpha}")


def _shape(p: torch.Tensor) -> tuple[int, ...]:
    # a ZeRO-3 partitioned parameter holds its local shard (often empty); ds_shape is its full shape
    full = getattr(p, "ds_shape", None)
    return tuple(p.shape if full is None else full)


def matched_parameters(reference: torch.nn.Module, policy: torch.nn.Module) -> list[Pair]:
    """(name, reference parameter, policy parameter) in the reference's order, paired by name.

    ValueError naming the first parameter that one model has and the other lacks, or whose shapes differ.
    Tied parameters appear once (``named_parameters`` skips repeats), so none is mixed twice.
    """
    pol = dict(policy.named_parameters())
    ref = dict(reference.named_parameters())
    for name in ref:
        if name not in pol:
            raise ValueError(f"the reference has parameter {name!r}, which the policy lacks")
    for name in pol:
        if name not in ref:
            raise ValueError(f"the policy has parameter {name!r}, which the reference lacks")
    for name, r in ref.items():
        if _shape(r) != _shape(pol[name]):
            raise ValueError(
                f"parameter {name!r} has shape {list(_shape(r))} in the reference but "
                f"{list(_shape(pol[name]))} in the policy"
            )
    return [(name, r, pol[name]) for name, r in ref.items()]


def _mix(pairs: list[Pair], alpha: float) -> None:
    with torch.no_grad():
        for _, r, p in pairs:
            # lerp: r + alpha * (p - r) = alpha * p + (1 - alpha) * r, computed in the reference's dtype;
            # one parameter converted at a time (the policy may be fp32, or elsewhere: an offloaded reference)
            r.lerp_(p.detach().to(device=r.device, dtype=r.dtype), alpha)


def mix_into(reference: torch.nn.Module, policy: torch.nn.Module, alpha: float) -> None:
    """``reference <- alpha * policy + (1 - alpha) * reference``, in place, matching parameters by name.

    Plain (unwrapped, not partitioned) modules; :func:`sync_reference` is the trainer's entry point.
    """
    _check_alpha(alpha)
    _mix(matched_parameters(reference, policy), alpha)


def _by_module(pairs: list[Pair]) -> Iterator[list[Pair]]:
    """Consecutive pairs of the same module (one layer's weights at a time)."""
    chunk: list[Pair] = []
    for pair in pairs:
        if chunk and pair[0].rpartition(".")[0] != chunk[-1][0].rpartition(".")[0]:
            yield chunk
            chunk = []
        chunk.append(pair)
    if chunk:
        yield chunk


def sync_reference(reference: Any, policy: Any, alpha: float, *, accelerator: Any, deepspeed: bool) -> None:
    """Move the reference toward the policy (:func:`mix_into`); call on every rank, after an update.

    ``reference`` and ``policy`` as the trainer holds them: wrapped (a DeepSpeed engine) or not.
    """
    _check_alpha(alpha)
    pairs = matched_parameters(accelerator.unwrap_model(reference), accelerator.unwrap_model(policy))
    if not (deepspeed and deepspeed_utils.is_zero3(accelerator)):
        # Every rank holds a whole replica of both models, and the policy replicas are identical after each
        # optimizer step (gradients are averaged before it): each rank updates its own reference the same
        # way, and no collective is needed.
        _mix(pairs, alpha)
        return
    # ZeRO-3: both models are partitioned. As TRL's SyncRefModelCallback, but one module at a time (never
    # two whole models gathered at once): the policy's weights read-only, the reference's written on rank 0
    # and re-partitioned from there on exit (every rank computes the same mix; rank 0's is the one kept).
    for chunk in _by_module(pairs):
        with (
            deepspeed_utils.gathered([p for _, _, p in chunk], accelerator),
            deepspeed_utils.gathered([r for _, r, _ in chunk], accelerator, modifier_rank=0),
        ):
            _mix(chunk, alpha)


# ------------------------------------------------------------------------------------------------------
# the reference's weights in a checkpoint
def reference_state_dict(reference: Any, *, accelerator: Any, deepspeed: bool) -> dict[str, torch.Tensor]:
    """The reference's full state dict, to save; call on every rank (under ZeRO-3 it is assembled layer by
    layer, as the policy's is for the final model, and only the main process gets it: the others get {})."""
    if deepspeed and deepspeed_utils.is_zero3(accelerator):
        return dict(accelerator.get_state_dict(reference) or {})
    return dict(accelerator.unwrap_model(reference).state_dict())


def save_reference_state(state: dict[str, torch.Tensor], file: Path) -> None:
    """Write ``state`` to ``file`` (safetensors); a tensor sharing its storage with an earlier one (tied
    weights) is written once and its name recorded, as safetensors refuses shared tensors."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    tied: dict[str, str] = {}
    seen: dict[tuple[Any, ...], str] = {}
    for name, t in state.items():
        key = (
            t.device,
            t.untyped_storage().data_ptr(),
            t.storage_offset(),
            tuple(t.shape),
            t.stride(),
            t.dtype,
        )
        if t.numel() and key in seen:
            tied[name] = seen[key]
            continue
        seen[key] = name
        tensors[name] = t.detach().to("cpu").contiguous()
    file.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(file), metadata={_TIED_KEY: json.dumps(tied)})


def _read_reference_state(file: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(file), framework="pt") as f:
            state = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (safe_open is no dict)
            tied = json.loads((f.metadata() or {}).get(_TIED_KEY, "{}"))
    except SafetensorError as e:
        raise ValueError(f"{REFERENCE_FILE} cannot be read ({e})") from None
    for name, source in tied.items():
        state[name] = state[source]
    return state


def load_reference(reference: Any, file: Path, *, accelerator: Any, deepspeed: bool) -> None:
    """Restore the reference's weights from ``file`` (written by :func:`save_reference_state`), in place, on
    every rank. RuntimeError when the names or shapes do not match the reference."""
    state = _read_reference_state(file)
    module = accelerator.unwrap_model(reference)
    if not (deepspeed and deepspeed_utils.is_zero3(accelerator)):
        module.load_state_dict(state)  # strict: every name, every shape
        return
    expected = set(module.state_dict())
    if set(state) != expected:
        missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
        raise RuntimeError(
            f"reference weights do not match the model: missing {missing}, unexpected {unexpected}"
        )
    # ZeRO-3: one module at a time, gathered, written on rank 0 and re-partitioned from there
    with torch.no_grad():
        for prefix, sub in module.named_modules():
            lead = f"{prefix}." if prefix else ""
            params = list(sub.named_parameters(recurse=False))
            with deepspeed_utils.gathered([p for _, p in params], accelerator, modifier_rank=0):
                for name, p in params:
                    source = state[lead + name]
                    if tuple(source.shape) != tuple(p.shape):
                        raise RuntimeError(
                            f"reference weight {lead + name!r} has shape {list(source.shape)}, the model "
                            f"{list(p.shape)}"
                        )
                    p.copy_(source)
            for name, b in sub.named_buffers(recurse=False):
                if lead + name in state:  # persistent buffers only are in a state dict
                    b.copy_(state[lead + name])
