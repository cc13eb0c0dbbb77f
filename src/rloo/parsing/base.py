"""argparse with one-line errors: what every ``rloo`` command's parser has in common."""

from __future__ import annotations

import argparse
import contextlib
import difflib
import importlib.util
import os
import re
import typing
from collections.abc import Iterable, Iterator
from typing import Any

from rloo.errors import UserError

_TRUE = {"true", "1", "yes", "y", "on"}
_FALSE = {"false", "0", "no", "n", "off"}

# A number, also in exponent notation or infinite: argparse's own pattern ('-1', '-.5') misses '-1e-3' and
# takes it for a flag ("expected one argument").
NEGATIVE_NUMBER = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$|^-inf(inity)?$", re.IGNORECASE)
# argparse names an option by all its strings ('--rloo_k/--rloo-k/--num_generations'): the first is enough
_OPTION_LIST = re.compile(r"(--?[\w-]+)(?:/--?[\w-]+)+")


def parse_bool(text: str) -> bool:
    low = str(text).strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ValueError(text)


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """`` (did you mean X?)`` for the closest of ``choices`` to a mistyped ``name``, else ``''``."""
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.7)
    return f" (did you mean {close[0]}?)" if close else ""


class OneLineErrors(argparse.ArgumentParser):
    """Errors as one-line UserErrors instead of usage dumps; negative numbers in any notation are values."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = NEGATIVE_NUMBER  # argparse's hook for what a negative number is

    def error(self, message: str) -> typing.NoReturn:
        # No program name here: the command prints the message after its own "rloo <command>: error: ".
        if message.startswith("unrecognized arguments:"):
            words = message.split(":", 1)[1].split()
            if words and not words[0].startswith("-"):  # a value before any flag: a positional argument
                raise UserError(
                    f"unexpected argument {words[0]!r}: every value follows its flag (--name VALUE); "
                    f"see '{self.prog} --help' for the accepted flags."
                )
            # the flags only: their values would read as more unknown flags
            unknown = [w for w in words if w.startswith("-") and not NEGATIVE_NUMBER.match(w)]
            flags = ", ".join(w + did_you_mean(w.split("=")[0], self._canonical_flags()) for w in unknown)
            raise UserError(f"unknown flag(s) {flags}: see '{self.prog} --help' for the accepted flags.")
        raise UserError(_OPTION_LIST.sub(r"\1", f"{message.removeprefix('argument ')}."))

    def _canonical_flags(self) -> list[str]:
        """The flags a did-you-mean may suggest: each option's first name, then its aliases."""
        return [s for action in self._actions for s in action.option_strings]


class OneLineParser(OneLineErrors):
    """For commands with their own hand-written flags."""


_ADVICE = "TRANSFORMERS_NO_ADVISORY_WARNINGS"


@contextlib.contextmanager
def quiet_without_torch() -> Iterator[None]:
    """Around the first import of transformers: imported without torch (the client install, which only parses
    configs), it logs "PyTorch was not found. Models won't be available ..." at import, nothing that user needs
    or can act on. Its own switch for advisory lines quiets that, for the import only."""
    quiet = importlib.util.find_spec("torch") is None and _ADVICE not in os.environ
    if quiet:
        os.environ[_ADVICE] = "1"
    try:
        yield
    finally:
        if quiet:
            os.environ.pop(_ADVICE, None)
