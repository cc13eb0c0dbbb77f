"""SIGTERM and Ctrl-C during training: a flag the loop checks at its safe points, and a watchdog after SIGTERM."""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Any, NoReturn

log = logging.getLogger(__name__)


class Preempted(Exception):
    """Raised at a safe point after SIGTERM or a first Ctrl-C: checkpoint and exit."""


class Preemption:
    """SIGTERM or a first Ctrl-C (SIGINT) sets a flag the loop checks at safe points; a second Ctrl-C quits at
    once, without a checkpoint (KeyboardInterrupt). After SIGTERM a watchdog bounds the time to exit.

    Kubernetes sends SIGTERM before evicting a pod and SIGKILL ``terminationGracePeriodSeconds`` later.
    The loop checkpoints at its next safe point (between decode steps on one process, between phases on
    several); if that has not finished within the grace period, the watchdog exits anyway: the newest
    complete checkpoint is still there, only the current update is lost. Ctrl-C has no SIGKILL behind it:
    the person who pressed it can press it again.
    """

    def __init__(self, grace_seconds: float) -> None:
        self.grace_seconds = grace_seconds
        self._flag = threading.Event()
        self._timer: threading.Timer | None = None
        self._previous: dict[int, Any] = {}
        # the signal that asked to stop on this process (None: another rank's, agreed through the collectives)
        self.signal_name: str | None = None

    def requested(self) -> bool:
        return self._flag.is_set()

    @property
    def exit_code(self) -> int:
        return 128 + (signal.SIGINT if self.signal_name == "SIGINT" else signal.SIGTERM)

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        self._previous[signal.SIGTERM] = signal.signal(signal.SIGTERM, self._handle)
        # a process started with Ctrl-C ignored (nohup, a background job) keeps ignoring it
        if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
            self._previous[signal.SIGINT] = signal.signal(signal.SIGINT, self._handle)

    def uninstall(self) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()

    def _handle(self, signum: int, frame: Any) -> None:
        first = not self._flag.is_set()
        if signum == signal.SIGINT:
            if not first:
                log.warning("Ctrl-C again: quitting now, without a checkpoint")
                raise KeyboardInterrupt
            self.signal_name = "SIGINT"
            self._flag.set()
            log.warning(
                "Ctrl-C (SIGINT) received: checkpointing at the next safe point, then exiting (run the same "
                "command again to resume); press Ctrl-C again to quit at once without a checkpoint"
            )
            return
        self.signal_name = "SIGTERM"
        self._flag.set()
        if self._timer is not None:
            return
        log.warning(
            "SIGTERM received: checkpointing at the next safe point (at most %.0fs)", self.grace_seconds
        )
        self._timer = threading.Timer(self.grace_seconds, self._deadline)
        self._timer.daemon = True
        self._timer.start()

    def exit_finished(self, where: object) -> NoReturn:
        """SIGTERM or Ctrl-C while the final model was written: it is complete, so that is the checkpoint;
        exit as a preempted run does (the same command then finds nothing to do)."""
        self.cancel_deadline()
        log.warning(
            "%s: the run had finished: the model is in %s",
            "Ctrl-C" if self.signal_name == "SIGINT" else "SIGTERM",
            where,
        )
        raise SystemExit(self.exit_code)

    def cancel_deadline(self) -> None:
        if self._timer is not None:
            self._timer.cancel()

    def _deadline(self) -> None:
        log.error("no checkpoint within %.0fs of SIGTERM: exiting without one", self.grace_seconds)
        os._exit(143)
