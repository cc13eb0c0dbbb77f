"""``rloo ui``: the MLflow UI over a local run's tracking store, until Ctrl-C."""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from types import FrameType

from rloo.errors import UserError


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def main(argv: list[str]) -> int:
    from rloo.parsing import OneLineParser
    from rloo.tracking.ui import DEFAULT_PORT, experiment_urls, start_ui, store_uri

    parser = OneLineParser(
        prog="rloo ui",
        description="Serve the MLflow UI over the runs of a local work directory (make demo, rloo pipeline "
        "run --local, rloo demo) or any MLflow backend store, until Ctrl-C.",
    )
    parser.add_argument(
        "--workdir",
        default="rloo-local",
        help="work directory of a local run; its store is <workdir>/mlruns/mlflow.db (default: rloo-local, "
        "where make demo writes; for 'rloo demo' pass its --output_dir).",
    )
    parser.add_argument(
        "--backend-store-uri",
        "--backend_store_uri",
        dest="backend_store_uri",
        default=None,
        help="an MLflow backend store URI instead of --workdir's, e.g. sqlite:///path/mlflow.db.",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1).")
    parser.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help=f"port to listen on (default: {DEFAULT_PORT})."
    )
    ns = parser.parse_args(argv)
    if not 0 < ns.port < 65536:
        raise UserError(f"--port must be between 1 and 65535 (got {ns.port}).")
    uri = store_uri(ns.workdir, ns.backend_store_uri)
    log_dir = (Path(ns.workdir) / "logs") if not ns.backend_store_uri else Path.cwd()
    print(f"starting the MLflow UI on {uri} ...", flush=True)
    # `kill` (SIGTERM) stops it like Ctrl-C does: the server must not outlive this command
    signal.signal(signal.SIGTERM, _interrupt)
    server = start_ui(uri, host=ns.host, port=ns.port, log_dir=log_dir.resolve())
    try:
        print(f"MLflow UI: {server.url}  (Ctrl-C to stop; log: {server.log_path})")
        for line in experiment_urls(uri, server.url):
            print(f"  {line}")
        sys.stdout.flush()
        server.proc.wait()
        raise UserError(f"the MLflow UI stopped with code {server.proc.returncode} (log: {server.log_path}).")
    except KeyboardInterrupt:
        print("stopping the MLflow UI.")
        return 0
    finally:
        server.stop()
