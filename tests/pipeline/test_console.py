"""What a local run prints: a line per step start and end, each step's log in its own file."""

from __future__ import annotations

import io
import logging
import sys
from pathlib import Path

from rloo.pipeline.console import step_console
from rloo.pipeline.failure import plain

# what kfp.local prints around a step (colours included), as it prints it: in pieces, not whole lines
KFP_LINES = [
    "12:00:00.000 - INFO - Executing task \x1b[96m'train-rloo'\x1b[0m\n",
    "    [KFP Executor] Got executor_input: {...}\n",
    "    training upd",
    "ate 1/3\n",
    "12:00:05.000 - INFO - Task \x1b[96m'train-rloo'\x1b[0m finished with status \x1b[92mSUCCESS\x1b[0m\n",
    "12:00:05.100 - INFO - Executing task 'evaluate'\n",
    "    Traceback ...\n    RuntimeError: judge said no\n",
    "12:00:06.000 - ERROR - Task 'evaluate' finished with status FAILURE\n",
]


def _run(tmp_path: Path, verbose: bool) -> tuple[str, Path]:
    out = io.StringIO()
    saved = sys.stdout
    sys.stdout = out
    try:
        with step_console(tmp_path / "logs", verbose=verbose) as console:
            for piece in KFP_LINES:
                print(piece, end="")
        assert "RuntimeError: judge said no" in console.text
    finally:
        sys.stdout = saved
    return out.getvalue(), tmp_path / "logs"


def test_terminal_gets_progress_and_files_get_everything(tmp_path: Path) -> None:
    shown, logs = _run(tmp_path, verbose=False)
    assert shown.splitlines() == [
        "  train-rloo ...",
        "  train-rloo done in 0s",
        "  evaluate ...",
        f"  evaluate failed after 0s (log: {logs / 'evaluate.log'})",
    ]
    train = (logs / "train-rloo.log").read_text()
    assert "training update 1/3" in train and "judge said no" not in train and "\x1b[" not in train
    assert "RuntimeError: judge said no" in (logs / "evaluate.log").read_text()
    assert (logs / "pipeline.log").read_text() == plain("".join(KFP_LINES))  # all of it, colours removed


def test_verbose_prints_everything_as_it_came(tmp_path: Path) -> None:
    shown, logs = _run(tmp_path, verbose=True)
    assert shown == "".join(KFP_LINES)
    assert (logs / "train-rloo.log").is_file()


def test_root_logger_lines_go_to_the_log_not_the_terminal(tmp_path: Path) -> None:
    out = io.StringIO()
    saved = sys.stdout
    sys.stdout = out
    handler = logging.StreamHandler(out)
    root = logging.getLogger()
    root.addHandler(handler)
    level = root.level
    root.setLevel(logging.INFO)
    try:
        with step_console(tmp_path / "logs"):
            logging.info("Skipping conditional task condition-4")
        logging.info("after the run")
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
        sys.stdout = saved
    assert out.getvalue() == "after the run\n"
    assert "Skipping conditional task" in (tmp_path / "logs" / "pipeline.log").read_text()


def test_summary_shows_the_comparison_with_the_champion(tmp_path: Path) -> None:
    """A challenger's push: the summary says how it did against the champion, from push_result.json."""
    import json

    from rloo.pipeline.local import LocalResult, summary

    model = tmp_path / "store" / "run1" / "model"
    (model.parent / "push").mkdir(parents=True)
    vs = {"champion": "version 1 (run r0)", "estimate": -0.25, "ci95": [-0.375, -0.125]}
    pushed = {"decision": "candidate", "against_champion": vs, "storage": {"uri": "file:///s/published/run1"}}
    (model.parent / "push" / "push_result.json").write_text(json.dumps(pushed))
    result = LocalResult(
        "r",
        tmp_path / "kfp",
        {
            "train-rloo": {"parameterValues": {"Output": str(model)}},
            "push-model": {"parameterValues": {"Output": "candidate"}},
        },
    )
    text = "\n".join(summary(result))
    assert "push decision:   candidate" in text
    assert "vs champion:     -0.250 [-0.375, -0.125] against version 1 (run r0)" in text
    assert "published:       /s/published/run1" in text
