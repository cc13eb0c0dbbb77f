"""An MLflow sink that never blocks or kills training.

Every call only appends to an in-memory buffer; one background thread creates the run (lazily: nothing is
written before the first item), sends the buffer in batches, and on failure keeps the items and retries
with exponential backoff. The buffer is bounded: past ``max_buffered_metrics`` values the oldest metric
batches are dropped (counted and reported), never params, artifacts or the final status. ``finish`` waits up
to ``flush_timeout`` seconds for the buffer to drain, then marks the run FINISHED or FAILED; when the server
is already unreachable at that point it waits only ``outage_flush_timeout`` seconds and says in one line
what was not sent. The run then stays RUNNING until the next stage of the pipeline run, the pipeline's exit
handler or the next run on the same output directory reaches the server and closes it (see
:func:`rloo.tracking.lifecycle.start_stage_run`); the status it should get is left in ``UNCLOSED_FILE``.
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rloo.storage.redact import redact
from rloo.tracking.base import Status
from rloo.tracking.datasets import dataset_input
from rloo.tracking.descriptions import describe_pipeline_run, describe_training_run
from rloo.tracking.lifecycle import UNCLOSED_FILE, StageRun, pipeline_run_from_env, start_stage_run
from rloo.tracking.params import flatten_params, sanitize_key, split_locations
from rloo.tracking.server import configure_mlflow_http, resolve_tracking_uri
from rloo.tracking.summary import PARENT_CURVES
from rloo.tracking.system import SystemMetricsSampler
from rloo.tracking.tags import TAG_LOCATION_PREFIX, TAG_OUTPUT_DIR, TRAIN_STAGE

log = logging.getLogger(__name__)

_MAX_METRICS_PER_BATCH = 1000
_MAX_PARAMS_PER_BATCH = 100
# Errors that retrying cannot fix: the request itself is wrong (or not allowed). Everything else (connection
# refused, timeouts, 5xx, proxies answering HTML) is treated as an outage and retried.
_PERMANENT_CODES = {
    "INVALID_PARAMETER_VALUE",
    "RESOURCE_DOES_NOT_EXIST",
    "RESOURCE_ALREADY_EXISTS",
    "INVALID_STATE",
    "BAD_REQUEST",
    "MALFORMED_REQUEST",
    "PERMISSION_DENIED",
    "UNAUTHENTICATED",
    "ENDPOINT_NOT_FOUND",
}


@dataclass
class _Op:
    kind: str  # metrics | params | tags | artifact | text | dataset | describe | finish
    items: list[Any]
    extra: Any = None


def _is_permanent(exc: BaseException) -> bool:
    try:
        from mlflow.exceptions import MlflowException
    except ImportError:
        return True
    if isinstance(exc, MlflowException):
        return exc.error_code in _PERMANENT_CODES
    return isinstance(exc, (FileNotFoundError, IsADirectoryError, TypeError, ValueError))


class MlflowSink:
    """Logs one stage's run to MLflow (HTTP server or the embedded sqlite store).

    Pass ``run_id`` to log into an existing run; otherwise the stage run (and its pipeline parent, see
    :func:`rloo.tracking.lifecycle.start_stage_run`) is created when the first item is sent. ``tracking_uri=None``
    means ``MLFLOW_TRACKING_URI``, else the embedded store under the directory given to :meth:`open`.
    ``end_parent_on_success``: a FINISHED status also finishes the parent (the pipeline's last stage); a
    FAILED or KILLED stage always ends the parent with the same status.
    """

    def __init__(
        self,
        *,
        tracking_uri: str | None = None,
        stage: str = "train",
        experiment: str | None = None,
        run_name: str | None = None,
        run_id: str | None = None,
        parent_run_id: str | None = None,
        pipeline_run_id: str | None = None,
        pipeline_run_name: str | None = None,
        tags: Mapping[str, str] | None = None,
        end_parent_on_success: bool = False,
        system_metrics_interval: float | None = 10.0,
        max_buffered_metrics: int = 100_000,
        flush_timeout: float = 60.0,
        outage_flush_timeout: float = 10.0,
        retry_initial: float = 1.0,
        retry_max: float = 30.0,
    ) -> None:
        self.tracking_uri = tracking_uri
        self.stage = stage
        self.experiment = experiment
        self.run_name = run_name
        self.run_id = run_id
        self.parent_run_id = parent_run_id
        self.pipeline_run_id = pipeline_run_id
        self.pipeline_run_name = pipeline_run_name
        self.tags = dict(tags or {})
        self.end_parent_on_success = end_parent_on_success
        self.system_metrics_interval = system_metrics_interval
        self.max_buffered_metrics = max_buffered_metrics
        self.flush_timeout = flush_timeout
        self.outage_flush_timeout = outage_flush_timeout
        self.retry_initial = retry_initial
        self.retry_max = retry_max

        self.dropped_metrics = 0
        self.failed_items = 0
        self.last_error: str | None = None
        self.stage_run: StageRun | None = None
        self._ops: deque[_Op] = deque()
        self._inflight: list[_Op] = []
        self._n_buffered = 0
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._sampler: SystemMetricsSampler | None = None
        self._client: Any = None
        self._resolved_uri: str | None = None
        self._artifact_location: str | None = None
        self._work_dir: Path | None = None
        self._opened_ms: int | None = None
        self._outage = False
        self._abandon = False
        self._finished = False
        self._disabled = False
        self._warned_drop = False
        self._dataset_logged = False
        self._mirror_refused = False

    # ------------------------------------------------------------------------------------------------
    @property
    def resolved_tracking_uri(self) -> str | None:
        return self._resolved_uri

    @property
    def pending(self) -> int:
        """Items not yet acknowledged by MLflow (buffered or in flight)."""
        with self._cond:
            return sum(len(op.items) for op in self._ops) + sum(len(op.items) for op in self._inflight)

    def open(self, output_dir: Path) -> None:
        # The run is created by the worker when it first sends something, maybe seconds later (a sqlite
        # store's first use, a slow server): it starts when the stage opened it, all the same.
        self._opened_ms = int(time.time() * 1000)
        self._work_dir = Path(output_dir)
        self.tags.setdefault(TAG_OUTPUT_DIR, str(self._work_dir.resolve()))
        self._start()

    def _start(self) -> None:
        if self._thread is not None or self._finished:
            return
        configure_mlflow_http()
        self._resolved_uri, self._artifact_location = resolve_tracking_uri(self.tracking_uri, self._work_dir)
        self._thread = threading.Thread(target=self._worker, name="rloo-mlflow-sink", daemon=True)
        self._thread.start()
        if self.system_metrics_interval:
            interval = float(
                os.environ.get("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL") or self.system_metrics_interval
            )
            self._sampler = SystemMetricsSampler(lambda m, step: self.log_metrics(m, step), interval)
            self._sampler.start()
        # A process that exits without finish() (an exception escaping the caller) leaves a FAILED run,
        # not a RUNNING one.
        ref = weakref.ref(self)

        def finish_if_alive() -> None:
            sink = ref()
            if sink is not None:
                sink.finish("FAILED")

        atexit.register(finish_if_alive)

    def _enqueue(self, op: _Op) -> None:
        if self._finished or self._disabled:
            return
        self._start()
        with self._cond:
            self._ops.append(op)
            if op.kind == "metrics":
                self._n_buffered += len(op.items)
                while self._n_buffered > self.max_buffered_metrics and self._drop_oldest_metrics():
                    pass
            self._cond.notify()

    def _drop_oldest_metrics(self) -> bool:
        for i, op in enumerate(self._ops):
            if op.kind == "metrics":
                del self._ops[i]
                self._n_buffered -= len(op.items)
                self.dropped_metrics += len(op.items)
                if not self._warned_drop:
                    self._warned_drop = True
                    log.warning(
                        "MLflow buffer full (%d metric values): dropping the oldest; metrics.jsonl keeps them all",
                        self.max_buffered_metrics,
                    )
                return True
        return False

    # Sink protocol ----------------------------------------------------------------------------------
    def log_params(self, params: Mapping[str, Any]) -> None:
        """The stage's settings as params, its locations (outputs, per-run copies, endpoints:
        :func:`rloo.tracking.params.split_locations`) as ``rloo.location.*`` tags; the dataset they name
        (``dataset_name`` with ``dataset_train_split``: training, or ``dataset_split``: evaluation) as the
        run's dataset input too. A training stage's settings also name and describe its run, or its
        pipeline's parent run (:func:`rloo.tracking.descriptions.describe_pipeline_run`)."""
        from mlflow.entities import Param, RunTag

        pipeline_run_id = self.pipeline_run_id or pipeline_run_from_env()[0]
        settings, locations = split_locations(
            flatten_params(params), [pipeline_run_id] if pipeline_run_id else []
        )
        items = [Param(k, v) for k, v in settings.items()]
        for i in range(0, len(items), _MAX_PARAMS_PER_BATCH):
            self._enqueue(_Op("params", items[i : i + _MAX_PARAMS_PER_BATCH]))
        if locations:
            tags = [RunTag(TAG_LOCATION_PREFIX + k, v[:8000]) for k, v in locations.items()]
            self._enqueue(_Op("tags", tags))
        if self.stage == TRAIN_STAGE:
            self._enqueue(_Op("describe", [(settings, locations)]))
        dataset = None if self._dataset_logged else dataset_input(params)
        if dataset is not None:
            self._dataset_logged = True  # a resumed stage logs its params again, not its dataset
            self._enqueue(_Op("dataset", [dataset]))

    def log_metrics(self, metrics: Mapping[str, Any], step: int, *, timestamp: float | None = None) -> None:
        from mlflow.entities import Metric

        ts = int((timestamp or time.time()) * 1000)
        items = []
        for k, v in metrics.items():
            if hasattr(v, "item"):
                v = v.item()
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                continue
            items.append(Metric(sanitize_key(k), float(v), ts, int(step)))
        if items:
            self._enqueue(_Op("metrics", items))

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        from mlflow.entities import RunTag

        self._enqueue(_Op("tags", [RunTag(sanitize_key(k), redact(str(v))[:8000]) for k, v in tags.items()]))

    def log_artifact(self, local_path: str | Path, artifact_path: str | None = None) -> None:
        self._enqueue(_Op("artifact", [str(local_path)], artifact_path))

    def log_text(self, text: str, artifact_file: str) -> None:
        self._enqueue(_Op("text", [redact(text)], artifact_file))

    def flush(self, timeout: float = 60.0) -> bool:
        """Wait until everything logged so far is acknowledged by MLflow; False on timeout."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while (self._ops or self._inflight) and self._thread is not None and self._thread.is_alive():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.5))
            return not (self._ops or self._inflight)

    def finish(self, status: Status = "FINISHED") -> None:
        """Flush (up to ``flush_timeout`` s) and end the run with ``status``. Never raises."""
        if self._finished:
            return
        if self._thread is None:  # nothing was ever logged: there is no run to end
            self._finished = True
            return
        if self._sampler is not None:
            self._sampler.stop()
        with self._cond:
            self._ops.append(_Op("finish", [status]))
            self._finished = True
            self._cond.notify()
        # Already in an outage: a short, bounded wait (the server may be coming back), not a minute of
        # exit delay for a server that is gone.
        wait = min(self.flush_timeout, self.outage_flush_timeout) if self._outage else self.flush_timeout
        self._thread.join(wait)
        if self._thread.is_alive():
            with self._cond:
                self._abandon = True
                self._cond.notify()
                metrics = sum(len(op.items) for op in [*self._ops, *self._inflight] if op.kind == "metrics")
                others = sum(len(op.items) for op in [*self._ops, *self._inflight] if op.kind != "metrics")
            closer = (
                f"run {self.run_id} will be closed {status} by the next stage or rloo command that reaches it"
                if self.run_id
                else "no run was created"
            )
            log.warning(
                "MLflow server %s unreachable (%s): gave up after %.0fs, %d metrics and %d other items not "
                "sent; %s; metrics.jsonl in the output directory has every metric",
                redact(self._resolved_uri or "?"),
                self.last_error,
                wait,
                metrics,
                others - 1,  # the final status itself is not an item the user logged
                closer,
            )
            self._record_unclosed(status)

    def _record_unclosed(self, status: Status) -> None:
        """Leave the status this run should have next to its output, for whoever closes it later."""
        if self.run_id is None or self._work_dir is None:
            return
        import json

        try:
            self._work_dir.mkdir(parents=True, exist_ok=True)
            (self._work_dir / UNCLOSED_FILE).write_text(
                json.dumps({"run_id": self.run_id, "status": status, "parent_run_id": self.parent_run_id})
            )
        except OSError:
            pass  # best effort: without it the run is closed FAILED, as for a pod that died

    # Background worker ------------------------------------------------------------------------------
    def _take_batch(self) -> list[_Op]:
        first = self._ops.popleft()
        batch = [first]
        if first.kind in ("metrics", "params"):
            limit = _MAX_METRICS_PER_BATCH if first.kind == "metrics" else _MAX_PARAMS_PER_BATCH
            n = len(first.items)
            while self._ops and self._ops[0].kind == first.kind and n + len(self._ops[0].items) <= limit:
                op = self._ops.popleft()
                n += len(op.items)
                batch.append(op)
        if first.kind == "metrics":
            # The bound applies to what waits in the queue; the in-flight batch is counted again if it comes
            # back, and then, being the oldest, it is the first to go.
            self._n_buffered -= sum(len(op.items) for op in batch)
        return batch

    def _worker(self) -> None:
        backoff = self.retry_initial
        while True:
            with self._cond:
                while not self._ops and not self._abandon:
                    self._cond.wait()
                if self._abandon:
                    return
                batch = self._take_batch()
                self._inflight = batch
            try:
                self._ensure_run()
                done = self._execute(batch)
            except Exception as e:
                if _is_permanent(e):
                    if self.stage_run is None:
                        self._disable(e)
                        return
                    if self._on_permanent(batch, e):
                        return
                    continue
                self.last_error = redact(" ".join(str(e).split()))[:300]
                if not self._outage:
                    self._outage = True
                    log.warning(
                        "MLflow at %s unreachable (%s): buffering and retrying in the background; training "
                        "continues",
                        redact(self._resolved_uri or "?"),
                        self.last_error,
                    )
                with self._cond:
                    self._ops.extendleft(reversed(batch))
                    self._inflight = []
                    if batch[0].kind == "metrics":
                        self._n_buffered += sum(len(op.items) for op in batch)
                    # the batch that failed is the oldest data: it goes first if the buffer is over its bound
                    while self._n_buffered > self.max_buffered_metrics and self._drop_oldest_metrics():
                        pass
                    if not self._abandon:
                        self._cond.wait(backoff)
                backoff = min(backoff * 2, self.retry_max)
                continue
            with self._cond:
                self._inflight = []
                self._cond.notify_all()  # flush() waiters
            if self._outage:
                self._outage = False
                log.warning(
                    "MLflow at %s reachable again: sending buffered items", redact(self._resolved_uri or "?")
                )
            backoff = self.retry_initial
            if done:
                return

    def _on_permanent(self, batch: list[_Op], exc: BaseException) -> bool:
        """Drop what MLflow refuses (after splitting a batch to find the bad entry); True: stop the worker."""
        items = [(op, item) for op in batch for item in op.items]
        with self._cond:
            self._inflight = []
            if len(items) > 1 and batch[0].kind in ("metrics", "params", "tags"):
                # One bad entry (a conflicting param value on a resumed run...) must not sink the others.
                for op, item in reversed(items):
                    self._ops.appendleft(_Op(op.kind, [item], op.extra))
                    if op.kind == "metrics":
                        self._n_buffered += 1
                return False
        self.failed_items += len(items)
        self.last_error = redact(" ".join(str(exc).split()))[:300]
        log.warning("MLflow refused %s (%s): dropped", batch[0].kind, self.last_error)
        return batch[0].kind == "finish"

    def _disable(self, exc: BaseException) -> None:
        self.last_error = redact(" ".join(str(exc).split()))[:300]
        self._disabled = True
        with self._cond:
            self.failed_items += sum(len(op.items) for op in self._ops) + sum(
                len(op.items) for op in self._inflight
            )
            self._ops.clear()
            self._inflight = []
            self._n_buffered = 0
        log.warning(
            "cannot create the MLflow run at %s (%s): MLflow logging is off for this run; metrics.jsonl keeps "
            "every metric",
            redact(self._resolved_uri or "?"),
            self.last_error,
        )

    def _ensure_run(self) -> None:
        if self._client is None:
            from mlflow.tracking import MlflowClient

            if self._resolved_uri and self._resolved_uri.startswith("sqlite:///"):
                Path(self._resolved_uri[len("sqlite:///") :]).parent.mkdir(parents=True, exist_ok=True)
            self._client = MlflowClient(tracking_uri=self._resolved_uri)
        if self.stage_run is None:
            if self.run_id is not None:
                run = self._client.get_run(self.run_id)
                self.stage_run = StageRun(
                    self.run_id,
                    run.info.experiment_id,
                    run.data.tags.get("mlflow.parentRunId"),
                    self._resolved_uri or "",
                )
            else:
                self.stage_run = start_stage_run(
                    self.stage,
                    experiment=self.experiment,
                    client=self._client,
                    run_name=self.run_name,
                    parent_run_id=self.parent_run_id,
                    pipeline_run_id=self.pipeline_run_id,
                    pipeline_run_name=self.pipeline_run_name,
                    tags=self.tags,
                    artifact_location=self._artifact_location,
                    start_time_ms=self._opened_ms,
                )
            self.run_id = self.stage_run.run_id
            self.parent_run_id = self.stage_run.parent_run_id

    def _describe(self, settings: dict[str, str], locations: dict[str, str]) -> None:
        """Name and describe the training run, or its pipeline's parent run. A bug here must not hold up
        the queue (it would be retried as an outage): it costs the name, with a warning."""
        try:
            if self.parent_run_id:
                describe_pipeline_run(self._client, self.parent_run_id, train=(settings, locations))
            elif self.run_id:
                describe_training_run(
                    self._client, self.run_id, settings, locations, keep_name=self.run_name is not None
                )
        except (KeyError, AttributeError, IndexError, TypeError, ValueError) as e:
            log.warning("could not name the MLflow run after its settings: %s", e)

    def _mirror_curves(self, metrics: list[Any]) -> None:
        """A training stage's :data:`~rloo.tracking.summary.PARENT_CURVES` on its pipeline's parent run too,
        with their steps and times, so that the chart view overlays the pipeline runs' curves while they
        train. (Sent again after an outage, a point is stored once: MLflow keeps one row per key, step,
        time and value.) A parent that refuses them (deleted) costs the copy only, with a warning."""
        if self.stage != TRAIN_STAGE or not self.parent_run_id or self._mirror_refused:
            return
        curves = [m for m in metrics if m.key in PARENT_CURVES]
        if not curves:
            return
        try:
            self._client.log_batch(self.parent_run_id, metrics=curves)
        except Exception as e:
            if not _is_permanent(e):
                raise  # an outage: the batch is sent again
            self._mirror_refused = True
            log.warning(
                "MLflow refused the training curves on pipeline run %s (%s): they stay on the train run",
                self.parent_run_id,
                redact(" ".join(str(e).split()))[:300],
            )

    def _execute(self, batch: list[_Op]) -> bool:
        """Send one batch; True when it was the final status (the worker is done)."""
        client, run_id, kind = self._client, self.run_id, batch[0].kind
        items = [item for op in batch for item in op.items]
        if kind == "metrics":
            client.log_batch(run_id, metrics=items)
            self._mirror_curves(items)
        elif kind == "params":
            client.log_batch(run_id, params=items)
        elif kind == "tags":
            client.log_batch(run_id, tags=items)
        elif kind == "artifact":
            client.log_artifact(run_id, items[0], batch[0].extra)
        elif kind == "text":
            client.log_text(run_id, items[0], batch[0].extra)
        elif kind == "dataset":
            client.log_inputs(run_id, datasets=items)
        elif kind == "describe":
            self._describe(*items[0])
        elif kind == "finish":
            status = items[0]
            client.set_terminated(run_id, status=status)
            if self.parent_run_id and (status != "FINISHED" or self.end_parent_on_success):
                client.set_terminated(
                    self.parent_run_id, status=status
                )  # a failed/killed stage ends the pipeline
            return True
        return False
