"""One metrics interface for the trainer: metrics, params, sample tables and a progress bar, fanned out to
sinks (``metrics.jsonl`` always; MLflow and others through :mod:`rloo.tracking`).

Nothing is written until :meth:`MetricsLogger.open` is called, which the trainer does only after its first
update succeeded: a run that fails on bad input leaves ``output_dir`` (and MLflow) as it was. The trainer
does not know which sinks exist.
"""

from __future__ import annotations

import io
import json
import logging
import re
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from rloo.diskspace import DiskFullError, append_bytes, write_bytes_atomic
from rloo.tracking.base import METRICS_FILE, JsonlSink, Sink, Status, jsonable, read_jsonl
from rloo.tracking.samples import samples_html, samples_json

SAMPLES_DIR = "samples"
SAMPLES_FILE = "samples.jsonl"
PLOTS_DIR = "plots"
CURVES_FILE = "training_curves.png"
STEP_KEY = "update"
_SAMPLE_NAME = re.compile(r"^update_(\d+)\.(txt|html|json)$")

log = logging.getLogger(__name__)

_jsonable = jsonable  # kept for importers of the old private name


class MetricsLogger:
    """Fans each logged update out to ``<output_dir>/metrics.jsonl`` and to ``sinks``.

    ``sinks=None`` takes the default from the environment (:func:`rloo.tracking.sinks_from_env`: MLflow when
    ``MLFLOW_TRACKING_URI`` is set); pass ``[]`` for metrics.jsonl only. A sink that fails is reported and
    skipped; it never stops training. ``progress_start``: the update a resumed run starts from (the progress
    display starts there, and its rate counts only this run's updates).
    """

    def __init__(
        self,
        *,
        total_updates: int,
        show_progress: bool = True,
        console: Console | None = None,
        sinks: Sequence[Sink] | None = None,
        plots: bool = True,
        progress_start: int = 0,
    ) -> None:
        if sinks is None:
            from rloo.tracking import sinks_from_env

            sinks = sinks_from_env()
        self.sinks: list[Sink] = list(sinks)
        self.output_dir: Path | None = None
        self.console = console or Console(stderr=True)
        self.history: list[dict[str, Any]] = []
        self.plots = plots
        self._jsonl = JsonlSink(METRICS_FILE, step_key=STEP_KEY)
        self._pending: list[dict[str, Any]] = []
        self._pending_params: list[dict[str, Any]] = []
        self._pending_samples: list[tuple[int, list[dict[str, Any]]]] = []
        self._closed = False
        self._plotted = False
        self._bar: Any = None
        if show_progress:  # a bar on a terminal; plain lines now and then in a step's log or a pipe
            from rloo.storage.progress import progress_bar

            self._bar = progress_bar(total_updates, "rloo", "update", initial=progress_start)

    # ------------------------------------------------------------------------------------------------
    def open(self, output_dir: str | Path, *, keep_until_update: int | None = None) -> None:
        """Start writing. Resuming (``keep_until_update=N``): metrics.jsonl and samples keep what was logged
        up to update N and drop later entries, which the resumed run logs again; kept history is replayed to
        the other sinks so a new MLflow run has the whole curve."""
        self.output_dir = Path(output_dir)
        kept = self._jsonl.open(self.output_dir, keep_until=keep_until_update)
        kept_samples = self._trim_samples(keep_until_update) if keep_until_update is not None else []
        self.history = kept + self.history
        for sink in list(self.sinks):
            self._call(sink, "open", self.output_dir)
        for record in kept:
            self._fan_metrics(record, include_jsonl=False)
        for path in kept_samples:
            self._fan("log_artifact", path, SAMPLES_DIR)
        for params in self._pending_params:
            self._fan("log_params", params)
        for record in self._pending:
            self._fan_metrics(record)
        for step, rows in self._pending_samples:
            self._write_samples(step, rows)
        self._pending.clear()
        self._pending_params.clear()
        self._pending_samples.clear()

    def log(self, metrics: dict[str, Any]) -> None:
        record = {k: jsonable(v) for k, v in metrics.items()}
        record.setdefault("timestamp", time.time())
        self.history.append(record)
        if self.output_dir is None:
            self._pending.append(record)
        else:
            self._fan_metrics(record)

    def log_params(self, params: Mapping[str, Any]) -> None:
        """The run's configuration (flattened and redacted by the sinks that record it)."""
        if self.output_dir is None:
            self._pending_params.append(dict(params))
        else:
            self._fan("log_params", dict(params))

    def progress(self, n: int = 1, **postfix: float) -> None:
        if self._bar is not None:
            if postfix:  # first: the update's redraw (or line) shows this update's numbers
                self._bar.set_postfix({k: f"{v:.4g}" for k, v in postfix.items()}, refresh=False)
            self._bar.update(n)

    def samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        """Print a query / model response / score table and keep it as text, HTML and JSON files."""
        self.console.print(render_samples_table(step, rows))
        if self.output_dir is None:
            self._pending_samples.append((step, rows))
        else:
            self._write_samples(step, rows)

    def write_plots(self) -> None:
        """Draw the training curves (PNG under ``plots/``) and send them to every sink, once; ``close`` calls
        it too. Call it earlier when the files must exist before the run ends (e.g. to upload them)."""
        if self._plotted or self.output_dir is None or not self.plots or not self.history:
            return
        self._plotted = True
        try:
            from rloo.tracking.plots import plot_training_curves

            png = plot_training_curves(
                self.history, self.output_dir / PLOTS_DIR / CURVES_FILE, x_key=STEP_KEY
            )
            if png is not None:
                self._fan("log_artifact", png, PLOTS_DIR)
        except DiskFullError:
            raise  # the output disk is full: the run cannot be called a success
        except Exception as e:  # a missing matplotlib or a plotting bug must not mask the run's result
            log.warning("training-curve plot skipped: %s", e)

    def close(self, status: Status = "FINISHED") -> None:
        """End the run: training curves (PNG) to every sink, then each sink finishes with ``status``
        ("FINISHED", or "FAILED" when the stage failed). Idempotent; never raises for a sink."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._closed:
            return
        self._closed = True
        try:
            self.write_plots()
        except DiskFullError as e:  # closing a run that failed: its own error is the one to report
            log.warning("%s", e)
        if self.output_dir is not None:
            self._fan("finish", status)
        else:
            for sink in self.sinks:  # never opened: sinks have nothing to end, but may hold threads
                self._call(sink, "finish", status)

    # ------------------------------------------------------------------------------------------------
    def _fan_metrics(self, record: dict[str, Any], *, include_jsonl: bool = True) -> None:
        if include_jsonl:
            self._jsonl.write(record)  # the primary record: a disk error here should surface
        step = record.get(STEP_KEY)
        step = int(step) if isinstance(step, (int, float)) else len(self.history)
        metrics = {k: v for k, v in record.items() if k not in (STEP_KEY, "timestamp")}
        self._fan("log_metrics", metrics, step, timestamp=record.get("timestamp"))

    def _fan(self, method: str, *args: Any, **kwargs: Any) -> None:
        for sink in list(self.sinks):
            self._call(sink, method, *args, **kwargs)

    def _call(self, sink: Sink, method: str, *args: Any, **kwargs: Any) -> None:
        fn = getattr(sink, method, None)
        if fn is None and method == "open":
            return  # open() is optional for sinks that need no setup
        try:
            fn(*args, **kwargs)  # type: ignore[misc]
        except Exception as e:
            log.warning("%s.%s failed (%s): this sink is skipped from now on", type(sink).__name__, method, e)
            if sink in self.sinks:
                self.sinks.remove(sink)

    def _write_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        assert self.output_dir is not None
        d = self.output_dir / SAMPLES_DIR
        d.mkdir(exist_ok=True)
        buf = io.StringIO()
        Console(file=buf, width=120, color_system=None).print(render_samples_table(step, rows))
        # each file whole or absent, and a full disk one line (no 0-byte update_N.html, no half a JSON line)
        what = f"the samples of update {step}"
        write_bytes_atomic(d / f"update_{step:06d}.txt", buf.getvalue().encode(), what)
        html_path = d / f"update_{step:06d}.html"
        json_path = d / f"update_{step:06d}.json"
        write_bytes_atomic(html_path, samples_html(step, rows).encode(), what)
        write_bytes_atomic(json_path, samples_json(step, rows).encode(), what)
        lines = "".join(
            json.dumps({"update": step, **{k: jsonable(v) for k, v in row.items()}}) + "\n" for row in rows
        )
        append_bytes(self.output_dir / SAMPLES_FILE, lines.encode(), what)
        self._fan("log_artifact", html_path, SAMPLES_DIR)
        self._fan("log_artifact", json_path, SAMPLES_DIR)

    def _trim_samples(self, keep_until: int) -> list[Path]:
        """Drop sample tables logged after ``keep_until``; returns the kept HTML/JSON files."""
        assert self.output_dir is not None
        path = self.output_dir / SAMPLES_FILE
        if path.exists():
            kept = read_jsonl(path, STEP_KEY, keep_until)
            tmp = path.with_name(f".{SAMPLES_FILE}.tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
            tmp.replace(path)
        out = []
        d = self.output_dir / SAMPLES_DIR
        for f in sorted(d.iterdir()) if d.is_dir() else []:
            m = _SAMPLE_NAME.match(f.name)
            if not m:
                continue
            if int(m.group(1)) > keep_until:
                f.unlink()
            elif m.group(2) in ("html", "json"):
                out.append(f)
        return out


def render_samples_table(step: int, rows: list[dict[str, Any]]) -> Table:
    table = Table(title=f"sample generations at update {step}", show_lines=True)
    table.add_column("query", ratio=2)
    table.add_column("model response", ratio=2)
    table.add_column("score", justify="right")
    for row in rows:
        score = row.get("score")
        table.add_row(str(row["query"]), str(row["response"]), "None" if score is None else f"{score:.4f}")
    return table
