"""Two ``rloo pipeline run --local`` into one work directory at once: the second is refused in one line
while the first runs, and the first reports its own run, not the newest directory under ``kfp/``.

One tiny run (one update, four evaluation examples): about two minutes on a 2-core machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def _env(tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME")}
    env["TMPDIR"] = str(tmp)  # the steps' temporary directories
    return env


def _wait_for_steps(work: Path, proc: subprocess.Popen[str]) -> None:
    """Until the run's steps are running (kfp.local made its run directory): its set-up is done."""
    deadline = time.monotonic() + 300
    while not any((work / "kfp").glob("*/validate-params")):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the first run's steps did not start"
        time.sleep(0.5)


def test_a_second_run_is_refused_and_the_first_reports_its_own_outputs(tmp_path: Path) -> None:
    """kfp.local names a run '<pipeline>-<time>' and writes its steps' outputs under
    ``<pipeline_root>/<run>/<task>/`` (kubeflow/pipelines ``sdk/python/kfp/local/executor_input_utils.py``:
    ``get_local_pipeline_resource_name``, ``construct_local_task_root``); it tells the caller the name only
    through each task's executor input. Any other run into the same root adds a directory there, and the
    newest is not necessarily this run's. The work directory's MLflow store is a SQLite file whose first use
    runs MLflow's migrations unlocked (mlflow/mlflow ``mlflow/store/tracking/sqlalchemy_store.py``:
    ``SqlAlchemyStore.__init__`` calls ``_initialize_tables`` of ``mlflow/store/db/utils.py``; alembic's
    SQLite batch mode copies each table through ``_alembic_tmp_<table>``), which two runs at once break with
    ``table _alembic_tmp_experiments already exists``: one run at a time holds the work directory.

    The second run's refusal is real (two processes); the other run into the same root is stood in for by
    the directory it would write, planted while the first runs."""
    work = tmp_path / "work"
    env = _env(tmp_path)
    rloo = str(Path(sys.executable).parent / "rloo")
    argv = [rloo, "pipeline", "run", "--local", "--workdir", str(work), "--updates", "1"]
    argv += ["--param", "eval_num_examples=4"]
    first = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        _wait_for_steps(work, first)
        listed = sorted(p.name for p in work.iterdir())
        try:  # a refusal takes seconds: a second run that goes on is no refusal
            second = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)
        except subprocess.TimeoutExpired:
            pytest.fail("the second run into the same work directory ran instead of being refused")
        assert second.returncode == 75, second.stderr[-3000:]
        (line,) = second.stderr.strip().splitlines()
        assert line == (
            f"rloo pipeline: error: another local run (process {first.pid}) is using the work directory "
            f"{work}: wait for it to end, or pass another --workdir."
        )
        assert sorted(p.name for p in work.iterdir()) == listed  # the refused run changed nothing

        decoy = work / "kfp" / "rloo-rlhf-2999-01-01-00-00-00-000000"
        (decoy / "train-rloo").mkdir(parents=True)
        elsewhere = {"parameterValues": {"Output": str(tmp_path / "not-this-run" / "model")}}
        (decoy / "train-rloo" / "executor_output.json").write_text(json.dumps(elsewhere))
        out, err = first.communicate(timeout=900)
    finally:
        if first.poll() is None:
            first.kill()
            first.communicate()
    assert first.returncode == 0, err[-3000:]
    (own,) = (d for d in (work / "kfp").iterdir() if d != decoy)
    assert f"pipeline run {own.name} succeeded" in out
    assert f"KFP step outputs: {own}" in out and "not-this-run" not in out
    model = json.loads((own / "train-rloo" / "executor_output.json").read_text())["parameterValues"]["Output"]
    assert f"trained model:   {model}" in out
    assert not (work / ".rloo-run.lock").exists()  # a finished run leaves no lock behind


# Each process waits until all are ready (imports take seconds), then opens the new store at once.
_OPEN_STORE = """
import sys, time
from pathlib import Path
from rloo.pipeline.local import prepare_tracking
work, me, n = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
(work.parent / f"ready-{me}").touch()
while len(list(work.parent.glob("ready-*"))) < n:
    time.sleep(0.01)
print(prepare_tracking(work, "rloo"))
"""


def test_runs_that_open_a_new_store_at_once_share_it(tmp_path: Path) -> None:
    """A new SQLite store is created by whoever opens it first, with MLflow's migrations, unlocked
    (mlflow/mlflow ``mlflow/store/tracking/sqlalchemy_store.py``, ``SqlAlchemyStore.__init__``:
    ``if not _all_tables_exist(engine): _initialize_tables(engine)``, ``mlflow/store/db/utils.py``): runs
    starting at once into one store (one work directory's, or a shared ``sqlite:`` store) each ran the
    migrations, and all but one failed (``table _alembic_tmp_experiments already exists``, ``duplicate
    column name``). MLflow's job store locks the same step (``_safe_initialize_tables``); so does the run."""
    work = tmp_path / "w" / "work"
    work.mkdir(parents=True)
    n = 4
    env = _env(tmp_path)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _OPEN_STORE, str(work), str(i), str(n)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for i in range(n)
    ]
    done = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, done, strict=True):
        assert p.returncode == 0, err[-3000:]
        assert out.strip() == f"sqlite:///{work / 'mlruns' / 'mlflow.db'}"
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{work / 'mlruns' / 'mlflow.db'}")
    assert [e.name for e in client.search_experiments()].count("rloo") == 1


def test_the_run_is_known_by_the_output_file_its_tasks_print(tmp_path: Path) -> None:
    """kfp's executor logs its input as ``json.dumps(executor_input, indent=4)`` (kubeflow/pipelines
    ``sdk/python/kfp/dsl/executor_main.py``), which escapes a non-ASCII path: the run's directory is read
    back as the path it names, not as the escaped text."""
    from rloo.pipeline.console import step_console

    run = tmp_path / "wörk" / "kfp" / "rloo-rlhf-2026-01-01-00-00-00-000001"
    executor_input = {"outputs": {"outputFile": str(run / "train-rloo" / "executor_output.json")}}
    printed = json.dumps(executor_input, indent=4)
    assert "\\u00f6" in printed
    with step_console(tmp_path / "logs") as console:
        print("Executing task 'train-rloo'")
        print(f"    [KFP Executor 2026-01-01 00:00:00,000 INFO]: Got executor_input:\n{printed}")
    assert console.run_dirs == {run}
