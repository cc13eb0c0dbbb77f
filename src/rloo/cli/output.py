"""Where the CLI's progress messages go: this project's loggers (``rloo.*``) at INFO on stdout, each line
prefixed ``[rloo]``; stderr is kept for the one-line error of a failed run.

Only the ``rloo`` logger gets a handler. Libraries keep their own (Hugging Face's retry warnings, say, are
printed once by Hugging Face, not a second time with our prefix), and their INFO chatter stays quiet.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

_MARK = "_rloo_cli_handler"


class _StdoutHandler(logging.StreamHandler):
    """Writes to ``sys.stdout`` as it is when a record comes, not as it was when the handler was made: a
    redirected stdout (a notebook cell, pytest's capture of one test) may be closed by the next call."""

    def __init__(self) -> None:
        super().__init__(sys.stdout)

    @property
    def stream(self) -> Any:
        return sys.stdout

    @stream.setter
    def stream(self, value: Any) -> None:  # StreamHandler.__init__ and setStream assign it
        pass


def setup_logging() -> None:
    """Idempotent: a second call (a notebook, the tests) adds no second handler."""
    logger = logging.getLogger("rloo")
    logger.setLevel(logging.INFO)
    if not any(getattr(h, _MARK, False) for h in logger.handlers):
        handler = _StdoutHandler()
        handler.setFormatter(logging.Formatter("[rloo] %(message)s"))
        setattr(handler, _MARK, True)
        logger.addHandler(handler)
    # transformers' per-file "Loading weights" bars are noise next to the training progress bar
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
