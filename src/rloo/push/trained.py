"""The model a push publishes: a finished ``rloo train`` output_dir, local or uploaded to ``s3://``, checked
before anything is written (:func:`check_trained_model`) and fetched to a local directory for staging
(:func:`fetch_trained_model`).

Whether a local path is a model directory at all is :func:`rloo.models.local_model_dir`'s rule, the one
every stage applies (a LoRA output, adapter only, is one); a push also needs what only a finished training
run writes: ``training_complete.json`` and top-level ``*.safetensors`` weights that are finite.
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

from rloo.errors import UserError
from rloo.models import (
    ADAPTER_CONFIG,
    MERGED_SUBDIR,
    check_safetensors_weights,
    holds_model_config,
    local_model_dir,
)
from rloo.storage import Location, download_dir, read_manifest
from rloo.storage.errors import prefixed
from rloo.storage.location import source_kind

FLAG = "model_path"
HINT = "push a finished 'rloo train' output_dir"
# written last by a training run: without it the weights may be a checkpoint's, or half written
TRAINING_COMPLETE = "training_complete.json"


def check_trained_model(model_path: str) -> Path | None:
    """One line when ``model_path`` is no finished training output: a local directory is checked in place
    (weights included) and returned, an ``s3://`` prefix by its manifest (None: it is still to be fetched).
    Which of the two it is: :func:`rloo.storage.location.source_kind`, the rule of every stage (a Hub id is
    no trained model: it fails as a missing directory)."""
    if source_kind(model_path) == "s3":
        loc = Location.parse(model_path)  # a malformed URI says so itself, naming the URI
        try:
            manifest = read_manifest(loc)
        except UserError as e:  # a store out of reach still exits 75: a retried push step may succeed
            raise prefixed(e, f"--{FLAG} {model_path}") from None
        _check_training_files(model_path, {f for f in manifest.by_path if "/" not in f})
        return None
    # resolved: a relative path's name (the model card's fallback model name) is its directory's
    path = local_model_dir(FLAG, model_path, hint=HINT).resolve()
    _check_training_files(model_path, {f.name for f in path.iterdir() if f.is_file()})
    _check_weights(path, model_path)
    return path


def fetch_trained_model(model_path: str, work: Path) -> Path:
    """The checked ``s3://`` model of :func:`check_trained_model` downloaded under ``work`` (every file's
    SHA-256 verified against the manifest), its weights checked as a local directory's are."""
    dest = work / "model"
    download_dir(Location.parse(model_path), dest, progress=False, overwrite=True)
    _check_weights(dest, model_path)
    return dest


def _check_training_files(model_path: str, names: Collection[str]) -> None:
    """The top-level files ``names`` of a model directory are those of a finished training run (a local
    directory has passed :func:`rloo.models.local_model_dir` already; an upload's manifest is held to the
    same rule here)."""
    if not holds_model_config(names):
        raise UserError(
            f"--{FLAG} {model_path}: not a model directory (no config.json or {ADAPTER_CONFIG}); {HINT}."
        )
    if TRAINING_COMPLETE not in names:
        raise UserError(
            f"--{FLAG} {model_path}: {TRAINING_COMPLETE} is missing (training did not finish); {HINT}."
        )
    if not any(name.endswith(".safetensors") for name in names):
        raise UserError(f"--{FLAG} {model_path}: no *.safetensors weights; {HINT}.")


def _check_weights(path: Path, model_path: str) -> None:
    # a NaN/overflowing model must never be published, whatever training_complete.json says
    check_safetensors_weights(path, flag=FLAG, shown=model_path)
    if (path / MERGED_SUBDIR).is_dir():  # a LoRA run's merged model is what gets published
        check_safetensors_weights(path / MERGED_SUBDIR, flag=FLAG, shown=f"{model_path}/{MERGED_SUBDIR}")
