"""What a local pipeline run prints: one line as each step starts and ends, the logs in files.

``kfp.local`` writes everything on this process's ``sys.stdout`` (its own messages, the executor input and
output JSON of every task, each step's whole log): about 700 lines for the demo. :class:`StepConsole`
stands in for stdout while the pipeline runs: every line goes to ``<log_dir>/pipeline.log`` and to the
log of the step it belongs to (``<log_dir>/<task>.log``); the terminal gets the steps' progress, or
everything with ``verbose``. The tail it keeps feeds :func:`rloo.pipeline.failure.run_failure`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from rloo.pipeline.failure import plain

_KEEP_CHARS = 1_000_000  # of the run's output: plenty for the failed step's last lines
_START = re.compile(r"Executing task '([^']+)'")
_END = re.compile(r"Task '([^']+)' finished with status (\w+)")
# kfp.local names a run '<pipeline>-<time>' (kfp/local/executor_input_utils.py,
# get_local_pipeline_resource_name) and says it nowhere but in each task's executor input, which the task
# prints: the file of its outputs, '<pipeline_root>/<run>/<task>/executor_output.json'
# (a JSON string: a non-ASCII path comes escaped)
_OUTPUT_FILE = re.compile(r'"outputFile":\s*("(?:[^"\\]|\\.)*")')


class StepConsole:
    """A stdout for the duration of a local run (see the module docstring)."""

    def __init__(self, target: IO[str], log_dir: Path, *, verbose: bool = False) -> None:
        self.target, self.log_dir, self.verbose = target, log_dir, verbose
        log_dir.mkdir(parents=True, exist_ok=True)
        self._all = open(log_dir / "pipeline.log", "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self._step: IO[str] | None = None
        self._started: dict[str, float] = {}
        self._partial = ""
        self._tail: list[str] = []
        self._size = 0
        self.failed_logs: dict[str, Path] = {}
        self.run_dirs: set[Path] = set()  # the directories of step outputs this run's tasks named

    # the file API print() and logging.StreamHandler use
    def write(self, text: str) -> int:
        self._tail.append(text)
        self._size += len(text)
        while self._size > _KEEP_CHARS and len(self._tail) > 1:
            self._size -= len(self._tail.pop(0))
        if self.verbose:
            self.target.write(text)
        lines = (self._partial + text).split("\n")
        self._partial = lines.pop()
        for line in lines:
            self._line(line + "\n")
        return len(text)

    def flush(self) -> None:
        self._all.flush()
        if self._step is not None:
            self._step.flush()
        self.target.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.target, name)

    @property
    def text(self) -> str:
        """The last ~1 MB written, for reading a failed step's reason."""
        return "".join(self._tail)

    def step_log(self, task: str) -> Path:
        return self.log_dir / f"{task}.log"

    def _line(self, line: str) -> None:
        clean = plain(line)
        self._all.write(clean)
        outputs = _OUTPUT_FILE.search(clean)
        if outputs:
            with contextlib.suppress(ValueError):
                self.run_dirs.add(Path(json.loads(outputs.group(1))).parent.parent)
        start = _START.search(clean)
        if start:
            task = start.group(1)
            if self._step is not None:
                self._step.close()
            self._step = open(self.step_log(task), "a", encoding="utf-8")  # noqa: SIM115
            self._started[task] = time.monotonic()
            self._say(f"  {task} ...")
        if self._step is not None:
            self._step.write(clean)
        end = _END.search(clean)
        if end:
            task, status = end.groups()
            took = time.monotonic() - self._started.get(task, time.monotonic())
            if status == "SUCCESS":
                self._say(f"  {task} done in {took:.0f}s")
            else:
                self.failed_logs[task] = self.step_log(task)
                verb = "failed" if status == "FAILURE" else status.lower()
                self._say(f"  {task} {verb} after {took:.0f}s (log: {self.step_log(task)})")
            if self._step is not None:
                self._step.close()
                self._step = None

    def _say(self, message: str) -> None:
        if not self.verbose:
            self.target.write(message + "\n")
            self.target.flush()

    def close(self) -> None:
        if self._partial:
            self._line(self._partial + "\n")
            self._partial = ""
        if self._step is not None:
            self._step.close()
        self._all.close()


@contextmanager
def step_console(log_dir: Path, *, verbose: bool = False) -> Iterator[StepConsole]:
    """Route ``sys.stdout`` through a :class:`StepConsole` while the block runs."""
    saved = sys.stdout
    console = StepConsole(saved, log_dir, verbose=verbose)
    sys.stdout = console
    # kfp.local also logs through the root logger ("Skipping conditional task ..."), whose handler may hold
    # the real stdout (the CLI's): those lines belong in the log too.
    moved = [
        h
        for h in logging.getLogger().handlers
        if isinstance(h, logging.StreamHandler) and getattr(h, "stream", None) is saved
    ]
    for h in moved:
        h.setStream(console)
    try:
        yield console
    finally:
        for h in moved:
            h.setStream(saved)
        sys.stdout = saved
        console.close()
