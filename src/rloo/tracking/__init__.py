"""Where metrics go: ``metrics.jsonl`` always, MLflow when asked (a tracking server or the embedded store).

The trainer talks to :class:`rloo.training.metrics.MetricsLogger` only; the logger fans out to sinks
(:class:`Sink`). :func:`sinks_from_env` builds the default set: MLflow when ``MLFLOW_TRACKING_URI`` is set
(or ``report_to="mlflow"``, which without a URI uses a sqlite store under the output directory).
"""

from __future__ import annotations

import os
import signal
from typing import Any

from rloo.errors import UserError
from rloo.tracking.base import METRICS_FILE, JsonlSink, Sink, Status
from rloo.tracking.lifecycle import (
    KFP_RUN_ID_ENV,
    KFP_RUN_NAME_ENV,
    StageRun,
    finish_pipeline_run,
    pipeline_run_from_env,
    start_stage_run,
)
from rloo.tracking.mlflow_sink import MlflowSink
from rloo.tracking.params import flatten_params
from rloo.tracking.plots import MAIN_CURVES, plot_training_curves
from rloo.tracking.server import check_tracking_server, resolve_tracking_uri

REPORT_TO_ENV = "RLOO_REPORT_TO"


def sinks_from_env(
    report_to: str | None = None, *, stage: str = "train", preflight: bool = True, **mlflow_kwargs: Any
) -> list[Sink]:
    """The sinks besides metrics.jsonl. ``report_to``: ``"mlflow"``, ``"none"``, or None for the default
    (``RLOO_REPORT_TO``, else MLflow exactly when ``MLFLOW_TRACKING_URI`` is set).

    With ``preflight`` an unreachable tracking server is a one-line UserError now, before training starts,
    rather than a buffered outage later.
    """
    choice = (report_to or os.environ.get(REPORT_TO_ENV) or "").strip().lower()
    if not choice:
        choice = "mlflow" if os.environ.get("MLFLOW_TRACKING_URI") else "none"
    if choice == "none":
        return []
    if choice != "mlflow":
        raise UserError(f"--report_to must be 'mlflow' or 'none' (got {choice!r}).")
    try:
        import mlflow  # noqa: F401
    except ImportError:
        raise UserError("reporting to MLflow needs mlflow: pip install 'rloo-kfp[tracking]'.") from None
    if preflight:
        check_tracking_server(mlflow_kwargs.get("tracking_uri"))
    return [MlflowSink(stage=stage, **mlflow_kwargs)]


def exit_on_sigterm() -> None:
    """Turn SIGTERM (pod eviction, KFP cancellation) into SystemExit in the main thread, so ``finally``
    blocks run and the MLflow run ends FAILED instead of staying RUNNING. Call once from the entry point."""

    def handler(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


__all__ = [
    "KFP_RUN_ID_ENV",
    "KFP_RUN_NAME_ENV",
    "MAIN_CURVES",
    "METRICS_FILE",
    "JsonlSink",
    "MlflowSink",
    "Sink",
    "StageRun",
    "Status",
    "check_tracking_server",
    "exit_on_sigterm",
    "finish_pipeline_run",
    "flatten_params",
    "pipeline_run_from_env",
    "plot_training_curves",
    "resolve_tracking_uri",
    "sinks_from_env",
    "start_stage_run",
]
