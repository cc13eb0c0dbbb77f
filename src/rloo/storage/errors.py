"""Storage errors: one line each, saying what is wrong and how to fix it, credentials redacted."""

from __future__ import annotations

from rloo.errors import UserError
from rloo.storage.redact import redact


class StorageError(UserError):
    """Object storage refused or failed an operation (credentials, bucket, endpoint, retries spent).

    A ``UserError``: the CLI prints it as one line, without credentials. It exits 75 (``EX_TEMPFAIL`` of
    sysexits.h), not 2: object storage that is down, throttling or refusing credentials can heal while a retried
    pipeline step waits, where a bad flag cannot (rloo.pipeline.retry tells the two apart by the status).
    """

    exit_code = 75

    def __init__(self, message: str) -> None:
        super().__init__(redact(message))


class IncompleteArtifactError(StorageError):
    """A prefix has no manifest, or its files do not match it: it is not a complete, verified upload."""
