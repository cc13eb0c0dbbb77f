"""The sink protocol the metrics logger fans out to, and the JSON-lines sink (``metrics.jsonl``)."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

Status = Literal["FINISHED", "FAILED", "KILLED"]
METRICS_FILE = "metrics.jsonl"


@runtime_checkable
class Sink(Protocol):
    """Where metrics, params and artifacts go. Implementations must not raise from the log methods for
    outages (buffer and retry instead), and must write nothing before :meth:`open`."""

    def open(self, output_dir: Path) -> None:
        """Called once, when the run's output is to be kept (after the first successful update)."""

    def log_params(self, params: Mapping[str, Any]) -> None: ...

    def log_metrics(
        self, metrics: Mapping[str, Any], step: int, *, timestamp: float | None = None
    ) -> None: ...

    def log_artifact(self, local_path: str | Path, artifact_path: str | None = None) -> None: ...

    def log_text(self, text: str, artifact_file: str) -> None: ...

    def finish(self, status: Status = "FINISHED") -> None: ...


def jsonable(v: Any) -> Any:
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None  # JSON has no NaN; null says "not measured"
    return v


class JsonlSink:
    """Appends one JSON object per logged step to ``<output_dir>/metrics.jsonl``.

    ``open(..., keep_until=N)`` is for resuming: lines whose ``step_key`` is <= N are kept (unreadable lines,
    e.g. one cut short by a crash, are dropped), later ones are removed because they will be logged again.
    """

    def __init__(self, filename: str = METRICS_FILE, *, step_key: str = "update") -> None:
        self.filename = filename
        self.step_key = step_key
        self.path: Path | None = None

    def open(self, output_dir: Path, *, keep_until: int | None = None) -> list[dict[str, Any]]:
        """Create (or, resuming, trim) the file; returns the kept records."""
        output_dir = Path(output_dir)
        output_dir.mkdir(parents=True, exist_ok=True)
        self.path = output_dir / self.filename
        kept = read_jsonl(self.path, self.step_key, keep_until) if keep_until is not None else []
        tmp = self.path.with_name(f".{self.filename}.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
        os.replace(tmp, self.path)  # a crash while trimming leaves the old file or the new one, never half
        return kept

    def write(self, record: Mapping[str, Any]) -> None:
        assert self.path is not None, "open() first"
        with open(self.path, "a") as f:
            f.write(json.dumps({k: jsonable(v) for k, v in record.items()}) + "\n")

    # Sink protocol --------------------------------------------------------------------------------------
    def log_params(self, params: Mapping[str, Any]) -> None:
        pass  # the config is saved with the model (rloo_config.json)

    def log_metrics(self, metrics: Mapping[str, Any], step: int, *, timestamp: float | None = None) -> None:
        self.write({self.step_key: step, **metrics, **({"timestamp": timestamp} if timestamp else {})})

    def log_artifact(self, local_path: str | Path, artifact_path: str | None = None) -> None:
        pass  # artifacts are files in output_dir already

    def log_text(self, text: str, artifact_file: str) -> None:
        pass

    def finish(self, status: Status = "FINISHED") -> None:
        pass


def read_jsonl(path: Path, step_key: str, keep_until: int | None) -> list[dict[str, Any]]:
    """Readable records of ``path`` with ``step_key`` <= ``keep_until`` (all readable ones if None)."""
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if not isinstance(rec, dict):
            continue
        step = rec.get(step_key)
        if keep_until is None or (isinstance(step, (int, float)) and step <= keep_until):
            out.append(rec)
    return out
