"""Typed options: a stage's config dataclass declares each field once, with :func:`option` (type, default,
one-line help, aliases), and everything that reads flags reads them from there.

- :func:`parse_config` / :func:`parse_values`: the command line and ``--config FILE.yaml`` into that
  dataclass, on ``transformers.HfArgumentParser`` (:mod:`rloo.options.hf`), every problem a one-line
  :class:`~rloo.errors.UserError`;
- :class:`OneLineParser`: plain argparse with the same one-line errors, for commands with hand-written flags.

Light on purpose: transformers is imported only when a config is parsed.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

from rloo.options.base import OneLineParser, did_you_mean, parse_bool

T = TypeVar("T")

__all__ = [
    "OneLineParser",
    "aliases_of",
    "did_you_mean",
    "option",
    "parse_bool",
    "parse_config",
    "parse_values",
]


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


def parse_values(cls: type, argv: list[str], *, prog: str, description: str = "") -> dict[str, Any]:
    """The values ``argv`` gives (its ``--config`` file under its flags), by field name and converted to
    the fields' types; fields nobody gave are absent. Not validated: see :func:`parse_config`."""
    from rloo.options.hf import ConfigParser

    return ConfigParser(cls, prog=prog, description=description).parse_values(argv)


def parse_config(cls: type[T], argv: list[str], *, prog: str, description: str = "") -> T:
    """``argv`` parsed into a validated ``cls`` (validation runs in its ``__post_init__``)."""
    return cls(**parse_values(cls, argv, prog=prog, description=description))
