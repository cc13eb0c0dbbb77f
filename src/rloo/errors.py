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
