"""TRL-style flags for a config dataclass: ``--flag value``, booleans as ``--flag`` or ``--flag true``.

Values come from three layers, later ones winning: the dataclass defaults, ``--config file.yaml``, and
the command line. Aliases (the current trainer's names) map onto the canonical field. Every problem is
raised as a one-line :class:`~rloo.errors.UserError`.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import re
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

from rloo.errors import UserError

T = TypeVar("T")

_TRUE = {"true", "1", "yes", "y", "on"}
_FALSE = {"false", "0", "no", "n", "off"}
_NONE = {"none", "null"}


def parse_bool(text: str) -> bool:
    low = str(text).strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ValueError(text)


# A number, also in exponent notation or infinite: argparse's own pattern ('-1', '-.5') misses '-1e-3' and
# takes it for a flag ("expected one argument").
_NEGATIVE_NUMBER = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$|^-inf(inity)?$", re.IGNORECASE)


def did_you_mean(name: str, choices: typing.Iterable[str]) -> str:
    """`` (did you mean X?)`` for the closest of ``choices`` to a mistyped ``name``, else ``''``."""
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.7)
    return f" (did you mean {close[0]}?)" if close else ""


class _Parser(argparse.ArgumentParser):
    """argparse that reports errors as one-line UserErrors instead of usage dumps, and reads negative
    numbers in any notation as values."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = _NEGATIVE_NUMBER  # argparse's hook for what a negative number is

    def error(self, message: str) -> typing.NoReturn:
        # No program name here: the command prints the message after its own "rloo <command>: error: ".
        if message.startswith("unrecognized arguments:"):
            words = message.split(":", 1)[1].split()
            if words and not words[0].startswith("-"):  # a value before any flag: a positional argument
                raise UserError(
                    f"unexpected argument {words[0]!r}: every value follows its flag (--name VALUE); "
                    f"see '{self.prog} --help' for the accepted flags."
                )
            flags = " ".join(
                w + did_you_mean(w.split("=")[0], self._option_string_actions) if w.startswith("--") else w
                for w in words
            )
            raise UserError(f"unknown flag(s) {flags}: see '{self.prog} --help' for the accepted flags.")
        raise UserError(f"{message.removeprefix('argument ')}.")


OneLineParser = _Parser  # for commands with their own hand-written flags


@dataclasses.dataclass(frozen=True)
class _Kind:
    base: type  # bool, int, float or str
    optional: bool
    is_list: bool


def _kind(tp: Any) -> _Kind:
    optional = False
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        optional = len(args) < len(typing.get_args(tp))
        (tp,) = args
        origin = typing.get_origin(tp)
    if origin is list:
        (elem,) = typing.get_args(tp)
        return _Kind(elem, optional, True)
    return _Kind(tp, optional, False)


def _converter(name: str, kind: _Kind) -> typing.Callable[[str], Any]:
    def convert(text: str) -> Any:
        if kind.optional and str(text).strip().lower() in _NONE:
            return None
        try:
            if kind.base is bool:
                return parse_bool(text)
            return kind.base(text)
        except ValueError:
            want = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}[kind.base]
            raise UserError(f"--{name} expects {want} (got {text!r}).") from None

    convert.__name__ = kind.base.__name__  # argparse quotes this name in its own messages
    return convert


def build_parser(cls: type, prog: str, description: str, aliases: dict[str, str]) -> argparse.ArgumentParser:
    parser = _Parser(
        prog=prog,
        description=description,
        allow_abbrev=False,  # '--lr' silently meaning '--lr_scheduler_type' would be a trap
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--config",
        metavar="FILE.yaml",
        default=argparse.SUPPRESS,
        help="YAML mapping of flag names to values; flags on the command line override it.",
    )
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        kind = _kind(hints[f.name])
        names = [f"--{f.name}"] + [f"--{a}" for a, canon in aliases.items() if canon == f.name]
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        help_text = f.metadata.get("help", "")
        if default not in (None, []) and "default" not in help_text:  # no "(default: None)", no repeats
            help_text += f" (default: {default})"
        kw: dict[str, Any] = {"dest": f.name, "default": argparse.SUPPRESS, "help": help_text}
        conv = _converter(f.name, kind)
        if kind.is_list:
            kw.update(nargs="+", type=conv, metavar=kind.base.__name__.upper())
        elif kind.base is bool:
            kw.update(nargs="?", const=True, type=conv, metavar="BOOL")
        else:
            kw.update(type=conv, metavar=kind.base.__name__.upper())
        parser.add_argument(*names, **kw)
    return parser


def _coerce_yaml(cls: type, key: str, value: Any, hints: dict[str, Any]) -> Any:
    kind = _kind(hints[key])
    if value is None:
        if kind.optional:
            return None
        raise UserError(f"config key {key!r} cannot be null: give a value or remove the key.")
    conv = _converter(key, kind)
    if kind.is_list:
        items = value if isinstance(value, list) else [value]
        return [
            conv(str(v)) if not isinstance(v, (int, float)) or kind.base is str else kind.base(v)
            for v in items
        ]
    if kind.base is bool:
        return value if isinstance(value, bool) else conv(str(value))
    if kind.base in (int, float) and isinstance(value, (int, float)) and not isinstance(value, bool):
        if kind.base is int and float(value) != int(value):
            raise UserError(f"config key {key!r} expects an integer (got {value!r}).")
        return kind.base(value)
    return conv(str(value))


def load_yaml_config(cls: type, path: str, aliases: dict[str, str]) -> dict[str, Any]:
    from rloo.storage.location import require_local_path

    require_local_path("--config", path, "give a local YAML file.")
    p = Path(path)
    if not p.is_file():
        raise UserError(f"--config {path}: no such file; pass the path of a YAML file.")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark else ""
        raise UserError(f"--config {path}: not valid YAML{where}; fix the syntax.") from None
    if not isinstance(data, dict):
        raise UserError(f"--config {path}: expected a mapping of flag names to values at the top level.")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = [str(k) for k in data if aliases.get(str(k), str(k)) not in names]
    if unknown:
        keys = ", ".join(f"{k!r}{did_you_mean(k, [*names, *aliases])}" for k in unknown)
        raise UserError(
            f"--config {path}: unknown key{'s' if len(unknown) > 1 else ''} {keys}; keys are the flag names "
            "without '--'."
        )
    out: dict[str, Any] = {}
    for raw_key, value in data.items():
        key = aliases.get(str(raw_key), str(raw_key))
        if key in out:
            raise UserError(f"--config {path}: {key!r} is given twice (once under an alias); keep one.")
        out[key] = _coerce_yaml(cls, key, value, hints)
    return out


def parse_config(cls: type[T], argv: list[str], prog: str, description: str, aliases: dict[str, str]) -> T:
    """Parse ``argv`` into a validated ``cls`` instance (validation runs in its ``__post_init__``)."""
    parser = build_parser(cls, prog, description, aliases)
    ns = vars(parser.parse_args(argv))
    values: dict[str, Any] = {}
    if "config" in ns:
        values.update(load_yaml_config(cls, ns.pop("config"), aliases))
    values.update(ns)
    return cls(**values)
