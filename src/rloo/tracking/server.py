"""Where MLflow runs are recorded and whether that store can be used: the tracking URI (the argument, else
``MLFLOW_TRACKING_URI``, else an embedded sqlite store under the work directory), credentials kept out of it,
one fail-fast check of the server before a stage starts, and the bounds on MLflow's own HTTP retries."""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import urlparse

from rloo.errors import ServiceUnavailable, UserError
from rloo.storage.redact import redact

EMBEDDED_DIR = "mlruns"


def refuse_credentials_in_uri(uri: str | None) -> None:
    """Refuse ``user:password@`` in a tracking URI: MLflow prints the URI as it is in its "View run ... at"
    lines and in run metadata, so the password would end up in every pod log. Credentials belong in
    ``MLFLOW_TRACKING_USERNAME`` / ``MLFLOW_TRACKING_PASSWORD`` (or ``MLFLOW_TRACKING_TOKEN``), which MLflow
    sends as a header and never prints."""
    if not uri:
        return
    try:
        parsed = urlparse(uri)
        userinfo = parsed.username is not None or parsed.password is not None
    except ValueError:  # an unparsable port etc.: check_tracking_server says what is wrong with it
        userinfo = "@" in uri.split("://", 1)[-1].split("/", 1)[0]
    if userinfo:
        raise UserError(
            f"MLFLOW_TRACKING_URI={redact(uri)} carries credentials, which MLflow would print in its log "
            "lines: remove 'user:password@' from the URI and set MLFLOW_TRACKING_USERNAME / "
            "MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN) instead."
        )


def resolve_tracking_uri(
    tracking_uri: str | None = None, work_dir: str | Path | None = None
) -> tuple[str, str | None]:
    """(tracking URI, artifact location for new experiments).

    The argument, else ``MLFLOW_TRACKING_URI``, else the embedded default: a sqlite store at
    ``<work_dir>/mlruns/mlflow.db`` with artifacts in ``<work_dir>/mlruns/artifacts`` (no server needed).
    """
    uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        refuse_credentials_in_uri(uri)
        return uri, None
    base = Path(work_dir or Path.cwd()).resolve() / EMBEDDED_DIR
    return f"sqlite:///{base / 'mlflow.db'}", (base / "artifacts").as_uri()


def configure_mlflow_http(*, max_retries: int = 0, timeout_s: int = 30) -> None:
    """Make each MLflow HTTP call of this process fail fast: by default for the sinks, whose background loop
    owns retrying (with backoff and a buffer), so MLflow's own minutes-long retry chain would only delay
    flushing. User settings win."""
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", str(max_retries))
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(timeout_s))


def check_tracking_server(tracking_uri: str | None = None, *, timeout: float = 10.0) -> None:
    """Fail fast, in one line, if the tracking server cannot be used; call before training starts.

    Only HTTP(S) servers are contacted (one request, no retries); the embedded sqlite store needs nothing.
    """
    uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        return
    refuse_credentials_in_uri(uri)
    scheme = urlparse(uri).scheme
    shown = redact(uri)
    if scheme == "sqlite":
        try:
            import alembic  # noqa: F401
            import sqlalchemy  # noqa: F401
        except ImportError:
            raise UserError(
                f"MLFLOW_TRACKING_URI={shown} needs sqlalchemy and alembic: pip install 'rloo-kfp[tracking]'."
            ) from None
        return
    if scheme not in ("http", "https"):
        return
    from mlflow.utils.credentials import get_default_host_creds
    from mlflow.utils.rest_utils import http_request

    endpoint = "/api/2.0/mlflow/experiments/search"
    try:
        resp = http_request(
            get_default_host_creds(uri),
            endpoint,
            "POST",
            max_retries=0,
            timeout=timeout,
            raise_on_status=False,
            json={"max_results": 1},
        )
    except Exception as e:
        reason = _reason(e)
        # exit 75, not 2: a server restarting or a network blip heals, and a retried pipeline step tries again
        raise ServiceUnavailable(
            f"MLflow tracking server {shown} is unreachable ({reason}): start it or fix MLFLOW_TRACKING_URI, "
            "or unset MLFLOW_TRACKING_URI to record runs in a local sqlite store under the output directory."
        ) from None
    if resp.status_code in (401, 403):
        raise UserError(
            f"MLflow tracking server {shown} refused the request (HTTP {resp.status_code}): set "
            "MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD or MLFLOW_TRACKING_TOKEN."
        )
    if resp.status_code in (502, 503, 504):
        raise ServiceUnavailable(
            f"MLflow tracking server {shown} is unavailable (HTTP {resp.status_code}): it is starting or "
            "overloaded; try again, or unset MLFLOW_TRACKING_URI to record runs locally."
        )
    if resp.status_code != 200:
        raise UserError(
            f"{shown} does not answer like an MLflow tracking server (HTTP {resp.status_code} on {endpoint}): "
            "MLFLOW_TRACKING_URI must be the server's base URL, e.g. http://mlflow.example:5000."
        )


def _reason(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    for needle in (
        "Connection refused",
        "Name or service not known",
        "timed out",
        "Read timed out",
        "No route to host",
    ):
        if needle.lower() in text.lower():
            return needle.lower()
    return redact(text)[:160]
