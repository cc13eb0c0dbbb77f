"""Why a local pipeline run failed, in one line: the failed step's own reason, read from its log.

``kfp.local`` prints every step's log on stdout, framed by "Executing task '<task>'" ... "Task '<task>'
finished", and raises ``RuntimeError("... Inner task failed: '<task>' inside '<dag>'")`` at the end, which
names the step but not the reason. :class:`rloo.pipeline.console.StepConsole` keeps what is printed and
:func:`run_failure` turns both into the line the CLI prints last.
"""

from __future__ import annotations

import re

# The one-line reasons steps give: the validate step's, a CLI's ('rloo train: error: ...'), and what a step
# says on stderr as it exits ('fetching the SFT model failed: ...'; rloo.stages.retry: '[rloo] <the
# UserError's message>'). A Python traceback's exception line is found by the traceback's layout
# (_exception_lines): its class may have any name.
_REASONS = (
    re.compile(r"(invalid pipeline parameters: .+)"),
    re.compile(r"\b(rloo [a-z]+: error: .+)"),
    re.compile(r"^\s*([a-z][\w ]* failed: .+)$"),
    re.compile(r"^\s*\[rloo\] (.+)$"),
)
_TRACEBACK = "Traceback (most recent call last):"
# 'package.module.ClassName: message' (or the class alone); rloo's own errors are one-line reasons as they are
_EXCEPTION = re.compile(r"^(?P<module>(?:[A-Za-z_]\w*\.)*)(?P<cls>[A-Za-z_]\w*)(?::\s*(?P<msg>.*))?$")


def plain(text: str) -> str:
    """``text`` without the ANSI colours kfp.local puts in its messages."""
    return re.sub(r"\x1b\[[0-9;]*m", "", text)


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _exception_lines(lines: list[str]) -> list[tuple[int, str]]:
    """The exception line of each traceback in ``lines`` (by index): the first line after its frames back
    at the indentation of 'Traceback (most recent call last):' (the frames are indented deeper)."""
    found = []
    for i, line in enumerate(lines):
        if line.strip() != _TRACEBACK:
            continue
        j = next((k for k in range(i + 1, len(lines)) if lines[k].strip()), None)
        while (
            j is not None and j < len(lines) and (not lines[j].strip() or _indent(lines[j]) > _indent(line))
        ):
            j += 1
        if j is None or j >= len(lines):
            continue
        m = _EXCEPTION.match(lines[j].strip())
        if m:
            own = m["module"].startswith("rloo.") and m["msg"]
            found.append((j, m["msg"] if own else lines[j].strip()))
    return found


def step_reason(console: str, task: str) -> str | None:
    """The one-line reason of ``task``'s failure in the console output of a local run, or None: the last
    reason the step gave (what it printed as it exited comes after anything it logged before)."""
    lines = plain(console).splitlines()
    start = max((i for i, x in enumerate(lines) if f"Executing task '{task}'" in x), default=None)
    if start is None:
        return None
    end = next((i for i in range(start + 1, len(lines)) if f"Task '{task}' finished" in lines[i]), len(lines))
    block = lines[start:end]
    found = _exception_lines(block)
    for i, line in enumerate(block):
        for pattern in _REASONS:
            m = pattern.search(line)
            if m:
                found.append((i, m.group(1)))
                break
    if not found:
        return None
    reason = max(found, key=lambda x: x[0])[1]
    return " ".join(reason.split()).removeprefix("UserError: ")


def run_failure(error: str, console: str) -> str:
    """The last line of a failed local run from kfp.local's ``RuntimeError`` message and the console output:
    the failed step and its reason, or kfp.local's own message when the log has no reason."""
    message = " ".join(plain(error).split())
    failed = re.search(r"Inner task failed: '([^']+)'", message)
    reason = step_reason(console, failed.group(1)) if failed else None
    if failed and reason:
        return f"local pipeline run failed at step {failed.group(1)}: {reason[:500]}"
    return f"local pipeline run failed: {message[:300]}"
