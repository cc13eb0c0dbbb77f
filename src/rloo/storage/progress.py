"""Progress of long loops: a tqdm bar on a terminal, a plain line now and then anywhere else.

A bar redraws itself with carriage returns. Where stderr is not a terminal (a Kubeflow step's log, a pipe,
a file) nothing turns those into new lines, and a run's whole bar history becomes one line of tens of
kilobytes that log viewers truncate or choke on. There, :class:`LineProgress` prints whole lines instead: one
at every tenth of the total and at most one a minute in between (while something moved), and a last one at
the end.

:class:`Progress` counts the bytes of large transfers (tqdm when installed, silent otherwise).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import IO, Any

# Small transfers (configs, tokenizers, tiny test models) finish before a bar would be readable.
PROGRESS_MIN_BYTES = 64 * 1024 * 1024
# Where stderr is not a terminal: a line at every tenth of the total, and one a minute in between.
LINE_EVERY_FRACTION = 0.1
LINE_EVERY_SECONDS = 60.0


def is_interactive(stream: Any) -> bool:
    """True when ``stream`` is a terminal or a notebook's output, where a redrawn bar shows as one bar."""
    try:
        if stream.isatty():
            return True
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False
    return "ipykernel" in sys.modules


def _duration(seconds: float) -> str:
    s = round(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


class LineProgress:
    """What the trainer and the transfers call on a tqdm bar (``update``, ``set_postfix``, ``close``),
    printed as whole lines on ``file``::

        rloo: 40/400 updates (10%), 1m12s elapsed, 1.8 s/update, about 10m48s left, reward=0.3722, kl=0.0006

    A line at every ``every_fraction`` of the total, at most one per ``every_seconds`` in between (only when
    something moved), and one from :meth:`close` unless the last line already said it all. ``initial`` is
    where a resumed loop starts: it counts towards the position, not the rate.
    """

    def __init__(
        self,
        total: int,
        desc: str,
        unit: str,
        *,
        initial: int = 0,
        unit_bytes: bool = False,
        file: IO[str] | None = None,
        every_fraction: float = LINE_EVERY_FRACTION,
        every_seconds: float = LINE_EVERY_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.total = max(0, int(total))
        self.desc = desc
        self.unit = unit
        self.unit_bytes = unit_bytes
        self.file = file
        self.n = self.initial = initial
        self.every_seconds = every_seconds
        self._step = max(1.0, self.total * every_fraction)
        self._clock = clock
        self._start = self._last_time = clock()
        self._last_n = initial
        self._next = self._threshold_after(initial)
        self._postfix: dict[str, str] = {}
        self._closed = False

    def _threshold_after(self, n: float) -> float:
        return (int(n // self._step) + 1) * self._step

    def update(self, n: int = 1) -> None:
        self.n += n
        now = self._clock()
        if self.n >= self._next or (now - self._last_time >= self.every_seconds and self.n != self._last_n):
            self._print(now)

    def set_postfix(self, postfix: Mapping[str, Any] | None = None, refresh: bool = True, **kw: Any) -> None:
        self._postfix = {k: str(v) for k, v in {**(postfix or {}), **kw}.items()}

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.n != self._last_n:
            self._print(self._clock())

    def _amount(self, n: float) -> str:
        return _bytes(n) if self.unit_bytes else f"{n:g}"

    def line(self, now: float) -> str:
        """The line that describes the position at time ``now``."""
        parts = [f"{self._amount(self.n)}/{self._amount(self.total)}"]
        parts[0] += "" if self.unit_bytes else f" {self.unit}s"
        if self.total:
            parts[0] += f" ({100 * self.n / self.total:.0f}%)"
        elapsed = now - self._start
        parts.append(f"{_duration(elapsed)} elapsed")
        done = self.n - self.initial
        if elapsed > 0 and done > 0:
            rate = done / elapsed
            if self.unit_bytes:
                parts.append(f"{_bytes(rate)}/s")
            else:
                parts.append(f"{rate:.3g} {self.unit}/s" if rate >= 1 else f"{1 / rate:.3g} s/{self.unit}")
            if self.total and self.n < self.total:
                parts.append(f"about {_duration((self.total - self.n) / rate)} left")
        parts += [f"{k}={v}" for k, v in self._postfix.items()]
        return f"{self.desc}: " + ", ".join(parts)

    def _print(self, now: float) -> None:
        out = self.file if self.file is not None else sys.stderr
        print(self.line(now), file=out, flush=True)
        self._last_time, self._last_n = now, self.n
        self._next = self._threshold_after(self.n)


def progress_bar(
    total: int,
    desc: str,
    unit: str,
    *,
    initial: int = 0,
    unit_bytes: bool = False,
    leave: bool = True,
    file: IO[str] | None = None,
) -> Any:
    """A tqdm bar on a terminal (or in a notebook), a :class:`LineProgress` anywhere else; either way an
    object with ``update``, ``set_postfix`` and ``close``. None when tqdm is not installed."""
    stream = file if file is not None else sys.stderr
    if not is_interactive(stream):
        return LineProgress(total, desc, unit, initial=initial, unit_bytes=unit_bytes, file=file)
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    kwargs: dict[str, Any] = {"unit_scale": True, "unit_divisor": 1024} if unit_bytes else {}
    return tqdm(
        total=total,
        initial=initial,
        desc=desc,
        unit=unit,
        dynamic_ncols=True,
        leave=leave,
        file=stream,
        **kwargs,
    )


class Progress:
    """Thread-safe: s3transfer calls ``update`` from its worker threads (negative on a retried chunk)."""

    def __init__(self, total: int, desc: str, enabled: bool, *, file: IO[str] | None = None) -> None:
        self._lock = threading.Lock()
        self._bar: Any = None
        if enabled and total >= PROGRESS_MIN_BYTES:
            self._bar = progress_bar(total, desc, "B", unit_bytes=True, leave=False, file=file)

    def update(self, n: int) -> None:
        if self._bar is not None:
            with self._lock:
                self._bar.update(n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def quiet_library_bars() -> None:
    """Where stderr is not a terminal (a pipeline step's log, a pipe), the Hub's download bars and the
    datasets library's bars go quiet: their carriage-return redraws would pile up into one huge line. The
    trainer's own progress comes as plain lines there (rloo.storage.progress)."""
    if is_interactive(sys.stderr):
        return
    try:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
        import datasets

        datasets.disable_progress_bars()
    except ImportError:  # pragma: no cover - both come with transformers / the data extras
        pass
