"""A config dataclass's flags, built by ``transformers.HfArgumentParser`` (the parser TRL's CLI is built on).

HfArgumentParser turns each field into a flag (``--name`` and ``--name-with-dashes``, the field's aliases,
``--no_name`` for a boolean that defaults to true, ``--flag`` alone for ``true``, ``nargs='+'`` for lists).
This module adds what the ``rloo`` commands promise on top:

- values come in three layers, later ones winning: the dataclass defaults, ``--config file.yaml`` (keys are
  flag names, aliases included), the command line; :meth:`ConfigParser.parse_values` returns only what the
  two last layers gave, so a config can be written back out without the defaults;
- one option given under two of its names (``--rloo_k 4 --num_generations 2``, on the command line, in the
  file, or one in each) with different values is an error naming both, never a silent last-one-wins; the
  same value twice is fine, and so is the command line overriding the file under the *same* name;
- every problem is a one-line :class:`~rloo.errors.UserError` naming the flag (``--rloo_k expects an
  integer (got 'two')``), an unknown flag gets a did-you-mean, and ``-1e-3`` is a value, not a flag;
- ``--help`` states each default once, and ``none`` clears an optional field.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import textwrap
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from rloo.errors import UserError
from rloo.options import aliases_of, rule_of
from rloo.parsing.base import OneLineErrors, did_you_mean, parse_bool, quiet_without_torch
from rloo.storage.location import require_local_path

with quiet_without_torch():
    from transformers import HfArgumentParser

_NONE = {"none", "null"}
# the parser that is parsing right now records each option it meets here: (field, flag as typed, value after
# it, whether the flag takes no value); see _recording_action
_Given = list[tuple[str, str, Any, bool]]
_WANT = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
# the metadata of rloo.options.option() that HfArgumentParser may pass on to argparse's add_argument
_ARGPARSE_METADATA = {"help", "aliases"}


@dataclasses.dataclass(frozen=True)
class _Kind:
    base: type  # bool, int, float or str
    optional: bool
    is_list: bool


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Wraps help at spaces only: a value such as ``seq-mean-token-sum`` stays whole, ready to copy."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False, break_long_words=False)


def _states_default(help_text: str, default: Any) -> bool:
    """Whether the field's help already says its default value (then ``--help`` does not repeat it)."""
    spellings = (
        f"default: {default}",
        f"default {default}",
        f"{default} (the default)",
        f"defaults to {default}",
    )
    return any(s in help_text for s in spellings)


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


def _converter(name: str, kind: _Kind) -> Callable[[str], Any]:
    """``text`` -> a value of the field's type, or a UserError naming ``--name`` (argparse would print a
    usage dump and 'invalid int value')."""

    def convert(text: str) -> Any:
        if kind.optional and str(text).strip().lower() in _NONE:
            return None
        try:
            if kind.base is bool:
                return parse_bool(text)
            return kind.base(text)
        except ValueError:
            raise UserError(f"--{name} expects {_WANT[kind.base]} (got {text!r}).") from None

    convert.__name__ = kind.base.__name__  # argparse quotes this name in its own messages
    return convert


_RECORDING: dict[type, type] = {}


def _recording_action(cls: type[argparse.Action]) -> type[argparse.Action]:
    """``cls`` that also records, on the parser, which spelling set which field to what: argparse itself
    keeps only the last value of a field, whichever of its names gave it."""
    if cls not in _RECORDING:

        def __call__(
            self: argparse.Action,
            parser: argparse.ArgumentParser,
            namespace: argparse.Namespace,
            values: Any,
            option_string: str | None = None,
        ) -> None:
            cls.__call__(self, parser, namespace, values, option_string)
            given: _Given | None = getattr(parser, "_given", None)
            if given is not None and option_string is not None:
                given.append((self.dest, option_string, getattr(namespace, self.dest), self.nargs == 0))

        _RECORDING[cls] = type(f"Recording{cls.__name__}", (cls,), {"__call__": __call__})
    return _RECORDING[cls]


def _spelling(flag: str) -> str:
    """The name a flag spells (``--rloo-k`` and ``--rloo_k`` are one spelling; ``--num_generations`` another)."""
    return flag.lstrip("-").replace("-", "_")


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if value is None:
        return "none"
    if isinstance(value, list):
        return " ".join(_shown(v) for v in value)
    return str(value)


class ConfigParser(OneLineErrors, HfArgumentParser):
    """The flags of one config dataclass ``cls``, plus ``--config FILE.yaml``."""

    def __init__(self, cls: type, *, prog: str, description: str = "") -> None:
        self.cls = cls
        self.hints = typing.get_type_hints(cls)
        self.aliases = aliases_of(cls)
        super().__init__(
            cls,
            prog=prog,
            # the flags are listed below, each with its help: a usage line naming all of them is a wall
            usage=f"{prog} [--config FILE.yaml] [--FLAG VALUE ...]",
            description=description,
            allow_abbrev=False,  # '--lr' silently meaning '--lr_scheduler_type' would be a trap
            formatter_class=_HelpFormatter,
        )
        self.add_argument(
            "--config",
            metavar="FILE.yaml",
            default=argparse.SUPPRESS,
            help="YAML mapping of flag names to values; flags on the command line override it.",
        )
        for f in dataclasses.fields(cls):
            self._adapt(f)
        self._given: _Given | None = None
        for action in self._actions:
            if action.dest in self.hints:
                action.__class__ = _recording_action(type(action))

    @staticmethod
    def _parse_dataclass_field(parser: argparse.ArgumentParser, field: dataclasses.Field[Any]) -> None:
        # HfArgumentParser hands a field's metadata to add_argument: the pipeline parameter and the rule it
        # declares (rloo.options) are no argparse keywords; the rule is applied by the config itself, so that
        # a value from any source (--config, the pipeline) gets the same one-line error
        if field.metadata.keys() - _ARGPARSE_METADATA:
            field = copy.copy(field)
            field.metadata = types.MappingProxyType(
                {k: v for k, v in field.metadata.items() if k in _ARGPARSE_METADATA}
            )
        HfArgumentParser._parse_dataclass_field(parser, field)

    def _adapt(self, f: dataclasses.Field[Any]) -> None:
        """Our conversions, defaults and help on the actions HfArgumentParser made for field ``f``."""
        kind = _kind(self.hints[f.name])
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        help_text = f.metadata.get("help", "")
        notes = []
        rule = rule_of(f)
        if rule is not None:
            notes.append(f"must be {rule.text}")
        if default not in (None, []) and not _states_default(help_text, default):  # no "(default: None)"
            notes.append(f"default: {default}")
        if notes:
            help_text += f" ({'; '.join(notes)})"
        for action in self._actions:
            if action.dest != f.name:
                continue
            # absent unless given: the YAML layer sits between the dataclass defaults and the command line
            action.default = argparse.SUPPRESS
            if not action.option_strings[0].startswith(f"--{f.name}"):  # HfArgumentParser's --no_<name>
                action.help = f"Same as --{f.name} false."
                continue
            action.help = help_text
            action.type = _converter(f.name, kind)
            if kind.is_list:
                action.metavar = kind.base.__name__.upper()
            elif kind.base is bool:  # '--flag' alone is true, also for an optional boolean
                action.nargs, action.const, action.metavar = "?", True, "BOOL"
            else:
                action.metavar = kind.base.__name__.upper()

    def _canonical_flags(self) -> list[str]:
        # suggest the names the docs use, not HfArgumentParser's dashed spellings of them
        return [s for a in self._actions for s in a.option_strings if "-" not in s.removeprefix("--")]

    def parse_values(self, argv: list[str]) -> dict[str, Any]:
        self._given = []
        try:
            ns = vars(self.parse_args(argv))
            given = self._given
        finally:
            self._given = None
        values: dict[str, Any] = {}
        if "config" in ns:
            path = ns.pop("config")
            from_file = self._load_yaml_spelled(path)
            self._refuse_conflicts(given, from_file, path)
            values.update({key: value for key, (_, value) in from_file.items()})
        else:
            self._refuse_conflicts(given, {}, "")
        values.update(ns)
        return values

    @staticmethod
    def _refuse_conflicts(given: _Given, from_file: dict[str, tuple[str, Any]], path: str) -> None:
        """Two names of one field with different values: on the command line, or one there and another in
        the file (the command line overrides the file only under the same name)."""
        by_field: dict[str, dict[str, tuple[str, Any]]] = {}
        for field, flag, value, bare in given:
            spellings = by_field.setdefault(field, {})
            spellings.pop(_spelling(flag), None)  # the last of one spelling counts, as argparse has it
            spellings[_spelling(flag)] = (flag if bare else f"{flag} {_shown(value)}", value)
        for field, spellings in by_field.items():
            (first_text, first), *others = spellings.values()
            for text, value in others:
                if value != first:
                    raise UserError(
                        f"{first_text} and {text} both set {field}, to different values: give it once."
                    )
            if field in from_file:
                key, in_file = from_file[field]
                final = list(spellings.values())[-1][1]
                if _spelling(key) not in spellings and in_file != final:
                    raise UserError(
                        f"{list(spellings.values())[-1][0]} on the command line and '{key}: {_shown(in_file)}' in "
                        f"--config {path} both set {field}, to different values: use one name for it (the "
                        "command line overrides the file under the same name)."
                    )

    def load_yaml(self, path: str) -> dict[str, Any]:
        """A ``--config`` file's values by field name, converted to the fields' types."""
        return {key: value for key, (_, value) in self._load_yaml_spelled(path).items()}

    def _load_yaml_spelled(self, path: str) -> dict[str, tuple[str, Any]]:
        """A ``--config`` file's values by field name, each with the key that gave it."""
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
        unknown = [str(k) for k in data if self.aliases.get(str(k), str(k)) not in self.hints]
        if unknown:
            names = [f.name for f in dataclasses.fields(self.cls)]
            keys = ", ".join(f"{k!r}{did_you_mean(k, [*names, *self.aliases])}" for k in unknown)
            raise UserError(
                f"--config {path}: unknown key{'s' if len(unknown) > 1 else ''} {keys}; keys are the flag names "
                "without '--'."
            )
        out: dict[str, tuple[str, Any]] = {}
        for raw_key, value in data.items():
            key = self.aliases.get(str(raw_key), str(raw_key))
            converted = self._from_yaml(key, value)
            if key in out and out[key][1] != converted:
                other, before = out[key]
                raise UserError(
                    f"--config {path}: '{other}: {_shown(before)}' and '{raw_key}: {_shown(converted)}' both set "
                    f"{key}, to different values: keep one."
                )
            out[key] = (str(raw_key), converted)
        return out

    def _from_yaml(self, key: str, value: Any) -> Any:
        kind = _kind(self.hints[key])
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
