"""A byte-counting progress bar for large transfers (tqdm when installed, silent otherwise)."""

from __future__ import annotations

import sys
import threading
from typing import Any

# Small transfers (configs, tokenizers, tiny test models) finish before a bar would be readable.
PROGRESS_MIN_BYTES = 64 * 1024 * 1024


class Progress:
    """Thread-safe: s3transfer calls ``update`` from its worker threads (negative on a retried chunk)."""

    def __init__(self, total: int, desc: str, enabled: bool) -> None:
        self._lock = threading.Lock()
        self._bar: Any = None
        if enabled and total >= PROGRESS_MIN_BYTES:
            try:
                from tqdm import tqdm
            except ImportError:
                return
            self._bar = tqdm(
                total=total,
                desc=desc,
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                file=sys.stderr,
                leave=False,
            )

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
