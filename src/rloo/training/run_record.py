"""What an output_dir's previous run was trained with, against this command's settings.

A run records its settings in ``rloo_config.json`` (in each checkpoint, and beside the finished model). A
command given the same output_dir continues that run, so the settings that decide what is trained must be the
same: a changed learning rate or rloo_k cannot apply to updates already trained, and taking the checkpoint's in
silence would train something the command did not ask for. Which settings may change is declared next to the
config (:data:`rloo.config.RESUMABLE_SETTINGS`, :data:`rloo.config.RUN_LENGTH_SETTINGS`); every other field must
match. The run's length is compared as a number of updates (the trainer's ``num_updates``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rloo.config import RESUMABLE_SETTINGS, RUN_LENGTH_SETTINGS, RLOOConfig

CONFIG_FILE = "rloo_config.json"
# what to do in an output_dir holding a run that cannot continue
START_AGAIN = "pass --overwrite_output_dir to start again, or another --output_dir"

Change = tuple[str, Any, Any]


def read_json(data: bytes | str | None) -> dict[str, Any] | None:
    """A JSON object, or None for no data or data that is not one (a torn or foreign file)."""
    if data is None:
        return None
    try:
        value = json.loads(data)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def recorded_settings(directory: Path) -> dict[str, Any] | None:
    """The settings ``directory`` (a checkpoint, or the finished model's output_dir) was trained with."""
    path = directory / CONFIG_FILE
    return read_json(path.read_bytes()) if path.is_file() else None


def _as_recorded(values: dict[str, Any]) -> dict[str, Any]:
    normalised = read_json(json.dumps(values, default=str))
    assert normalised is not None
    return normalised


def changed_settings(previous: dict[str, Any], cfg: RLOOConfig, *, lengths: bool = False) -> list[Change]:
    """(name, previous value, this command's value) of each setting that decides what is trained and differs
    (``lengths``: of the run-length settings instead). A setting the record lacks (written before the field
    existed) is not compared. The model is compared by its durable name and by its local path alike:
    checkpoints record the one, the finished model the other."""
    names = RUN_LENGTH_SETTINGS if lengths else _fixed_settings()
    recorded, local = _as_recorded(cfg.recorded()), _as_recorded(cfg.to_dict())
    return [
        (name, previous[name], recorded[name])
        for name in names
        if name in previous and previous[name] not in (recorded[name], local[name])
    ]


def _fixed_settings() -> list[str]:
    free = set(RESUMABLE_SETTINGS) | set(RUN_LENGTH_SETTINGS)
    return [name for name in RLOOConfig.field_names() if name not in free]


def describe(changes: list[Change]) -> str:
    """``--learning_rate 3e-06 -> 1e-05, --rloo_k 2 -> 4``."""
    return ", ".join(f"--{name} {_show(old)} -> {_show(new)}" for name, old, new in changes)


def _show(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return " ".join(map(_show, value)) or "[]"
    return "none" if value is None else str(value)
