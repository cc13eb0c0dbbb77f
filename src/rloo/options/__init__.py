"""Typed options: a stage's config dataclass declares each field once, with :func:`option` (type, default,
one-line help, aliases, the pipeline parameter that sets it), and everything that reads flags reads them from
there (:mod:`rloo.parsing`), as the pipeline's parameters are made from there (:mod:`rloo.stages.plan`).

Imports nothing but the standard library: every stage's config module builds on it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

__all__ = ["PIPELINE", "Exposed", "aliases_of", "option"]

# The metadata key under which a field's pipeline parameter (:class:`Exposed`) is recorded
PIPELINE = "pipeline"
_UNSET: Any = object()


@dataclass(frozen=True)
class Exposed:
    """A config field as a parameter of the Kubeflow pipeline, declared on the field itself
    (``option(200, "...", pipeline="eval_max_new_tokens")``); :mod:`rloo.stages.plan` derives the pipeline's
    signature, the validate step and the parameter table from these.

    ``default``: the pipeline's default where it differs from the field's (KFP has no None: an optional field
    without one defaults to its type's empty value, '' or 0, which means unset). ``required``: the pipeline
    needs a value. ``help``: the KFP UI's text where the flag's help does not fit a pipeline run."""

    name: str
    default: Any = _UNSET
    required: bool = False
    help: str | None = None

    @property
    def has_default(self) -> bool:
        return self.default is not _UNSET


def option(
    default: Any, help: str, *, aliases: tuple[str, ...] = (), pipeline: str | Exposed | None = None
) -> Any:
    """A config field: its default, the one-line help ``--help`` prints, and other flag names for it
    (``aliases=("beta",)`` makes ``--beta`` set this field). ``pipeline``: the name of the pipeline parameter
    that sets it (or an :class:`Exposed` with a pipeline default, required or help of its own). A list or dict
    default is copied per instance."""
    metadata: dict[str, Any] = {"help": help}
    if pipeline is not None:
        metadata[PIPELINE] = Exposed(pipeline) if isinstance(pipeline, str) else pipeline
    if aliases:
        # each alias also in its dashed spelling, as HfArgumentParser spells the field's own name
        metadata["aliases"] = [f"--{s}" for a in aliases for s in dict.fromkeys((a, a.replace("_", "-")))]
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def aliases_of(cls: type) -> dict[str, str]:
    """``{alias: field name}`` for the aliases the fields of dataclass ``cls`` declare, in field order."""
    return {
        alias.removeprefix("--"): f.name
        for f in dataclasses.fields(cls)
        for alias in f.metadata.get("aliases", ())
        if "-" not in alias.removeprefix("--")  # not the dashed spellings option() adds
    }
