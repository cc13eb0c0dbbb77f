"""The one exception type for mistakes a user can fix.

A ``UserError`` is printed by the CLI as a single line (no traceback) and exits with code 2. Its message
says what is wrong and how to fix it, e.g. ``--rloo_k must be >= 2 (got 1): RLOO needs at least two
completions per prompt to form a baseline.``
"""

from __future__ import annotations


class UserError(Exception):
    """A problem with the user's input (flags, files, data, plugins), reported in one line."""

    exit_code = 2

    def __init__(self, message: str) -> None:
        # Keep it to one line whatever the caller passed: the CLI contract is one line per error.
        super().__init__(" ".join(str(message).split()))


class ServiceUnavailable(UserError):
    """A service the run needs (a tracking server, object storage) could not be reached or answered 5xx:
    nothing about the request is wrong, and the same command may well work a minute later. Exits 75
    (``EX_TEMPFAIL`` of sysexits.h) instead of 2, so a retried pipeline step tries again
    (rloo.stages.retry tells the two apart by the status)."""

    exit_code = 75


def reworded(error: UserError, message: str) -> UserError:
    """``message`` as an error that exits as ``error`` does: a caller that adds context to a failure (which
    flag, which step) must not turn a service out of reach (75, a retry may heal it) into a mistake (2)."""
    if error.exit_code == ServiceUnavailable.exit_code:
        return ServiceUnavailable(message)
    return UserError(message)
