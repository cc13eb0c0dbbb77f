"""The pipeline's parameters as KFP sees them (names, KFP types, defaults, help), derived from the config
fields that declare them (:mod:`rloo.stages.plan`), the pipeline signature made of them, and the checks of
user-given values against them.

``rloo pipeline run --local`` and ``rloo pipeline submit`` check names and types here before KFP sees the
values (KFP's own type check is a traceback, and ``kfp.local`` leaves its workspace behind when it fails);
``pipelines/README.md`` carries :func:`markdown_table`, and a test keeps the two equal.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rloo.errors import UserError

# KFP parameter type -> what the error message says a value must be
_WANT = {
    "String": "a string",
    "Integer": "an integer",
    "Float": "a number",
    "Boolean": "true or false",
    "Dict": "a mapping, e.g. {key: value}",
    "List": "a list, e.g. [a, b]",
}


@dataclass(frozen=True)
class PipelineParam:
    name: str
    type: str  # the KFP type: String, Integer, Float, Boolean, Dict or List
    default: Any  # None when required
    required: bool
    help: str
    rule: str = ""  # what a value must be ('>= 1', 'one of a, b, c'), as the config field declares it


# Python type of a parameter -> KFP's name for it
_KFP_TYPES = {str: "String", int: "Integer", float: "Float", bool: "Boolean", dict: "Dict", list: "List"}


def pipeline_params() -> list[PipelineParam]:
    """Every parameter of the pipeline, in the order of its signature: the config fields that declare one
    (:func:`rloo.stages.plan.pipeline_fields`)."""
    from rloo.stages.plan import pipeline_fields

    return [
        PipelineParam(p.name, _KFP_TYPES[p.type], p.default, p.required, p.help, _rule(p.part, p.field))
        for p in pipeline_fields()
    ]


def _rule(part: str, field: str) -> str:
    """What a value of config ``field`` of plan part ``part`` must be, as the field declares it; '' for any."""
    from rloo.options import rule_of
    from rloo.stages.plan import part_configs

    (declared,) = [f for f in dataclasses.fields(part_configs()[part]) if f.name == field]
    rule = rule_of(declared)
    return "" if rule is None else rule.text


def pipeline_signature(body: Callable[[dict[str, Any]], None]) -> Callable[..., None]:
    """Decorator for the pipeline's body: the function KFP compiles, whose signature (names, types, defaults)
    and docstring (each parameter's help, which the KFP UI shows) are the declared pipeline parameters.
    ``body`` gets them as one mapping; KFP calls the function with one argument per parameter, in order."""
    from rloo.stages.plan import pipeline_fields

    fields = pipeline_fields()
    signature = inspect.Signature(
        [
            inspect.Parameter(
                p.name,
                inspect.Parameter.POSITIONAL_OR_KEYWORD,
                annotation=p.type,
                default=inspect.Parameter.empty if p.required else p.default,
            )
            for p in fields
        ],
        return_annotation=None,
    )

    def pipeline(*args: Any, **kwargs: Any) -> None:
        body(signature.bind(*args, **kwargs).arguments)

    summary = (body.__doc__ or "").strip()
    args = "\n".join(f"    {p.name}: {' '.join(p.help.split())}" for p in fields)
    pipeline.__doc__ = f"{summary}\n\nArgs:\n{args}\n"
    pipeline.__name__ = pipeline.__qualname__ = body.__name__
    pipeline.__module__ = body.__module__
    pipeline.__signature__ = signature  # type: ignore[attr-defined]
    return pipeline


def coerce(param: PipelineParam, value: Any) -> Any:
    """``value`` as the parameter's type when that loses nothing (``'1e-5'`` -> ``1e-05``, ``2`` -> ``2.0``,
    ``2024`` -> ``'2024'`` for a string); a one-line UserError otherwise."""
    kind = param.type
    if kind == "String":
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)  # YAML read '2024' as a number; the user meant the text
    elif kind == "Integer":
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value.strip())
            except ValueError:
                pass
    elif kind == "Float":
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads 1e-5 (no dot) as a string
            try:
                number = float(value.strip())
            except ValueError:
                pass
            else:
                if math.isfinite(number):
                    return number
    elif kind == "Boolean":
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in ("true", "false"):
            return value.strip().lower() == "true"
    elif kind == "Dict":
        if isinstance(value, dict):
            return value
    elif kind == "List":
        if isinstance(value, list):
            return value
    else:  # a type this module does not know: leave it to KFP
        return value
    shown = "null" if value is None else repr(value)
    hint = "; quote it to pass it as text" if kind == "String" and isinstance(value, bool) else ""
    raise UserError(f"pipeline parameter {param.name} expects {_WANT[kind]} (got {shown}){hint}.")


def check_params(params: dict[str, Any], *, required: bool) -> dict[str, Any]:
    """Names (and with ``required`` the required ones) and types of user-given pipeline parameters: a
    one-line UserError for the first problem, else the values converted to the parameters' types."""
    specs = {p.name: p for p in pipeline_params()}
    unknown = sorted(set(params) - set(specs))
    if unknown:
        hints = []
        for name in unknown:
            close = difflib.get_close_matches(name, list(specs), n=1)
            hints.append(f"{name} (did you mean {close[0]}?)" if close else name)
        raise UserError(
            f"unknown pipeline parameter(s) {', '.join(hints)}; the parameters are listed in pipelines/README.md."
        )
    missing = [p.name for p in specs.values() if p.required and p.name not in params]
    if required and missing:
        raise UserError(f"missing pipeline parameter(s) {', '.join(missing)}: pass --param NAME=VALUE.")
    return {name: coerce(specs[name], value) for name, value in params.items()}


def with_defaults(params: dict[str, Any]) -> dict[str, Any]:
    """``params`` over the pipeline's defaults (what a run actually gets)."""
    defaults = {p.name: p.default for p in pipeline_params() if not p.required}
    return defaults | params


def _cell(text: str) -> str:
    """``text`` safe in a Markdown table cell: no column breaks, no '<name>' read as an HTML tag."""
    return text.replace("|", "\\|").replace("<", "&lt;")


def markdown_table() -> str:
    """The parameter table of ``pipelines/README.md``: name, type, default, help (with the rule a value
    must follow, where the config field declares one)."""
    import json

    rows = ["| parameter | type | default | description |", "| --- | --- | --- | --- |"]
    for p in pipeline_params():
        default = "*required*" if p.required else f"`{json.dumps(p.default)}`"
        text = f"{p.help} Must be {p.rule}." if p.rule else p.help
        rows.append(f"| `{p.name}` | {p.type} | {_cell(default)} | {_cell(text)} |")
    return "\n".join(rows) + "\n"


TABLE_BEGIN = "<!-- parameters: generated by 'rloo pipeline compile' from the config fields that declare them; do not edit -->"
TABLE_END = "<!-- end of parameters -->"


def readme_with_table(readme: str) -> str:
    """``readme`` (the text of ``pipelines/README.md``) with its parameter table replaced by
    :func:`markdown_table`."""
    begin, end = readme.index(TABLE_BEGIN) + len(TABLE_BEGIN), readme.index(TABLE_END)
    return f"{readme[:begin]}\n{markdown_table()}{readme[end:]}"
