"""The MLflow UI over a local tracking store: what ``rloo ui`` (and ``make ui``) start.

The runs of ``make demo`` / ``rloo pipeline run --local`` / ``rloo demo`` live in a sqlite store under their
work directory (:func:`rloo.tracking.server.resolve_tracking_uri`); this serves that store with ``mlflow
server`` (the full ``mlflow`` package of the ``ui`` extra: ``mlflow-skinny`` has no UI pages). Runs on a
tracking server need nothing of this: the server is the UI.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from rloo.errors import UserError
from rloo.tracking.experiment import RESULTS_VIEW_ID, RESULTS_VIEW_QUERY, VIEW_TAG_PREFIX
from rloo.tracking.server import EMBEDDED_DIR

DEFAULT_PORT = 5000
_START_TIMEOUT_S = 180.0  # importing mlflow's server on a busy 2-core machine takes tens of seconds


def ui_command(work_dir: str | os.PathLike[str]) -> str:
    """The command line that opens the UI over ``work_dir``'s runs, runnable as printed from any directory
    (the ``rloo`` next to this interpreter: a virtual environment need not be activated)."""
    exe = Path(sys.executable).with_name("rloo")
    prog = str(exe) if exe.is_file() else "rloo"
    return f"{prog} ui --workdir {Path(work_dir).resolve()}"


def _refuse_file_path(backend_store_uri: str) -> None:
    """A plain path is an MLflow file store, a directory; a file there (most often a ``mlflow.db``) only
    made the UI exit after its start-up with a message about the file store's maintenance mode."""
    path = Path(backend_store_uri).expanduser()
    if "://" not in backend_store_uri and path.is_file():
        raise UserError(
            f"--backend-store-uri {backend_store_uri} is a file, not a store URI: for a SQLite database pass "
            f"sqlite:///{path.resolve()}."
        )


def store_uri(work_dir: str | os.PathLike[str] | None, backend_store_uri: str | None) -> str:
    """The store to serve: ``backend_store_uri`` as given, else the sqlite store under ``work_dir``, which
    must exist (a one-line UserError says how to make one otherwise); a sqlite store must be readable
    (:func:`check_store`)."""
    if backend_store_uri:
        _refuse_file_path(backend_store_uri)
        check_store(backend_store_uri)
        return backend_store_uri
    work = Path(work_dir or ".").resolve()
    db = work / EMBEDDED_DIR / "mlflow.db"
    if db.is_file():
        uri = f"sqlite:///{db}"
        check_store(uri)
        return uri
    remote = os.environ.get("MLFLOW_TRACKING_URI", "")
    if remote.startswith(("http://", "https://")):
        from rloo.storage.redact import redact

        raise UserError(
            f"no local MLflow store at {db}: MLFLOW_TRACKING_URI names a tracking server, open "
            f"{redact(remote)} in a browser instead."
        )
    raise UserError(
        f"no MLflow store at {db}: run 'make demo' (or 'rloo pipeline run --local --workdir {work}') first, "
        "or pass --workdir of a run or --backend-store-uri."
    )


@dataclass
class UiServer:
    """A running ``mlflow server`` process serving one store."""

    proc: subprocess.Popen[bytes]
    url: str
    log_path: Path

    def stop(self) -> None:
        """Stop the server and the workers it started (its own process group). Returns once no process
        of the group is left: a worker outliving the server would keep holding the port."""
        for sig, wait in ((signal.SIGTERM, 20.0), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=wait)
            if _group_gone(self.proc.pid, wait):
                break


def _group_gone(pgid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)  # signal 0: does any process of the group remain?
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def _check_port(host: str, port: int) -> None:
    with socket.socket() as s:
        # as the server will bind it: connections of an earlier UI in TIME_WAIT do not block the port
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            raise UserError(
                f"port {port} on {host} is in use (another MLflow UI?): stop it or pass --port {port + 1}."
            ) from None


def sqlite_path(uri: str) -> Path | None:
    """The file of a ``sqlite:///`` store URI (``sqlite:////abs/path`` or ``sqlite:///relative``), else None."""
    if not uri.startswith("sqlite:///"):
        return None
    path = uri[len("sqlite:///") :].split("?", 1)[0]
    return Path(path) if path and path != ":memory:" else None


def check_store(uri: str, *, elsewhere: str = "pass --backend-store-uri of another store") -> None:
    """A one-line UserError naming the file, SQLite's reason and the way out when ``uri`` is a sqlite store
    that SQLite cannot read (not a database, a damaged one): the server (or a run's steps) would only exit
    with SQLAlchemy's traceback. Reads the file (SQLite's quick check) without writing to it; seconds for a
    large store, against the server's tens of seconds of start-up. ``elsewhere``: the other way out, in the
    caller's terms."""
    import sqlite3

    path = sqlite_path(uri)
    if path is None or not path.is_file():
        return  # another kind of store, or one the server creates
    try:
        con = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
        try:
            problems = [row[0] for row in con.execute("PRAGMA quick_check(1)").fetchall()]
        finally:
            con.close()
    except sqlite3.DatabaseError as e:
        reason = str(e)
    else:
        if problems == ["ok"]:
            return
        reason = "database disk image is malformed"  # what SQLite says; its page numbers help nobody
    if not os.access(path, os.R_OK):
        raise UserError(f"cannot read the MLflow store {path} ({reason}): check its permissions.")
    raise UserError(
        f"the MLflow store {path} is damaged or not an SQLite database ({reason}): move it away (mv {path} "
        f"{path}.broken; the next run starts a new store) or {elsewhere}."
    )


def start_ui(uri: str, *, host: str = "127.0.0.1", port: int = DEFAULT_PORT, log_dir: Path) -> UiServer:
    """Start ``mlflow server`` on ``uri`` and wait until it answers; a one-line UserError if it cannot."""
    try:
        import mlflow.server
    except ImportError:
        raise UserError(
            "the MLflow UI needs the full mlflow package: pip install 'rloo-kfp[ui]' (or 'make install')."
        ) from None
    if not (Path(mlflow.server.__file__).parent / "js" / "build" / "index.html").is_file():
        raise UserError(
            "this mlflow installation has no UI pages (mlflow-skinny?): pip install 'rloo-kfp[ui]'."
        )
    _check_port(host, port)
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / "mlflow-ui.log"
    env = dict(os.environ)
    env.pop("MLFLOW_TRACKING_URI", None)
    # the server's job runner starts a pool of workers for GenAI jobs: nothing here uses them
    env.setdefault("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false")
    cmd = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", uri]
    cmd += ["--host", host, "--port", str(port), "--workers", "1"]
    with open(log_path, "ab") as log:
        # its own process group: stop() ends the server's workers too, whatever signal ended this process
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    server = UiServer(proc, f"http://{host}:{port}", log_path)
    try:
        _wait_until_up(server)
    except BaseException:  # Ctrl-C while starting included: nothing is left running
        server.stop()
        raise
    return server


def _wait_until_up(server: UiServer) -> None:
    deadline = time.monotonic() + _START_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            cause = exit_cause(server.log_path.read_text(errors="replace"))
            raise UserError(
                f"the MLflow UI exited with code {server.proc.returncode}: {cause[:300]} "
                f"(log: {server.log_path})."
            )
        try:
            with urllib.request.urlopen(f"{server.url}/health", timeout=5) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    raise UserError(f"the MLflow UI did not answer within {_START_TIMEOUT_S:.0f}s (log: {server.log_path}).")


# A traceback's last line: 'package.module.SomeError: message'
_EXCEPTION_LINE = re.compile(r"[A-Za-z_][\w.]*(Error|Exception)(: .*)?")


def exit_cause(log_text: str) -> str:
    """The line of a server's log that says why it exited: the last exception raised, else its last line.
    (Not SQLAlchemy's afterwords, which come last: the failing statement and a link to its docs.)"""
    lines = [x.strip() for x in log_text.splitlines() if x.strip()]
    errors = [x for x in lines if _EXCEPTION_LINE.fullmatch(x)]
    return (errors or lines or ["no output"])[-1]


# The UI's "GenAI | Model training" switch defaults to GenAI (traces overview, "Evaluations" breadcrumbs)
# unless the URL says otherwise; these runs are model training.
RUNS_QUERY = "?workflowType=machine_learning"


def runs_path(experiment_id: str, *, view: bool = True) -> str:
    """The UI's path (after the host) of an experiment's runs table, in model-training mode; with ``view``,
    in its saved view of the headline results, which every experiment rloo makes or uses has
    (:func:`rloo.tracking.experiment.get_or_create_experiment`)."""
    shown = f"&{RESULTS_VIEW_QUERY}" if view else ""
    return f"/#/experiments/{experiment_id}/runs{RUNS_QUERY}{shown}"


def experiment_urls(uri: str, base_url: str) -> list[str]:
    """A link to the runs table of each (non-default) experiment of the store (in the results view where
    the experiment has it)."""
    from mlflow.tracking import MlflowClient

    exps = MlflowClient(tracking_uri=uri).search_experiments()
    return [
        f"{base_url}{runs_path(e.experiment_id, view=f'{VIEW_TAG_PREFIX}{RESULTS_VIEW_ID}' in e.tags)}  ({e.name})"
        for e in sorted(exps, key=lambda e: int(e.experiment_id) if e.experiment_id.isdigit() else 0)
        if e.name != "Default"
    ]
