"""Wall time and peak memory of each phase of an update (``time/*_s``, ``memory/*_peak_gib`` metrics)."""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict

import torch


class StepTimer:
    """Wall time and peak memory of each phase of an update.

    Peak memory is ``torch.cuda.max_memory_allocated`` on GPU and the resident-set high-water mark on
    CPU (Linux ``VmHWM``, reset at each phase start through ``/proc/self/clear_refs``), in GiB.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.seconds: dict[str, float] = defaultdict(float)
        self.peak_gib: dict[str, float] = defaultdict(float)

    @contextlib.contextmanager
    def __call__(self, name: str):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            _reset_peak_rss()
        t0 = time.perf_counter()
        try:
            # a named range in torch.profiler traces (benchmarks/profile_gpu.py); a no-op without a profiler
            with torch.profiler.record_function(f"phase/{name}"):
                yield
        finally:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
                peak: float = torch.cuda.max_memory_allocated(self.device)
            else:
                peak = _peak_rss()
            self.seconds[name] += time.perf_counter() - t0
            self.peak_gib[name] = max(self.peak_gib[name], peak / 2**30)


def _reset_peak_rss() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:  # not Linux, or not allowed: the peak then covers the whole process so far
        pass


def _peak_rss() -> float:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
