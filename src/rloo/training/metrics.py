"""One metrics interface for the trainer: JSON lines on disk, a progress bar, sample-generation tables.

Nothing is written until :meth:`MetricsLogger.open` is called, which the trainer does only after its first
update succeeded: a run that fails on bad input leaves ``output_dir`` as it was.
"""

from __future__ import annotations

import io
import json
import math
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

SAMPLES_DIR = "samples"
METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"


def _jsonable(v: Any) -> Any:
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None  # JSON has no NaN; null says "not measured"
    return v


class MetricsLogger:
    """Appends one JSON object per logged update to ``<output_dir>/metrics.jsonl``."""

    def __init__(
        self, *, total_updates: int, show_progress: bool = True, console: Console | None = None
    ) -> None:
        self.output_dir: Path | None = None
        self._pending: list[str] = []
        self._pending_samples: list[tuple[int, list[dict[str, Any]]]] = []
        self.console = console or Console(stderr=True)
        self.history: list[dict[str, Any]] = []
        self._bar = None
        if show_progress:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total_updates, unit="update", dynamic_ncols=True, desc="rloo")

    def open(self, output_dir: str | Path, *, keep_until_update: int | None = None) -> None:
        """Start writing. Resuming (``keep_until_update``) keeps the lines of updates up to the checkpoint
        and drops later ones, which the resumed run logs again."""
        self.output_dir = Path(output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        kept = ""
        path = self.output_dir / METRICS_FILE
        if keep_until_update is not None and path.is_file():
            for line in path.read_text().splitlines(keepends=True):
                try:
                    if json.loads(line).get("update", 0) <= keep_until_update:
                        kept += line
                except ValueError:
                    break  # a line cut by a kill: nothing after it can be trusted
        path.write_text(kept + "".join(self._pending))
        self._pending.clear()
        for step, rows in self._pending_samples:
            self._write_samples(step, rows)
        self._pending_samples.clear()

    def log(self, metrics: dict[str, Any]) -> None:
        record = {k: _jsonable(v) for k, v in metrics.items()}
        record.setdefault("timestamp", time.time())
        self.history.append(record)
        line = json.dumps(record) + "\n"
        if self.output_dir is None:
            self._pending.append(line)
        else:
            with open(self.output_dir / METRICS_FILE, "a") as f:
                f.write(line)

    def progress(self, n: int = 1, **postfix: float) -> None:
        if self._bar is not None:
            self._bar.update(n)
            if postfix:
                self._bar.set_postfix({k: f"{v:.4g}" for k, v in postfix.items()}, refresh=False)

    def samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        """Print a query / model response / score table and keep it as a file."""
        self.console.print(render_samples_table(step, rows))
        if self.output_dir is None:
            self._pending_samples.append((step, rows))
        else:
            self._write_samples(step, rows)

    def _write_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        assert self.output_dir is not None
        d = self.output_dir / SAMPLES_DIR
        d.mkdir(exist_ok=True)
        buf = io.StringIO()
        Console(file=buf, width=120, color_system=None).print(render_samples_table(step, rows))
        (d / f"update_{step:06d}.txt").write_text(buf.getvalue())
        with open(self.output_dir / SAMPLES_FILE, "a") as f:
            for row in rows:
                f.write(json.dumps({"update": step, **{k: _jsonable(v) for k, v in row.items()}}) + "\n")

    def close(self, status: str = "FINISHED") -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def render_samples_table(step: int, rows: list[dict[str, Any]]) -> Table:
    table = Table(title=f"sample generations at update {step}", show_lines=True)
    table.add_column("query", ratio=2)
    table.add_column("model response", ratio=2)
    table.add_column("score", justify="right")
    for row in rows:
        score = row.get("score")
        table.add_row(str(row["query"]), str(row["response"]), "None" if score is None else f"{score:.4f}")
    return table
