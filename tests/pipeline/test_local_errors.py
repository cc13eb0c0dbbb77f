"""What ``rloo pipeline run --local`` and ``rloo pipeline compile`` say when the place they write, the work
directory's MLflow store or the Docker API is not usable: one line, exit 2 (never heals) or 75 (a retry may
heal), no traceback, nothing created. And a failed local run's last line is the failed step's own reason."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from rloo.cli.pipeline_cmd import main

pytestmark = pytest.mark.filterwarnings("ignore:You may be attemping:RuntimeWarning")

RLOO = str(Path(sys.executable).parent / "rloo")
NOBODY = 65534


def _one_line(capsys: pytest.CaptureFixture[str]) -> str:
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err
    (line,) = captured.err.strip().splitlines()
    return line


@pytest.fixture
def not_a_dir(tmp_path: Path) -> Path:
    """A path under a regular file: no one can create it, root included (ENOTDIR)."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory\n")
    return blocker / "work"


@pytest.fixture
def read_only_dir() -> Iterator[Path]:
    """A directory that ``nobody`` may read but not write (root-owned, mode 555), outside pytest's private
    temporary directory so that ``nobody`` can reach it. Root writes anywhere: only a run as another user
    shows a real permission error."""
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs root and setpriv to run a command as nobody")
    base = Path(tempfile.mkdtemp(prefix="rloo-ro-"))
    try:
        base.chmod(0o755)
        (base / "home").mkdir(mode=0o777)
        (base / "home").chmod(0o777)
        ro = base / "ro"
        ro.mkdir()
        ro.chmod(0o555)
        yield ro
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _as_nobody(argv: list[str], home: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "XDG_"))}
    env |= {"HOME": str(home), "TMPDIR": str(home)}
    cmd = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", RLOO, *argv]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=home, timeout=600)


def test_a_work_directory_that_cannot_be_created_is_one_line(
    not_a_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``os.mkdir`` fails with ENOTDIR under a file (CPython ``Modules/posixmodule.c``), as it fails with
    EACCES or EROFS in a read-only place: a mistake in the path, exit 2."""
    assert main(["run", "--local", "--workdir", str(not_a_dir), "--updates", "1"]) == 2
    line = _one_line(capsys)
    assert line == (
        f"rloo pipeline: error: cannot write the work directory {not_a_dir} (Not a directory): pass --workdir "
        "of a directory you can write."
    )
    assert not not_a_dir.exists()


@pytest.mark.parametrize("where", ["inside", "itself"])
def test_a_read_only_work_directory_is_one_line(read_only_dir: Path, where: str) -> None:
    """Run as ``nobody``: a new work directory in a read-only one, and a read-only work directory itself
    (EACCES from ``mkdir``/``open``, CPython ``Modules/posixmodule.c``)."""
    work = read_only_dir / "w" if where == "inside" else read_only_dir
    done = _as_nobody(
        ["pipeline", "run", "--local", "--workdir", str(work), "--updates", "1"],
        read_only_dir.parent / "home",
    )
    assert done.returncode == 2, done.stderr[-3000:]
    (line,) = done.stderr.strip().splitlines()
    assert line == (
        f"rloo pipeline: error: cannot write the work directory {work} (Permission denied): pass --workdir "
        "of a directory you can write."
    )
    assert list(read_only_dir.iterdir()) == []


def test_a_store_that_is_not_a_database_is_one_line_before_anything_is_built(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """MLflow opens the store with SQLAlchemy and reads its tables at once (mlflow/mlflow
    ``mlflow/store/tracking/sqlalchemy_store.py``, ``SqlAlchemyStore.__init__``: ``_all_tables_exist``),
    which raises ``sqlalchemy.exc.DatabaseError: file is not a database`` with its traceback. The run checks
    the file as ``rloo ui`` does (SQLite's quick check), before the demo's models are built."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    work = tmp_path / "work"
    db = work / "mlruns" / "mlflow.db"
    db.parent.mkdir(parents=True)
    db.write_text("these are not the tables you are looking for\n" * 100)
    before = db.read_bytes()
    assert main(["run", "--local", "--workdir", str(work), "--updates", "1"]) == 2
    line = _one_line(capsys)
    assert line == (
        f"rloo pipeline: error: the MLflow store {db} is damaged or not an SQLite database (file is not a "
        f"database): move it away (mv {db} {db}.broken; the next run starts a new store) or pass another "
        "--workdir."
    )
    assert [p.relative_to(work) for p in sorted(work.rglob("*"))] == [
        Path("mlruns"),
        Path("mlruns/mlflow.db"),
    ]
    assert db.read_bytes() == before


def test_containers_without_a_docker_api_is_one_line_before_anything_is_built(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """kfp.local's DockerRunner asks the Docker API for every step (kubeflow/pipelines
    ``sdk/python/kfp/local/docker_task_handler.py``: ``docker.from_env()`` in ``DockerTaskHandler.run``),
    and docker-py raises ``DockerException('Error while fetching server API version: ...')`` when none
    answers at ``DOCKER_HOST`` (docker/docker-py ``docker/api/client.py``, ``_retrieve_server_version``).
    A daemon may be starting: exit 75; and nothing of the run is built."""
    pytest.importorskip("docker")
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/no-docker.sock")
    work = tmp_path / "work"
    assert main(["run", "--local", "--containers", "--workdir", str(work), "--updates", "1"]) == 75
    line = _one_line(capsys)
    assert line.startswith(
        f"rloo pipeline: error: --containers: no Docker API answers at unix://{tmp_path}/no-docker.sock ("
    )
    assert line.endswith("or run without --containers.") and "podman.socket" in line
    assert not work.exists()


def test_compile_into_a_place_that_cannot_be_written_is_one_line(
    not_a_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """kfp's compiler opens ``package_path`` for writing itself (kubeflow/pipelines
    ``sdk/python/kfp/compiler/pipeline_spec_builder.py``, ``write_pipeline_spec_to_file``): an unwritable
    place raised its OSError with a traceback."""
    pytest.importorskip("kfp")
    out = not_a_dir / "rloo_pipeline.yaml"
    assert main(["compile", "--output", str(out)]) == 2
    line = _one_line(capsys)
    assert line == (
        f"rloo pipeline: error: --output {out}: cannot write it (Not a directory); give a path you can write."
    )


def test_compile_into_a_read_only_directory_leaves_nothing(read_only_dir: Path) -> None:
    """As ``nobody`` (EACCES): one line, and no partial or temporary file in the directory."""
    out = read_only_dir / "rloo_pipeline.yaml"
    done = _as_nobody(["pipeline", "compile", "--output", str(out)], read_only_dir.parent / "home")
    assert done.returncode == 2, done.stderr[-3000:]
    (line,) = done.stderr.strip().splitlines()
    assert line == (
        f"rloo pipeline: error: --output {out}: cannot write it (Permission denied); give a path you can write."
    )
    assert list(read_only_dir.iterdir()) == []
