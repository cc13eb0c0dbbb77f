"""What the judge is shown: its prompt templates (pairwise and pointwise), a user's template file checked for
the placeholders its kind fills, and prompts and reference answers as plain text."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from rloo.errors import UserError

# Placeholders each kind of template must contain (filled with str.replace: prompts may hold braces)
PAIRWISE_FIELDS = ("{prompt}", "{response_a}", "{response_b}")
POINTWISE_FIELDS = ("{prompt}", "{response}")


def fill(template: str, values: dict[str, str]) -> str:
    """``template`` with each placeholder of ``values`` (``{"{prompt}": ...}``) replaced, in one pass: not
    str.format (prompts and responses may hold braces), nor one str.replace after another (a prompt that
    quotes ``{response}`` would get the response put in)."""
    pattern = "|".join(re.escape(k) for k in values)
    return re.sub(pattern, lambda m: values[m.group(0)], template)


def load_template(path: str, fields: tuple[str, ...] = PAIRWISE_FIELDS) -> str:
    """The text of template file ``path``; a one-line UserError when it is missing or lacks one of ``fields``."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise UserError(f"--judge_template {path}: no such file; pass a text file with the judge prompt.")
    text = p.read_text()
    missing = [t for t in fields if t not in text]
    if missing:
        raise UserError(f"--judge_template {path}: missing placeholder(s) {', '.join(missing)}; add them.")
    return text


def _content(message: Any) -> str:
    return str(message.get("content", "")) if isinstance(message, dict) else str(message)


def prompt_text(prompt: Any) -> str:
    """Plain text of a prompt for the judge: chat messages become 'role: content' lines."""
    if isinstance(prompt, list):
        if len(prompt) == 1:
            return _content(prompt[0])
        return "\n\n".join(f"{m.get('role', 'user')}: {_content(m)}" for m in prompt)
    return str(prompt)


def completion_text(value: Any) -> str | None:
    """A reference completion as text: a string, or the assistant turns of chat messages; None otherwise."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(isinstance(m, dict) for m in value):
        return "\n".join(_content(m) for m in value if m.get("role", "assistant") == "assistant")
    return None


# Project-written (not TRL's): asks for one letter so parsing is unambiguous; A/B rather than 0/1 so that a
# number inside an explanation is not mistaken for a verdict.
PAIRWISE_TEMPLATE = """You compare two responses to the same prompt and decide which one is better.
A better response follows the prompt's instructions, is accurate, relevant and concise. For a summary: it
keeps the most important points of the text without adding anything that is not there.
Do not let the order of the responses or their length influence you.

## Prompt

{prompt}

## Response A

{response_a}

## Response B

{response_b}

Which response is better? Answer with exactly one letter, A or B, and nothing else."""

# Project-written, in the pairwise template's words: one number alone, so that parsing is unambiguous.
POINTWISE_TEMPLATE = """You rate a response to a prompt on a scale from 0 (useless) to 10 (excellent).
A good response follows the prompt's instructions, is accurate, relevant and concise. For a summary: it
keeps the most important points of the text without adding anything that is not there.
Do not let the response's length influence you.

## Prompt

{prompt}

## Response

{response}

How good is the response? Answer with exactly one whole number from 0 to 10 and nothing else."""
