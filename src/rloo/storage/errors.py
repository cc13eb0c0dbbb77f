"""Storage errors: one line each, saying what is wrong and how to fix it, credentials redacted."""

from __future__ import annotations

from rloo.errors import UserError
from rloo.storage.redact import redact


class StorageError(UserError):
    """Object storage refused or failed an operation (credentials, bucket, endpoint, retries spent).

    A ``UserError``: the CLI prints it as one line and exits 2. The message never contains credentials.
    """

    def __init__(self, message: str) -> None:
        super().__init__(redact(message))


class StorageUnavailable(StorageError):
    """The store could not be reached, or kept failing or throttling through every attempt: nothing about the
    request is wrong. Exits 75 (``EX_TEMPFAIL`` of sysexits.h) instead of 2, so a retried pipeline step tries
    again later (rloo.stages.retry tells the two apart by the status)."""

    exit_code = 75


class IncompleteArtifactError(StorageError):
    """A prefix has no manifest, or its files do not match it: it is not a complete, verified upload."""
