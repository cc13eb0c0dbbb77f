"""System metrics (CPU, memory, disk, network, GPU) sampled in a thread and fed to a sink's buffer.

The collectors are MLflow's own (``mlflow.system_metrics``: psutil, and NVML via ``nvidia-ml-py`` for GPUs),
under MLflow's names (``system/cpu_utilization_percentage``, ``system/gpu_0_utilization_percentage``, ...) so
the UI's system-metrics charts pick them up. MLflow's monitor thread itself is not used: it stops for good at
the first failed request, while these samples go through the sink's retrying buffer.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)
PREFIX = "system/"


def _collectors() -> list[Any]:
    try:
        from mlflow.system_metrics.metrics.cpu_monitor import CPUMonitor
        from mlflow.system_metrics.metrics.disk_monitor import DiskMonitor
        from mlflow.system_metrics.metrics.network_monitor import NetworkMonitor
    except ImportError:
        return [_PsutilMonitor()]
    monitors: list[Any] = [CPUMonitor(), DiskMonitor(), NetworkMonitor()]
    try:
        from mlflow.system_metrics.metrics.gpu_monitor import GPUMonitor

        monitors.append(GPUMonitor())
    except Exception as e:  # no NVML / no GPU: CPU-only metrics
        log.debug("no GPU system metrics: %s", e)
    return monitors


class _PsutilMonitor:
    """Fallback when MLflow's collectors are unavailable: CPU and memory from psutil."""

    def __init__(self) -> None:
        self._metrics: dict[str, float] = {}

    def collect_metrics(self) -> None:
        import psutil

        mem = psutil.virtual_memory()
        self._metrics = {
            "cpu_utilization_percentage": psutil.cpu_percent(),
            "system_memory_usage_megabytes": mem.used / 1e6,
            "system_memory_usage_percentage": mem.percent,
        }

    def aggregate_metrics(self) -> dict[str, float]:
        return dict(self._metrics)

    def clear_metrics(self) -> None:
        self._metrics = {}


class SystemMetricsSampler:
    """Calls ``emit(metrics, step)`` once at start, every ``interval`` seconds, and once at stop."""

    def __init__(self, emit: Callable[[dict[str, float], int], None], interval: float = 10.0) -> None:
        self.emit = emit
        self.interval = interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._step = 0
        self._lock = threading.Lock()
        self._monitors: list[Any] = []

    def start(self) -> None:
        self._monitors = _collectors()
        self.sample()
        self._thread = threading.Thread(target=self._loop, name="rloo-system-metrics", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def sample(self) -> None:
        with self._lock:
            metrics: dict[str, float] = {}
            for m in self._monitors:
                try:
                    m.collect_metrics()
                    metrics.update(m.aggregate_metrics())
                    m.clear_metrics()
                except Exception as e:  # a flaky collector must not stop the others
                    log.debug("system metrics collector %s failed: %s", type(m).__name__, e)
            if metrics:
                self.emit({PREFIX + k: float(v) for k, v in metrics.items()}, self._step)
                self._step += 1

    def stop(self) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        self.sample()
