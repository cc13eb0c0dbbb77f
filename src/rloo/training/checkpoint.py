"""Resumable checkpoints, written so that a half-written one is never picked up.

A checkpoint is a directory ``checkpoint-<update>`` holding the policy and tokenizer (``save_pretrained``),
the optimizer and scheduler states, every RNG state, ``trainer_state.json`` (update, episode, data order
position, ...) and, in a run whose reference model moves (--sync_ref_model), the reference's weights
(``reference/model.safetensors``). It is assembled in a hidden temporary directory, sealed with the same
manifest as every upload (:mod:`rloo.storage.manifest`: every file with its size and SHA-256) written last,
then renamed into place: a reader sees a complete checkpoint or none. A checkpoint whose files do not match
its manifest (a truncated copy, a disk that filled up) is skipped with a warning in favour of the next
newest; the resume check reads back the small state files' hashes and the weights' sizes.

Under DeepSpeed (ZeRO) the optimizer state is split between the ranks and exists whole nowhere: every rank
writes its part through the engine's own ``save_checkpoint`` into ``deepspeed/`` (:data:`ENGINE_DIR`) of the
same temporary directory before the main process adds the rest (the policy's gathered full weights as
``model.safetensors``, which transformers loads as ever; no ``optimizer.pt``) and seals it. A resume loads
the weights and the optimizer state from there, on every rank, through the engine's ``load_checkpoint``.
Every rank must then see the main process's output directory: one machine, or a filesystem all the nodes
share.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import random
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from rloo.diskspace import disk_full_as_one_line, honour_umask, tensor_bytes
from rloo.errors import UserError
from rloo.storage.errors import IncompleteArtifactError
from rloo.storage.manifest import MANIFEST_NAME, Manifest, fsync_dir, fsync_file, verify_local, write_manifest

log = logging.getLogger(__name__)

PREFIX = "checkpoint-"
MANIFEST = MANIFEST_NAME
STATE = "trainer_state.json"
_NAME = re.compile(rf"^{PREFIX}(\d+)$")
# On resume, weights are checked by size (truncation is what happens to them); small state files also by hash.
_HASH_LIMIT = 16 * 2**20
# Under DeepSpeed: the engine's checkpoint (``engine.save_checkpoint(<checkpoint>/ENGINE_DIR, ENGINE_TAG)``):
# ENGINE_TAG/ holds the module states and each rank's partition of the optimizer state (and fp32 weights)
ENGINE_DIR = "deepspeed"
ENGINE_TAG = "engine"
# a ZeRO partition file, one per data-parallel rank (bf16_... under ZeRO-1 with bf16)
_ZERO_PARTITION = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_\d+_optim_states\.pt$")


def rng_states() -> dict[str, Any]:
    """Every RNG state as tensors and plain containers only, so that ``torch.load(weights_only=True)`` reads
    it back: python's ``random`` state is already a tuple of ints; numpy's key array becomes a tensor."""
    states: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np

        name, keys, pos, has_gauss, cached = np.random.get_state()
        states["numpy"] = {
            "name": str(name),
            "keys": torch.from_numpy(np.asarray(keys).astype(np.int64)),  # uint32 values, exactly
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        }
    except ImportError:  # pragma: no cover
        pass
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: dict[str, Any]) -> None:
    random.setstate(states["python"])
    torch.set_rng_state(states["torch"])
    if "numpy" in states:
        import numpy as np

        st = states["numpy"]
        if isinstance(st, dict):
            keys = st["keys"].numpy().astype(np.uint32)
            st = (st["name"], keys, st["pos"], st["has_gauss"], st["cached_gaussian"])
        np.random.set_state(st)  # a tuple: written before the state was stored as tensors
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def temporary_dir(output_dir: Path, update: int) -> Path:
    """Where ``checkpoint-<update>`` is assembled before it is renamed into place (hidden, never resumed)."""
    return output_dir / f".{PREFIX}{update}.tmp"


def begin_checkpoint(output_dir: Path, update: int) -> Path:
    """A fresh, empty :func:`temporary_dir` (what a save that died left there is removed)."""
    tmp = temporary_dir(output_dir, update)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def save_checkpoint(
    output_dir: Path,
    update: int,
    *,
    model: Any,
    tokenizer: Any,
    optimizer: Any,
    scheduler: Any,
    state: dict[str, Any],
    config: dict[str, Any],
    total_limit: int | None = None,
    extra_files: list[Path] | None = None,
    extra_objects: dict[str, Any] | None = None,
    reference_state: dict[str, torch.Tensor] | None = None,
    model_state: dict[str, torch.Tensor] | None = None,
    begun: bool = False,
) -> Path:
    """Write ``output_dir/checkpoint-<update>`` atomically and return its path.

    ``extra_objects``: more files, name -> a value ``torch.save`` writes.

    ``reference_state``: the reference model's weights (a run with --sync_ref_model, whose reference moves),
    written to ``reference/model.safetensors`` (:mod:`rloo.training.ref_sync`); None writes no such file.

    Under DeepSpeed: ``model_state``, the policy's full weights where the model holds only its shards
    (ZeRO-3), saved instead of ``model``'s own; ``optimizer`` None, its state being the engine's, which
    every rank wrote into the :func:`begin_checkpoint` directory beforehand (``begun``: that directory is
    kept and sealed with the rest)."""
    final = output_dir / f"{PREFIX}{update}"
    tmp = temporary_dir(output_dir, update) if begun else begin_checkpoint(output_dir, update)
    optimizer_state = optimizer.state_dict() if optimizer is not None else None
    # what this checkpoint takes on disk, for a full disk's message: weights, optimizer tensors, ~1 MiB of rest
    needed = (
        tensor_bytes((model.state_dict() if model_state is None else model_state).values())
        + tensor_bytes(t for s in (optimizer_state or {}).get("state", {}).values() for t in s.values())
        + (tensor_bytes(reference_state.values()) if reference_state is not None else 0)
        + 2**20
    )
    try:
        with disk_full_as_one_line(final, needed, f"checkpoint {final.name}"):
            if model_state is None:
                model.save_pretrained(tmp, safe_serialization=True)
            else:
                model.save_pretrained(tmp, state_dict=model_state, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
            if optimizer_state is not None:
                torch.save(optimizer_state, tmp / "optimizer.pt")
            torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
            torch.save(rng_states(), tmp / "rng_state.pt")
            (tmp / "rloo_config.json").write_text(json.dumps(config, indent=2, default=str))
            (tmp / STATE).write_text(json.dumps(state, indent=2))
            for extra in extra_files or []:
                if extra.is_file():
                    shutil.copy2(extra, tmp / extra.name)
            for name, value in (extra_objects or {}).items():
                torch.save(value, tmp / name)
            if reference_state is not None:
                from rloo.training.ref_sync import REFERENCE_FILE, save_reference_state

                save_reference_state(reference_state, tmp / REFERENCE_FILE)
            honour_umask(tmp)
            for path in tmp.rglob("*"):
                if path.is_file():
                    fsync_file(path)
            write_manifest(tmp)  # last: without it the checkpoint does not count
    except BaseException:
        # a half-written checkpoint is never read (no manifest, hidden name), but it holds the space that
        # the next attempt needs
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if final.exists():  # a stale copy of the same update (e.g. re-saved after a preemption)
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync_dir(output_dir)
    if total_limit:
        for _, old in list_checkpoints(output_dir)[total_limit:]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(output_dir: Path) -> list[tuple[int, Path]]:
    """(update, path) of every checkpoint directory, newest first (complete or not)."""
    if not output_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in output_dir.iterdir() if p.is_dir() and (m := _NAME.match(p.name))]
    return sorted(found, reverse=True)


def checkpoint_problem(path: Path) -> str | None:
    """Why ``path`` is not a usable checkpoint, or None if it matches its manifest."""
    manifest = path / MANIFEST
    if not manifest.is_file():
        if (path / "checkpoint_manifest.json").is_file():  # the format before checkpoints used storage's
            return "written by an older rloo (checkpoint_manifest.json), which this version does not resume"
        return "no manifest (it was never completed)"
    try:
        verify_local(
            path, Manifest.from_json(manifest.read_text(), str(path)), path.name, hash_limit=_HASH_LIMIT
        )
    except IncompleteArtifactError as e:
        # what is wrong, without the upload advice: the next newest checkpoint is tried instead
        return str(e).removeprefix(f"{path.name}: ").split(": the data was")[0]
    return None


def newest_intact_checkpoint(output_dir: Path) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest checkpoint that matches its manifest (None if none does), and the newer ones that do not,
    newest first, each with what is wrong with it."""
    damaged: list[tuple[Path, str]] = []
    for _, path in list_checkpoints(output_dir):
        problem = checkpoint_problem(path)
        if problem is None:
            return path, damaged
        damaged.append((path, problem))
    return None, damaged


def latest_checkpoint(output_dir: Path) -> Path | None:
    """The newest complete checkpoint; broken ones are skipped with a warning."""
    path, damaged = newest_intact_checkpoint(output_dir)
    for broken, problem in damaged:
        log.warning("skipping %s: %s", broken, problem)
    return path


def load_checkpoint(
    path: Path, *, model: Any, optimizer: Any, scheduler: Any, engine: Any = None
) -> dict[str, Any]:
    """Restore model, optimizer, scheduler and RNG states in place; return the trainer state.

    ``engine``: under DeepSpeed, the policy's engine, which loads the weights and the optimizer state from
    :data:`ENGINE_DIR` on every rank (``model`` and ``optimizer`` are then not used); call it on every rank."""
    if engine is not None:
        load_engine_state(path, engine)
    else:
        _load_weights(path, model)
        optimizer.load_state_dict(_load_state(path / "optimizer.pt"))
    scheduler.load_state_dict(_load_state(path / "scheduler.pt"))
    set_rng_states(_load_state(path / "rng_state.pt"))
    return json.loads((path / STATE).read_text())


def _load_weights(path: Path, model: Any) -> None:
    # through from_pretrained: transformers renames some keys between memory and disk (per architecture
    # and version), and only its own loader knows the mapping
    from rloo.training.lora import is_peft_model, load_adapter_weights

    if is_peft_model(model):  # a LoRA run's checkpoint holds the adapter only; the base never changed
        load_adapter_weights(model, path)
    else:
        saved = type(model).from_pretrained(path, dtype=next(model.parameters()).dtype)
        model.load_state_dict(saved.state_dict())
        del saved


# ------------------------------------------------------------------------------------------------------
# DeepSpeed: the engine's own checkpoint inside ours
def save_engine_state(tmp: Path, engine: Any) -> None:
    """Every rank: the DeepSpeed ``engine``'s checkpoint (module states, this rank's partition of the optimizer
    state) into ``tmp/ENGINE_DIR``, as accelerate's ``save_state`` does; it waits for every rank."""
    engine.save_checkpoint(str(tmp / ENGINE_DIR), tag=ENGINE_TAG)


def engine_world_size(path: Path) -> int | None:
    """The number of data-parallel ranks the ZeRO optimizer state in ``path`` is split into (one partition
    file each); None when it holds no ZeRO partitions (no DeepSpeed, or DeepSpeed without ZeRO)."""
    folder = path / ENGINE_DIR / ENGINE_TAG
    ranks = {m.group(2) for f in folder.glob("*.pt") if (m := _ZERO_PARTITION.match(f.name))}
    return len(ranks) or None


def engine_zero_stage(path: Path) -> int | None:
    """3 when the DeepSpeed checkpoint in ``path`` holds per-rank module shards (ZeRO-3), 2 when it holds the
    module once beside split optimizer state (ZeRO-1/2), None when it holds no engine checkpoint."""
    folder = path / ENGINE_DIR / ENGINE_TAG
    if any(folder.glob("zero_pp_rank_*_model_states.pt")):
        return 3
    return 2 if any(folder.glob("mp_rank_*_model_states.pt")) else None


def load_engine_state(path: Path, engine: Any) -> None:
    """Every rank: the weights and optimizer state of the DeepSpeed ``engine`` from ``path/ENGINE_DIR``.

    DeepSpeed unpickles its files unrestricted, so each is first read back here as ``torch.load`` with
    ``weights_only=True`` does (DeepSpeed's own config classes allowed, the tensors memory-mapped, not read):
    a file naming anything else is refused in one line, as our own state files are. The learning-rate
    schedule is ours (``scheduler.pt``), not the engine's."""
    from rloo.training import deepspeed_utils

    folder = path / ENGINE_DIR
    allowed = deepspeed_utils.checkpoint_safe_globals()
    for file in sorted((folder / ENGINE_TAG).glob("*.pt")):
        _load_state(file, checkpoint=path, extra_globals=allowed, mmap=True)
    loaded, _ = engine.load_checkpoint(
        str(folder), tag=ENGINE_TAG, load_optimizer_states=True, load_lr_scheduler_states=False
    )
    if loaded is None:  # DeepSpeed only logs a warning when it finds no checkpoint files
        raise ValueError(f"{ENGINE_DIR}/{ENGINE_TAG} holds no DeepSpeed checkpoint")


def _numpy_array_globals() -> list[Any]:
    """What a numpy array in a pickle names: checkpoints written before the RNG states were stored as
    tensors hold numpy's state as an array. Rebuilding an array runs no user code (its elements, if any,
    still pass through the weights-only unpickler)."""
    try:
        import numpy as np
    except ImportError:  # pragma: no cover
        return []
    multiarray = getattr(np, "_core", None) or np.core  # numpy 2 moved it; 1.x has np.core
    return [multiarray.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def _load_state(
    file: Path, *, checkpoint: Path | None = None, extra_globals: list[Any] | None = None, mmap: bool = False
) -> Any:
    """``torch.load`` of a state file with ``weights_only=True``: tensors and plain containers only (and
    ``extra_globals``). A file naming anything else (a pickle that would construct arbitrary objects, i.e. run
    code) is refused in one line, never unpickled. ``checkpoint``: the checkpoint directory the message names
    (``file``'s directory by default)."""
    checkpoint = file.parent if checkpoint is None else checkpoint
    try:
        with torch.serialization.safe_globals([*_numpy_array_globals(), *(extra_globals or [])]):
            # mmap=None (not False): torch's configured default, as a load without the argument
            return torch.load(file, map_location="cpu", weights_only=True, mmap=True if mmap else None)
    except pickle.UnpicklingError as e:
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(e))
        what = f" (it names {found.group(1)})" if found else ""
        raise UserError(
            f"cannot resume from {checkpoint}: {file.relative_to(checkpoint)} holds more than tensors and plain "
            f"containers{what}, and unpickling it could run code, so it was not loaded; resume only from "
            "checkpoints this trainer wrote, or pass --resume_from_checkpoint none to start over."
        ) from None
