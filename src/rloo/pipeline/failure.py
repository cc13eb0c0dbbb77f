"""Why a local pipeline run failed, in one line: the failed step's own reason, read from its log.

``kfp.local`` prints every step's log on stdout, framed by "Executing task '<task>'" ... "Task '<task>'
finished", and raises ``RuntimeError("... Inner task failed: '<task>' ...")`` at the end, which names the
step but not the reason. :class:`rloo.pipeline.console.StepConsole` keeps what is printed and
:func:`run_failure` turns both into the line the CLI prints last.
"""

from __future__ import annotations

import re

# The one-line reasons steps give, most specific first: the validate step's, a CLI's ('rloo train: error:
# ...'), then the last line of a Python traceback ('rloo.errors.UserError: ...', 'RuntimeError: ...').
_REASONS = (
    re.compile(r"(invalid pipeline parameters: .+)"),
    re.compile(r"\b(rloo [a-z]+: error: .+)"),
    re.compile(r"^\s*(?:[A-Za-z_][\w.]*\.)?([A-Z]\w*(?:Error|Exception|Exit): .+)$"),
)


def plain(text: str) -> str:
    """``text`` without the ANSI colours kfp.local puts in its messages."""
    return re.sub(r"\x1b\[[0-9;]*m", "", text)


def step_reason(console: str, task: str) -> str | None:
    """The one-line reason of ``task``'s failure in the console output of a local run, or None."""
    lines = plain(console).splitlines()
    start = max((i for i, x in enumerate(lines) if f"Executing task '{task}'" in x), default=None)
    if start is None:
        return None
    end = next((i for i in range(start + 1, len(lines)) if f"Task '{task}' finished" in lines[i]), len(lines))
    for pattern in _REASONS:
        for line in reversed(lines[start:end]):
            m = pattern.search(line)
            if m:
                return " ".join(m.group(1).split()).removeprefix("UserError: ")
    return None


def run_failure(error: str, console: str) -> str:
    """The last line of a failed local run from kfp.local's ``RuntimeError`` message and the console output:
    the failed step and its reason, or kfp.local's own message when the log has no reason."""
    message = " ".join(plain(error).split())
    failed = re.search(r"Inner task failed: '([^']+)'", message)
    reason = step_reason(console, failed.group(1)) if failed else None
    if failed and reason:
        return f"local pipeline run failed at step {failed.group(1)}: {reason[:500]}"
    return f"local pipeline run failed: {message[:300]}"
