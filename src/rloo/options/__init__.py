"""Typed options: a stage's config dataclass declares each field once, with :func:`option` (type, default,
one-line help, aliases, the pipeline parameter that sets it, and the rule a value of it must follow: its
``choices`` or a :class:`Check`), and everything that reads flags reads them from there (:mod:`rloo.parsing`,
whose ``--help`` states each rule), as the pipeline's parameters and their table are made from there
(:mod:`rloo.stages.plan`). :func:`check_fields` refuses a value that breaks its field's rule, in one line;
rules between fields stay with the config that has them.

Imports nothing but the standard library and :mod:`rloo.errors`: every stage's config module builds on it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rloo.errors import UserError

__all__ = [
    "PIPELINE",
    "RULE",
    "Check",
    "Exposed",
    "Rule",
    "above",
    "aliases_of",
    "at_least",
    "check_fields",
    "default_of",
    "in_range",
    "option",
    "rule_of",
    "text_given",
]

# The metadata key under which a field's pipeline parameter (:class:`Exposed`) is recorded
PIPELINE = "pipeline"
# The metadata key under which a field's rule (:class:`Rule`) is recorded
RULE = "rule"
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


@dataclass(frozen=True)
class Check:
    """Which values of one field are valid: those ``test`` holds for; ``rule`` says which after "must be"
    (``>= 1``, ``in (0, 1]``), as ``--help``, the pipeline's parameter table and the error put it.
    ``message``: the whole error where "<flag> must be <rule> (got <value>)" does not read well, with
    ``{flag}`` and ``{value}`` filled in. ``none_too``: None (an optional field left unset, which every other
    rule lets pass) must pass ``test`` as well."""

    test: Callable[[Any], bool]
    rule: str
    message: str | None = None
    none_too: bool = False


def at_least(low: float, *, finite: bool = False) -> Check:
    """``>= low`` (``finite``: and not infinite or NaN)."""
    if finite:
        return Check(lambda v: math.isfinite(v) and v >= low, f"a finite number >= {low:g}")
    return Check(lambda v: v >= low, f">= {low:g}")


def above(low: float, *, finite: bool = False) -> Check:
    """``> low`` (``finite``: and not infinite or NaN)."""
    if finite:
        return Check(lambda v: math.isfinite(v) and v > low, f"a finite number > {low:g}")
    return Check(lambda v: v > low, f"> {low:g}")


def in_range(low: float, high: float, *, open_low: bool = False, open_high: bool = False) -> Check:
    """Between ``low`` and ``high``, each end included unless open (NaN is in no range)."""

    def test(v: Any) -> bool:
        return (v > low if open_low else v >= low) and (v < high if open_high else v <= high)

    return Check(test, f"in {'(' if open_low else '['}{low:g}, {high:g}{')' if open_high else ']'}")


def text_given(message: str) -> Check:
    """A value that is more than blanks (None too, where the field is optional), else the error ``message``."""
    return Check(lambda v: bool(v and str(v).strip()), "non-empty", message=message, none_too=True)


def _one_of(choices: tuple[Any, ...]) -> str:
    if len(choices) == 1:
        return repr(choices[0])
    if len(choices) == 2:
        return f"{choices[0]!r} or {choices[1]!r}"
    return "one of " + ", ".join(map(str, choices))


def _shown(value: Any) -> str:
    return repr(value) if isinstance(value, str) else str(value)


@dataclass(frozen=True)
class Rule:
    """What one field's values must be: one of ``choices``, and/or pass ``check``. ``hint``: what follows
    "(got <value>)" in the error, how to fix it (``"; 0 is off"``). A list field's rule holds for each of its
    values."""

    choices: tuple[Any, ...] | None = None
    check: Check | None = None
    hint: str = ""

    @property
    def text(self) -> str:
        """What follows "must be" in ``--help`` and the pipeline's parameter table."""
        parts = [] if self.choices is None else [_one_of(self.choices)]
        if self.check is not None:
            parts.append(self.check.rule)
        return " and ".join(parts)

    def problem(self, flag: str, value: Any) -> str | None:
        """The one-line error for ``value`` of ``flag``, or None when it follows the rule."""
        for v in value if isinstance(value, list) else [value]:
            if v is None and not (self.check is not None and self.check.none_too):
                continue
            if self.choices is not None and v not in self.choices:
                return f"{flag} must be {_one_of(self.choices)} (got {_shown(v)}){self.hint}."
            if self.check is not None and not self.check.test(v):
                if self.check.message is not None:
                    return self.check.message.format(flag=flag, value=v)
                return f"{flag} must be {self.check.rule} (got {_shown(v)}){self.hint}."
        return None


def option(
    default: Any,
    help: str,
    *,
    aliases: tuple[str, ...] = (),
    pipeline: str | Exposed | None = None,
    choices: tuple[Any, ...] | None = None,
    check: Check | None = None,
    hint: str = "",
) -> Any:
    """A config field: its default, the one-line help ``--help`` prints, and other flag names for it
    (``aliases=("beta",)`` makes ``--beta`` set this field). ``pipeline``: the name of the pipeline parameter
    that sets it (or an :class:`Exposed` with a pipeline default, required or help of its own). ``choices``
    and ``check``: the values it takes (see :class:`Rule`; :func:`check_fields` applies them), ``hint`` how to
    fix one it does not. A list or dict default is copied per instance."""
    metadata: dict[str, Any] = {"help": help}
    if pipeline is not None:
        metadata[PIPELINE] = Exposed(pipeline) if isinstance(pipeline, str) else pipeline
    if aliases:
        # each alias also in its dashed spelling, as HfArgumentParser spells the field's own name
        metadata["aliases"] = [f"--{s}" for a in aliases for s in dict.fromkeys((a, a.replace("_", "-")))]
    if choices is not None or check is not None:
        metadata[RULE] = Rule(None if choices is None else tuple(choices), check, hint)
    elif hint:
        raise TypeError("option(): a hint says how to fix a value that breaks choices= or check=; give one")
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def rule_of(field: dataclasses.Field[Any]) -> Rule | None:
    """The rule ``field`` declares (its ``choices`` and ``check``), if any."""
    return field.metadata.get(RULE)


def check_fields(obj: Any) -> None:
    """A one-line UserError for the first field of dataclass instance ``obj`` whose value breaks the rule it
    declares (``--name must be >= 1 (got 0).``)."""
    for f in dataclasses.fields(obj):
        rule = rule_of(f)
        problem = rule.problem(f"--{f.name}", getattr(obj, f.name)) if rule is not None else None
        if problem is not None:
            raise UserError(problem)


def default_of(cls: Any, name: str) -> Any:
    """The declared default of field ``name`` of dataclass ``cls`` (a class or an instance)."""
    (f,) = [f for f in dataclasses.fields(cls) if f.name == name]
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def aliases_of(cls: type) -> dict[str, str]:
    """``{alias: field name}`` for the aliases the fields of dataclass ``cls`` declare, in field order."""
    return {
        alias.removeprefix("--"): f.name
        for f in dataclasses.fields(cls)
        for alias in f.metadata.get("aliases", ())
        if "-" not in alias.removeprefix("--")  # not the dashed spellings option() adds
    }
