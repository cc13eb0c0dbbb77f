"""The rule a config field declares with :func:`rloo.options.option` (``choices=``, ``check=``, ``hint=``):
:func:`rloo.options.check_fields` refuses a value that breaks it in one line, ``--help`` states it, and the
command line reaches it through the same check rather than argparse's own."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import pytest

from rloo.errors import UserError
from rloo.options import (
    Check,
    above,
    at_least,
    check_fields,
    default_of,
    in_range,
    option,
    rule_of,
    text_given,
)


@dataclass
class Toy:
    mode: str = option("a", "Mode.", choices=("a", "b", "c"))
    pick: str | None = option(None, "Pick.", choices=("x", "y"))
    only: str = option("eos", "Only.", choices=("eos",), hint="; use --other for others")
    count: int = option(1, "Count.", check=at_least(1))
    ratio: float = option(0.5, "Ratio.", check=in_range(0, 1, open_low=True), hint="; 1.0 is off")
    scale: float = option(1.0, "Scale.", check=above(0, finite=True))
    limit: int | None = option(None, "Limit.", check=at_least(1), hint="; omit it for none")
    name: str | None = option("n", "Name.", check=text_given("{flag} is required: give one."))
    paths: list[str] = option([], "Paths.", check=Check(lambda p: "/" in p, "a path with a '/'"))
    free: int = option(0, "Free.")

    def __post_init__(self) -> None:
        check_fields(self)


REFUSED: list[tuple[dict[str, Any], str]] = [
    ({"mode": "d"}, "--mode must be one of a, b, c (got 'd')."),
    ({"pick": "z"}, "--pick must be 'x' or 'y' (got 'z')."),
    ({"only": "x"}, "--only must be 'eos' (got 'x'); use --other for others."),
    ({"count": 0}, "--count must be >= 1 (got 0)."),
    ({"ratio": 0.0}, "--ratio must be in (0, 1] (got 0.0); 1.0 is off."),
    ({"ratio": math.nan}, "--ratio must be in (0, 1] (got nan); 1.0 is off."),
    ({"scale": math.inf}, "--scale must be a finite number > 0 (got inf)."),
    ({"limit": 0}, "--limit must be >= 1 (got 0); omit it for none."),
    ({"name": None}, "--name is required: give one."),
    ({"name": "  "}, "--name is required: give one."),
    ({"paths": ["a/b", "c"]}, "--paths must be a path with a '/' (got 'c')."),  # each value of a list
    ({"count": 0, "mode": "d"}, "--mode must be one of a, b, c (got 'd')."),  # the first field declared
]


@pytest.mark.parametrize(("kw", "message"), REFUSED, ids=[m for _, m in REFUSED])
def test_a_value_against_the_declared_rule_is_one_line(kw: dict[str, Any], message: str) -> None:
    with pytest.raises(UserError) as refused:
        Toy(**kw)
    assert str(refused.value) == message


def test_values_that_follow_the_rules_pass() -> None:
    toy = Toy(mode="c", pick="y", count=3, ratio=1.0, scale=1e9, limit=1, paths=["a/b"], free=-5)
    assert (toy.mode, toy.ratio, toy.limit) == ("c", 1.0, 1)
    assert Toy(pick=None, limit=None).pick is None  # an optional field left unset follows any rule


def test_the_rule_reads_as_help_text() -> None:
    texts = {f.name: rule.text for f in dataclasses.fields(Toy) if (rule := rule_of(f)) is not None}
    assert texts == {
        "mode": "one of a, b, c",
        "pick": "'x' or 'y'",
        "only": "'eos'",
        "count": ">= 1",
        "ratio": "in (0, 1]",
        "scale": "a finite number > 0",
        "limit": ">= 1",
        "name": "non-empty",
        "paths": "a path with a '/'",
    }


def test_a_hint_needs_a_rule() -> None:
    with pytest.raises(TypeError, match="hint"):
        option(1, "Count.", hint="; 0 is off")


def test_default_of_reads_the_declaration() -> None:
    assert default_of(Toy, "count") == 1 and default_of(Toy(count=4), "count") == 1
    first, second = default_of(Toy, "paths"), default_of(Toy, "paths")
    assert first == [] and first is not second  # a list default is a fresh copy


def test_help_states_each_rule_and_the_command_line_gets_the_declared_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """HfArgumentParser hands a field's metadata to argparse's add_argument as keywords
    (huggingface/transformers src/transformers/hf_argparser.py, ``_parse_dataclass_field``), and argparse
    refuses a value outside ``choices`` itself, with its own "invalid choice" text (python/cpython
    Lib/argparse.py, ``_check_value``), before ``none`` could mean unset. The rule stays out of argparse: the
    config applies it, so a flag, a --config file and a pipeline parameter get the same line."""
    from rloo.parsing import parse_config
    from rloo.parsing.hf import ConfigParser

    monkeypatch.setenv("COLUMNS", "400")  # one help entry a line: nothing wrapped inside a rule
    text = " ".join(ConfigParser(Toy, prog="toy").format_help().split())
    assert "Mode. (must be one of a, b, c; default: a)" in text
    assert "Limit. (must be >= 1)" in text
    assert "Free. (default: 0)" in text
    with pytest.raises(UserError) as refused:
        parse_config(Toy, ["--mode", "d"], prog="toy")
    assert str(refused.value) == "--mode must be one of a, b, c (got 'd')."
    assert parse_config(Toy, ["--pick", "none", "--paths", "a/b", "c/d"], prog="toy").pick is None
