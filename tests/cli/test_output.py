"""The CLI's progress lines: on the stdout of the moment, once, with the [rloo] prefix."""

from __future__ import annotations

import io
import logging
from pathlib import Path

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


def test_version_and_a_bare_pipeline_command(capsys: pytest.CaptureFixture[str]) -> None:
    from importlib.metadata import version

    from rloo.cli import main

    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"rloo {version('rloo-kfp')}\n"
    assert main(["pipeline"]) == 2  # no action: say which there are, in one line
    err = capsys.readouterr().err
    assert err == (
        "rloo pipeline: error: choose an action: compile, run, upload, submit, manifest "
        "(see 'rloo pipeline --help').\n"
    )
    from rloo.cli.pipeline_cmd import ACTIONS, build_parser

    parser = build_parser()
    (sub,) = [a for a in parser._actions if a.dest == "action"]
    assert tuple(sub.choices or ()) == ACTIONS


def test_an_error_line_reaches_stderr_in_one_write(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Every rank of a torchrun job writes to one stderr: a line written apart from its newline ran into the
    next rank's line (seen in CI: '...another --output_dir.rloo train: error: ...')."""

    class Writes(io.StringIO):
        def __init__(self) -> None:
            super().__init__()
            self.calls: list[str] = []

        def write(self, s: str) -> int:
            self.calls.append(s)
            return super().write(s)

    from rloo.cli import main

    err = Writes()
    monkeypatch.setattr("sys.stderr", err)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    # a missing config file: a UserError raised inside the command, printed by main
    assert main(["train", "--config", str(tmp_path / "missing.yaml")]) != 0
    errors = [c for c in err.calls if "rloo train: error:" in c]
    assert len(errors) == 1 and errors[0].endswith("\n"), err.calls
