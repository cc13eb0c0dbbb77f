"""The judge's templates: a user's file is checked for the placeholders of its kind; prompts and references
become the plain text the judge reads."""

from __future__ import annotations

from pathlib import Path

import pytest

from rloo.errors import UserError
from rloo.judging.templates import (
    PAIRWISE_FIELDS,
    PAIRWISE_TEMPLATE,
    POINTWISE_FIELDS,
    POINTWISE_TEMPLATE,
    completion_text,
    load_template,
    prompt_text,
)


def test_the_default_templates_hold_their_placeholders() -> None:
    assert all(f in PAIRWISE_TEMPLATE for f in PAIRWISE_FIELDS)
    assert all(f in POINTWISE_TEMPLATE for f in POINTWISE_FIELDS)


def test_a_template_lacking_a_placeholder_of_its_kind_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "t.txt"
    path.write_text("Rate {response} for {prompt}.")
    assert load_template(str(path), POINTWISE_FIELDS) == "Rate {response} for {prompt}."
    with pytest.raises(UserError) as e:
        load_template(str(path), PAIRWISE_FIELDS)
    assert str(e.value) == (
        f"--judge_template {path}: missing placeholder(s) {{response_a}}, {{response_b}}; add them."
    )
    with pytest.raises(UserError, match="no such file"):
        load_template(str(tmp_path / "missing.txt"))


def test_prompts_and_references_as_plain_text() -> None:
    assert prompt_text("p") == "p"
    assert prompt_text([{"role": "user", "content": "hi"}]) == "hi"
    assert prompt_text([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]) == (
        "system: s\n\nuser: u"
    )
    assert completion_text(" ref") == " ref"
    assert completion_text([{"role": "assistant", "content": "a"}]) == "a"
    assert completion_text(None) is None


def test_placeholders_are_filled_once_whatever_the_values_hold() -> None:
    from rloo.judging.pairwise import render_prompt

    content = render_prompt("{prompt}|{response_a}|{response_b}", "{response_b}", "{prompt}", "a {x} b")
    assert content == "{response_b}|{prompt}|a {x} b"
