"""Typed options: a stage's config dataclass declares each field once, with :func:`option` (type, default,
one-line help, aliases), and everything that reads flags reads them from there (:mod:`rloo.parsing`).

Imports nothing but the standard library: every stage's config module builds on it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["aliases_of", "option"]


def option(default: Any, help: str, *, aliases: tuple[str, ...] = ()) -> Any:
    """A config field: its default, the one-line help ``--help`` prints, and other flag names for it
    (``aliases=("beta",)`` makes ``--beta`` set this field). A list default is copied per instance."""
    # HfArgumentParser hands the metadata to add_argument: only argparse keywords go in it
    metadata: dict[str, Any] = {"help": help}
    if aliases:
        # each alias also in its dashed spelling, as HfArgumentParser spells the field's own name
        metadata["aliases"] = [f"--{s}" for a in aliases for s in dict.fromkeys((a, a.replace("_", "-")))]
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def aliases_of(cls: type) -> dict[str, str]:
    """``{alias: field name}`` for the aliases the fields of dataclass ``cls`` declare, in field order."""
    return {
        alias.removeprefix("--"): f.name
        for f in dataclasses.fields(cls)
        for alias in f.metadata.get("aliases", ())
        if "-" not in alias.removeprefix("--")  # not the dashed spellings option() adds
    }
