"""``rloo ui`` on a store it cannot serve: one line naming the file, SQLite's reason and the way out, on real
damaged sqlite files (not SQLAlchemy's traceback, whose last line is a link to its docs)."""

from __future__ import annotations

import hashlib
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from rloo.errors import UserError
from rloo.tracking.ui import start_ui, store_uri
from tests.fixtures.servers import free_port


def _mlflow_store(path: Path) -> Path:
    """A real MLflow sqlite store with an experiment and a few runs."""
    from mlflow.tracking import MlflowClient

    path.parent.mkdir(parents=True, exist_ok=True)
    client = MlflowClient(tracking_uri=f"sqlite:///{path}")
    exp = client.create_experiment("rloo")
    for i in range(10):
        run = client.create_run(exp)
        client.log_param(run.info.run_id, "learning_rate", str(i))
        client.log_metric(run.info.run_id, "objective/scores", float(i))
    return path


def _rloo_ui(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    rloo = str(Path(sys.executable).parent / "rloo")
    return subprocess.run([rloo, "ui", *args], capture_output=True, text=True, timeout=120, env=env)


def test_a_file_that_is_not_a_database_is_one_line_naming_it(tmp_path: Path) -> None:
    db = tmp_path / "mlruns" / "mlflow.db"
    db.parent.mkdir()
    db.write_text("this is no database\n" * 200)  # e.g. a file copied over it
    done = _rloo_ui("--workdir", str(tmp_path), "--port", str(free_port()))
    assert done.returncode == 2
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith(f"rloo ui: error: the MLflow store {db} ")
    assert "(file is not a database)" in line
    assert f"mv {db} {db}.broken" in line and "--backend-store-uri" in line
    assert "sqlalche" not in done.stderr + done.stdout and "Traceback" not in done.stderr
    assert not (tmp_path / "logs").exists()  # refused before any server was started


def test_a_damaged_mlflow_store_is_refused_and_left_as_it_was(tmp_path: Path) -> None:
    db = _mlflow_store(tmp_path / "mlruns" / "mlflow.db")
    with open(db, "r+b") as f:  # a disk error or a copy cut short: pages in the middle overwritten
        f.seek(4096 * 3)
        f.write(b"\xde\xad\xbe\xef" * 2048)
    before = hashlib.sha256(db.read_bytes()).hexdigest()
    for args in ((tmp_path, None), (None, f"sqlite:///{db}")):
        with pytest.raises(UserError) as err:
            store_uri(*args)
        message = str(err.value)
        assert "\n" not in message and str(db) in message
        assert "(database disk image is malformed)" in message and "move it away" in message
    assert hashlib.sha256(db.read_bytes()).hexdigest() == before  # only read
    # an intact store passes, and one not there yet is the server's to create
    good = _mlflow_store(tmp_path / "good" / "mlflow.db")
    assert store_uri(None, f"sqlite:///{good}") == f"sqlite:///{good}"
    assert store_uri(None, f"sqlite:///{tmp_path / 'new.db'}") == f"sqlite:///{tmp_path / 'new.db'}"


def test_a_server_that_exits_is_reported_by_its_error_not_sqlalchemys_link(tmp_path: Path) -> None:
    """A store SQLite reads but MLflow cannot use (a table gone): the real server's exit, in one line."""
    db = _mlflow_store(tmp_path / "mlflow.db")
    con = sqlite3.connect(db)
    con.execute("PRAGMA foreign_keys=OFF")
    con.execute("DROP TABLE experiments")
    con.commit()
    con.close()
    uri = store_uri(None, f"sqlite:///{db}")  # SQLite has nothing against it
    with pytest.raises(UserError) as err:
        start_ui(uri, port=free_port(), log_dir=tmp_path / "logs")
    message = str(err.value)
    log = (tmp_path / "logs" / "mlflow-ui.log").read_text()
    assert "sqlalche.me" in log  # what the last line of the log is
    assert "\n" not in message and "sqlalche.me" not in message
    assert "Error" in message and "no such" in message, message
