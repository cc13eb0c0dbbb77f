"""Whether ``MLFLOW_TRACKING_URI`` names a store MLflow can open, checked before anything loads.

MLflow picks its tracking store by the URI's scheme (``mlflow/tracking/_tracking_service/utils.py``:
``_get_tracking_scheme_with_resolved_uri`` looks the scheme of :func:`mlflow.utils.uri.get_uri_scheme` up in
its store registry). A scheme it has no store for (``bogus://x``, or ``mlflow-server:5000``, whose "scheme"
is the host name) makes every later MLflow call fail, and the sinks would only log it: the run exits 0 with
nothing tracked. This module needs no MLflow import, so every command can afford it first.
"""

from __future__ import annotations

import re
from importlib.metadata import entry_points
from urllib.parse import urlsplit

from rloo.errors import UserError
from rloo.storage.redact import redact

# The schemes MLflow's own tracking store registry serves (utils.py, _register_tracking_stores): the REST
# store, the databases of mlflow/store/db/db_types.py (DATABASE_ENGINES; a driver may follow a '+', as in
# postgresql+psycopg2), the file store and Databricks. Plug-ins add theirs as 'mlflow.tracking_store' entry
# points (mlflow/tracking/registry.py, register_entrypoints).
REST_SCHEMES = ("http", "https")
DATABASE_SCHEMES = ("postgresql", "mysql", "sqlite", "mssql")
OTHER_SCHEMES = ("file", "databricks", "databricks-uc", "uc")
PLUGIN_GROUP = "mlflow.tracking_store"
# What a host name (with a port) looks like where a scheme was expected: 'mlflow-server:5000'
_HOST_PORT = re.compile(r"^[A-Za-z0-9.\-]+:\d+(/.*)?$")


def _plugin_schemes() -> set[str]:
    return {ep.name for ep in entry_points(group=PLUGIN_GROUP)}


def known_scheme(scheme: str) -> bool:
    """Whether MLflow has a tracking store for ``scheme`` (lower-case, as urlsplit gives it)."""
    if scheme in REST_SCHEMES or scheme in OTHER_SCHEMES:
        return True
    if scheme.split("+", 1)[0] in DATABASE_SCHEMES:
        return True
    return scheme in _plugin_schemes()


def _looks_like_a_path(uri: str) -> bool:
    """A local directory MLflow's file store would use: absolute, or explicitly relative. A bare word
    (``mlflow-server``) is far more often a host name without its ``http://`` than a directory, and a
    relative directory in a pipeline pod is lost with the pod."""
    return uri.startswith(("/", "./", "../", "~"))


def check_tracking_uri(uri: str | None) -> None:
    """A one-line UserError (exit 2: the same value never works) when ``uri`` names no store MLflow can
    open: a scheme it has no store for, or no scheme at all (a host name, a bare word). Unset passes."""
    if not uri or uri in OTHER_SCHEMES:  # 'databricks' alone is a URI to MLflow (utils.py)
        return
    shown = redact(uri)
    scheme = urlsplit(uri).scheme.lower() if "://" in uri or ":" in uri else ""
    if len(scheme) == 1:  # a Windows drive letter: MLflow takes it as a local path (utils/uri.py)
        return
    if scheme and known_scheme(scheme) and not _HOST_PORT.match(uri):
        return
    if not scheme and _looks_like_a_path(uri):
        return
    if _HOST_PORT.match(uri):
        what = f"has no scheme (MLflow reads {scheme!r} as one, and has no tracking store for it)"
        fix = f"write the server's URL, http://{shown}"
    elif not scheme:
        what = "has no scheme (MLflow would take it for a directory under the working directory, lost with a pod)"
        fix = f"write http://{shown} for a server, ./{shown} or an absolute path for a local store"
    else:
        what = f"has a scheme MLflow has no tracking store for ({scheme!r})"
        fix = "give the server's URL (http://host:5000 or https://...)"
    raise UserError(
        f"MLFLOW_TRACKING_URI={shown} {what}, so the run would not be tracked there: {fix}, a database URI "
        "(sqlite:////abs/path/mlflow.db, postgresql://...), or unset it to record runs in a local sqlite "
        "store under the output directory."
    )
