"""docs/options.md, the flag reference of ``rloo train``, ``rloo eval`` and ``rloo push``, is generated from the
config fields that declare the flags (``rloo.options.option``) and kept current: a stale file fails here with
the command that regenerates it.

The flags a command takes are the ones ``transformers.HfArgumentParser`` makes from its config dataclass
(huggingface/transformers ``src/transformers/hf_argparser.py``, ``_parse_dataclass_field``: ``--<field>``, its
``aliases``, and a ``--no_<field>`` for a boolean that defaults to true), so the reference is checked against
each command's own ``--help``.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from rloo.options import at_least, option
from rloo.pipeline.reference import COMMANDS, config_class, flags_table, options_reference, reference_path

ROOT = Path(__file__).resolve().parents[1]
REGENERATE = "run 'rloo pipeline compile' (it rewrites docs/options.md with the pipeline's files)"


def test_the_committed_reference_is_the_generated_one(tmp_path: Path) -> None:
    """Regenerated into an empty checkout-shaped directory, the reference is byte for byte the committed one."""
    fresh = reference_path(tmp_path)
    fresh.parent.mkdir()
    fresh.write_text(options_reference())
    committed = reference_path(ROOT)
    assert committed.is_file(), f"docs/options.md is missing: {REGENERATE}"
    assert committed.read_text() == fresh.read_text(), f"docs/options.md is stale: {REGENERATE}"


def _table_rows(command: str) -> list[str]:
    text = reference_path(ROOT).read_text()
    section = text.split(f"\n## `{command}`\n", 1)[1].split("\n## ", 1)[0]
    return [line for line in section.splitlines() if line.startswith("| `--")]


def _help_flags(command: str, capsys: pytest.CaptureFixture[str]) -> set[str]:
    """The flags ``rloo <command> --help`` lists, without the dashed spellings and the ``--no_`` negations
    HfArgumentParser adds to each (the reference says so once, above the tables)."""
    from rloo.cli import main

    capsys.readouterr()
    assert main([command.removeprefix("rloo "), "--help"]) == 0
    flags = set(re.findall(r"(?<![\w-])--[a-z][\w-]*", capsys.readouterr().out))
    return {f for f in flags if "-" not in f[2:] and not f.startswith("--no_")} - {"--help", "--config"}


@pytest.mark.parametrize("command", COMMANDS)
def test_each_command_documents_the_flags_its_help_lists(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    documented = {
        flag for row in _table_rows(command) for flag in re.findall(r"`(--\w+)`", row.split(" | ")[0])
    }
    help_flags = _help_flags(command, capsys)
    assert documented - help_flags == set(), f"{command}: documented flags its --help does not list"
    negations = {f"--no_{f.name}" for f in dataclasses.fields(config_class(command)) if f.default is True}
    assert help_flags - documented - negations == set(), f"{command}: flags missing from docs/options.md"


def test_a_declared_rule_default_and_alias_reach_the_table() -> None:
    """What a field declares (choices, a check, aliases, its default) is what its row says."""

    @dataclasses.dataclass
    class Declared:
        mode: str = option("a", "How to do it.", choices=("a", "b"), aliases=("style",))
        steps: int = option(3, "How many.", check=at_least(1))
        names: list[str] = option([], "Some names.")

    rows = {row.split("`")[1]: row for row in flags_table(Declared).splitlines()[2:]}
    assert rows["--mode"].startswith("| `--mode` `--style` | str | `a` | 'a' or 'b' |")
    assert "| int | `3` | >= 1 |" in rows["--steps"]
    assert "| list of str | *unset* |" in rows["--names"]
