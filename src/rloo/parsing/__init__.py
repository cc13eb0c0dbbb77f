"""The command-line parsers of ``rloo``.

- :func:`parse_config` / :func:`parse_values`: the command line and ``--config FILE.yaml`` into a stage's
  config dataclass (fields declared with :func:`rloo.options.option`), on ``transformers.HfArgumentParser``
  (:mod:`rloo.parsing.hf`), every problem a one-line :class:`~rloo.errors.UserError`;
- :class:`OneLineParser`: plain argparse with the same one-line errors, for commands with hand-written flags.

Light on purpose: transformers is imported only when a config is parsed.
"""

from __future__ import annotations

from typing import Any, TypeVar

from rloo.parsing.base import OneLineParser, did_you_mean, parse_bool

T = TypeVar("T")

__all__ = ["OneLineParser", "did_you_mean", "parse_bool", "parse_config", "parse_values"]


def parse_values(cls: type, argv: list[str], *, prog: str, description: str = "") -> dict[str, Any]:
    """The values ``argv`` gives (its ``--config`` file under its flags), by field name and converted to
    the fields' types; fields nobody gave are absent. Not validated: see :func:`parse_config`."""
    from rloo.parsing.hf import ConfigParser

    return ConfigParser(cls, prog=prog, description=description).parse_values(argv)


def parse_config(cls: type[T], argv: list[str], *, prog: str, description: str = "") -> T:
    """``argv`` parsed into a validated ``cls`` (validation runs in its ``__post_init__``)."""
    return cls(**parse_values(cls, argv, prog=prog, description=description))
