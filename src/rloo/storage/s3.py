"""boto3 client construction and the translation of botocore failures into one-line errors.

Configuration comes from the standard AWS environment (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
``AWS_SESSION_TOKEN``, ``AWS_PROFILE``, ``AWS_REGION``/``AWS_DEFAULT_REGION``, pod IAM roles...) plus the
endpoint of an S3-compatible server in ``S3_ENDPOINT_URL`` (or ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``).

Retries are botocore's (``standard`` mode: throttling, 5xx and connection errors, exponential backoff with
jitter), never a loop of ours; ``AWS_MAX_ATTEMPTS`` and ``AWS_RETRY_MODE`` override the defaults.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

from rloo.errors import UserError
from rloo.storage.errors import IncompleteArtifactError, StorageError, StorageUnavailable
from rloo.storage.location import Location
from rloo.storage.redact import redact_url

ENDPOINT_ENV_VARS = ("S3_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
DEFAULT_MAX_ATTEMPTS = 5
DEFAULT_RETRY_MODE = "standard"
RETRY_MODES = ("legacy", "standard", "adaptive")  # what botocore's Config accepts
DEFAULT_CONNECT_TIMEOUT = 10.0
DEFAULT_READ_TIMEOUT = 60.0

_CRED_CODES = {
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "AccessDenied",
    "Forbidden",
    "403",
    "InvalidToken",
    "ExpiredToken",
    "InvalidSecurity",
    "AuthorizationHeaderMalformed",
}
_BUCKET_CODES = {"NoSuchBucket"}
_RETRYABLE_CODES = {
    "InternalError",
    "ServiceUnavailable",
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "RequestTimeout",
    "500",
    "502",
    "503",
    "504",
}


def resolve_endpoint(endpoint: str | None = None) -> str | None:
    """The S3 endpoint URL: the argument, else the first set of S3_ENDPOINT_URL, AWS_ENDPOINT_URL_S3,
    AWS_ENDPOINT_URL; ``None`` means AWS itself."""
    if endpoint:
        return endpoint
    for name in ENDPOINT_ENV_VARS:
        if os.environ.get(name):
            return os.environ[name]
    return None


def _endpoint_source(endpoint: str | None) -> str:
    """The name of the variable an endpoint came from (what to fix); S3_ENDPOINT_URL for an argument."""
    if not endpoint:
        for name in ENDPOINT_ENV_VARS:
            if os.environ.get(name):
                return name
    return ENDPOINT_ENV_VARS[0]


def _env_max_attempts() -> int:
    """``AWS_MAX_ATTEMPTS`` as botocore's retry config takes it (an integer >= 0), else the default; a
    garbage value is one line here, not botocore's ``ValueError`` at the first request."""
    raw = os.environ.get("AWS_MAX_ATTEMPTS", "").strip()
    if not raw:
        return DEFAULT_MAX_ATTEMPTS
    try:
        attempts = int(raw)
    except ValueError:
        attempts = -1
    if attempts < 0:
        raise UserError(
            f"AWS_MAX_ATTEMPTS={raw!r} is not a number of attempts: set an integer >= 0, or unset it."
        )
    return attempts


def s3_client(
    endpoint: str | None = None,
    *,
    max_attempts: int | None = None,
    retry_mode: str | None = None,
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
    read_timeout: float = DEFAULT_READ_TIMEOUT,
    max_pool_connections: int = 16,
) -> Any:
    """A boto3 S3 client with bounded retries and timeouts. Contacts nothing until first used."""
    import boto3
    from botocore.config import Config

    url = resolve_endpoint(endpoint)
    if url and not url.startswith(("http://", "https://")):
        source = _endpoint_source(endpoint)
        raise UserError(f"S3 endpoint {redact_url(url)!r} is not a URL: set {source} to http(s)://host:port.")
    attempts = max_attempts or _env_max_attempts()
    mode = retry_mode or os.environ.get("AWS_RETRY_MODE") or DEFAULT_RETRY_MODE
    if mode not in RETRY_MODES:
        raise UserError(f"AWS_RETRY_MODE={mode!r} is not a retry mode: use one of {', '.join(RETRY_MODES)}.")
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
    config = Config(
        retries={"mode": mode, "max_attempts": attempts},
        connect_timeout=connect_timeout,
        read_timeout=read_timeout,
        max_pool_connections=max_pool_connections,
        # S3-compatible servers (SeaweedFS, MinIO, Ceph) are addressed by path; AWS picks its own style.
        s3={"addressing_style": "path" if url else "auto"},
    )
    session = boto3.session.Session()
    client = session.client("s3", endpoint_url=url, region_name=region, config=config)
    client._rloo_max_attempts = attempts  # for error messages: "failed after N attempts"
    return client


def endpoint_of(client: Any) -> str:
    return redact_url(getattr(client.meta, "endpoint_url", None))


def _attempts(client: Any) -> int:
    return int(getattr(client, "_rloo_max_attempts", DEFAULT_MAX_ATTEMPTS))


def error_code(exc: BaseException) -> str:
    response = getattr(exc, "response", None) or {}
    code = str(response.get("Error", {}).get("Code", "") or "")
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return code or (str(status) if status else "")


def translate(exc: BaseException, *, action: str, loc: Location, client: Any) -> StorageError | None:
    """A one-line StorageError for a botocore/s3transfer failure, or None if it is not one."""
    from botocore import exceptions as bx
    from s3transfer.exceptions import RetriesExceededError

    endpoint = endpoint_of(client)
    attempts = _attempts(client)
    where = f"{action} {loc.uri} at {endpoint}"
    if isinstance(exc, StorageError):
        return exc
    if isinstance(exc, (bx.NoCredentialsError, bx.PartialCredentialsError)):
        return StorageError(
            f"{where}: no S3 credentials found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE, "
            "or give the pod an IAM role)."
        )
    if isinstance(exc, (bx.EndpointConnectionError, bx.ConnectTimeoutError)) and not isinstance(
        exc, bx.ReadTimeoutError
    ):
        return StorageUnavailable(
            f"{where} failed: cannot connect to the S3 endpoint after {attempts} attempts: check "
            "S3_ENDPOINT_URL / AWS_ENDPOINT_URL and that the server is running and reachable."
        )
    if isinstance(exc, bx.ClientError):
        code = error_code(exc)
        if code in _CRED_CODES:
            return StorageError(
                f"{where}: the server rejected the credentials ({code}): check AWS_ACCESS_KEY_ID / "
                f"AWS_SECRET_ACCESS_KEY and that this key may read and write bucket {loc.bucket!r}."
            )
        if code in _BUCKET_CODES:
            return StorageError(
                f"{where}: bucket {loc.bucket!r} does not exist: create it first (e.g. aws s3 mb "
                f"s3://{loc.bucket} --endpoint-url {endpoint}) or fix the URI."
            )
        if code in _RETRYABLE_CODES:
            return StorageUnavailable(
                f"{where} failed after {attempts} attempts ({code}): the S3 server is failing or throttling; "
                "retry later or raise AWS_MAX_ATTEMPTS."
            )
        return StorageError(f"{where} failed: {code or type(exc).__name__}: {_short(exc)}")
    if isinstance(
        exc, (bx.ConnectionError, bx.HTTPClientError, RetriesExceededError, bx.ResponseStreamingError)
    ):
        return StorageUnavailable(
            f"{where} failed after {attempts} attempts ({type(exc).__name__}): the connection to the S3 "
            "server keeps breaking; retry later or raise AWS_MAX_ATTEMPTS."
        )
    if isinstance(exc, bx.BotoCoreError):
        return StorageError(f"{where} failed: {type(exc).__name__}: {_short(exc)}")
    return None


def _short(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:300]


@contextlib.contextmanager
def s3_errors(action: str, loc: Location, client: Any) -> Iterator[None]:
    """Re-raise botocore failures as one-line StorageErrors (credentials redacted)."""
    try:
        yield
    except (StorageError, IncompleteArtifactError):
        raise
    except Exception as e:
        err = translate(e, action=action, loc=loc, client=client)
        if err is None:
            raise
        raise err from None
