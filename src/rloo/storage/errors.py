"""Storage errors: one line each, saying what is wrong and how to fix it, credentials redacted."""

from __future__ import annotations

from rloo.errors import ServiceUnavailable, UserError, reworded
from rloo.storage.redact import redact


class StorageError(UserError):
    """Object storage refused or failed an operation (credentials, bucket, endpoint, retries spent).

    A ``UserError``: the CLI prints it as one line and exits 2. The message never contains credentials.
    """

    def __init__(self, message: str) -> None:
        super().__init__(redact(message))


class StorageUnavailable(StorageError, ServiceUnavailable):
    """The store could not be reached, or kept failing or throttling through every attempt: nothing about the
    request is wrong. A :class:`rloo.errors.ServiceUnavailable` (exit 75, ``EX_TEMPFAIL`` of sysexits.h), the
    one class of every transient failure, so a retried pipeline step tries again later (rloo.stages.retry
    tells the two apart by the status)."""

    exit_code = ServiceUnavailable.exit_code


class IncompleteArtifactError(StorageError):
    """A prefix has no manifest, or its files do not match it: it is not a complete, verified upload."""


def prefixed(error: UserError, context: str) -> UserError:
    """``error`` with ``context`` (such as ``--dataset_name s3://b/x``) before its message, of the same class:
    a store that could not be reached still exits 75 (a retry may heal it), a bad prefix 2."""
    try:
        return type(error)(f"{context}: {error}")
    except TypeError:  # a subclass with another signature: the exit code matters more than the class
        return reworded(error, f"{context}: {error}")
