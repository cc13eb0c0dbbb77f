"""The CLI's progress lines: on the stdout of the moment, once, with the [rloo] prefix."""

from __future__ import annotations

import io
import logging

import pytest

from rloo.cli.output import setup_logging


def test_progress_follows_a_redirected_stdout(monkeypatch: pytest.MonkeyPatch) -> None:
    """A handler bound to the stdout of its first call wrote into a closed stream once that stdout was gone
    (a notebook cell, one test's capture), and printed 'Logging error' tracebacks for every line."""
    first, second = io.StringIO(), io.StringIO()
    monkeypatch.setattr("sys.stdout", first)
    setup_logging()
    logging.getLogger("rloo.test").info("one")
    first.close()
    monkeypatch.setattr("sys.stdout", second)
    setup_logging()  # idempotent: still one handler
    logging.getLogger("rloo.test").info("two")
    assert second.getvalue() == "[rloo] two\n"
