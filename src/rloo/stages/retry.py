"""Retried steps that give up at once on a failure no retry heals.

KFP's ``set_retry`` becomes an Argo ``retryStrategy``: every failed attempt is tried again, whatever its exit
code. That is right for a preempted node or a lost connection (a retried train step resumes from the run's
checkpoints) and wasteful for a bad value, a full scratch disk or a non-finite loss: each attempt would
schedule a GPU pod again, load the models and fail the same way. Such failures exit 2 (a
:class:`rloo.errors.UserError`). :func:`give_up_on_user_errors` records the first one under the run's own
prefix (``<output_uri>/<run id>/failed/<step>.json``), and every later attempt of the step reads it first and
stops in seconds with the same message. Object storage that cannot be reached or keeps failing exits 75
(:class:`rloo.storage.StorageUnavailable`): that stays retryable, like every other failure.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from rloo.errors import UserError

if TYPE_CHECKING:
    from rloo.storage.backends import LocalBackend, S3Backend

FAILED_DIR = "failed"
# The exit status of a failure no retry heals (UserError.exit_code; 'rloo train' exits with it too).
PERMANENT_EXIT = UserError.exit_code


def _backend(run_root: str) -> LocalBackend | S3Backend:
    from rloo.storage import Location
    from rloo.storage.backends import backend_for

    return backend_for(Location.parse(f"{run_root.rstrip('/')}/{FAILED_DIR}"))


def recorded_failure(run_root: str, step: str) -> str | None:
    """The message of ``step``'s failure for good in the run under ``run_root``, if one was recorded."""
    data = _backend(run_root).read_bytes(f"{step}.json")
    if data is None:
        return None
    try:
        return str(json.loads(data)["message"])
    except (ValueError, KeyError, TypeError):
        return "an earlier attempt failed for good (its record is unreadable)"


def record_failure(run_root: str, step: str, message: str) -> None:
    body = {"step": step, "message": message, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    _backend(run_root).write_bytes(f"{step}.json", json.dumps(body, indent=2).encode())


@contextmanager
def give_up_on_user_errors(run_root: str, step: str) -> Iterator[None]:
    """Run a KFP step body that KFP may retry: stop at once (exit 2) when an earlier attempt failed for good;
    record a UserError that exits 2, or an exit 2 of this attempt, as such. Any other failure stays retryable."""
    earlier = recorded_failure(run_root, step)
    if earlier is not None:
        print(f"[rloo] not retrying {step}: an earlier attempt failed for good: {earlier}", file=sys.stderr)
        raise SystemExit(PERMANENT_EXIT)
    try:
        yield
    except UserError as e:
        if e.exit_code == PERMANENT_EXIT:
            _record_quietly(run_root, step, str(e))
        print(f"[rloo] {e}", file=sys.stderr)
        raise SystemExit(e.exit_code) from None
    except SystemExit as e:
        if e.code == PERMANENT_EXIT:
            _record_quietly(run_root, step, f"exited with status {PERMANENT_EXIT} (see this attempt's log)")
        raise


def _record_quietly(run_root: str, step: str, message: str) -> None:
    # the record only saves later attempts' time: failing to write it must not hide the real error
    try:
        record_failure(run_root, step, message)
    except Exception as e:
        print(f"[rloo] could not record the failure of {step} ({type(e).__name__})", file=sys.stderr)
