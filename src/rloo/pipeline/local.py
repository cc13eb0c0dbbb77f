"""``rloo pipeline run --local``: the whole pipeline on this machine, on embedded defaults.

Every step of the real pipeline runs as a subprocess of this interpreter through ``kfp.local`` (the same
component definitions the cluster runs). Without a ``model`` parameter the run is self-contained on the
defaults the caller passes in: ``rloo pipeline run --local`` passes those of :mod:`rloo.demo.pipeline` (a tiny
random-initialised policy and reward model built here, the toy prompt and evaluation datasets, and the toy
judge served from this process), all under ``--workdir``. They are arguments, not imports, so this module
(the pipeline layer) does not depend on the demo fixtures (the import-linter contracts in pyproject.toml). Models and results go to ``<workdir>/store`` (or the ``output_uri`` parameter, e.g. an
``s3://`` prefix with the usual ``AWS_*`` / ``S3_ENDPOINT_URL`` variables), MLflow runs to a sqlite store
under ``<workdir>/mlruns`` unless ``MLFLOW_TRACKING_URI`` names a server.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rloo.errors import ServiceUnavailable, UserError
from rloo.pipeline.console import step_console
from rloo.pipeline.failure import run_failure

STORE_DIR, KFP_DIR, MLFLOW_DIR, LOGS_DIR = "store", "kfp", "mlruns", "logs"

# The parameters of a self-contained run, built under the work directory (rloo.demo.pipeline.embedded_params)
Defaults = Callable[[Path], dict[str, Any]]
# A judge served while the run needs it; yields the judge parameters (rloo.demo.pipeline.toy_judge)
LocalJudge = Callable[[], AbstractContextManager[dict[str, Any]]]


@dataclass
class LocalResult:
    """What a local run produced: its KFP run name, its directory of step outputs, and each step's outputs
    (``executor_output.json`` by task name)."""

    run_name: str
    run_dir: Path
    outputs: dict[str, dict[str, Any]] = field(default_factory=dict)
    seconds: float = 0.0
    tracking_uri: str | None = None
    log_dir: Path | None = None
    work_dir: Path | None = None

    def parameter(self, task: str, name: str = "Output") -> Any:
        return self.outputs.get(task, {}).get("parameterValues", {}).get(name)

    def artifact_metadata(self, task: str, name: str) -> dict[str, Any]:
        arts = self.outputs.get(task, {}).get("artifacts", {}).get(name, {}).get("artifacts") or [{}]
        return dict(arts[0].get("metadata") or {})


def check_names(params: dict[str, Any], *, required: bool) -> dict[str, Any]:
    """One-line UserErrors for parameters the pipeline does not have, (``required``) ones it needs, and
    values of the wrong type; returns the values converted to the parameters' types
    (:func:`rloo.pipeline.params.check_params`)."""
    from rloo.pipeline.params import check_params

    return check_params(params, required=required)


def run_local(
    params: dict[str, Any],
    pipeline_root: str | os.PathLike[str],
    *,
    log_dir: str | os.PathLike[str] | None = None,
    verbose: bool = False,
    container_env: dict[str, str] | None = None,
) -> LocalResult:
    """Run the pipeline once with ``kfp.local``; raise a one-line UserError when a step fails.

    The steps' output goes to files under ``log_dir`` (default: ``<pipeline_root>/../logs/<time>``); the
    terminal gets one line per step start and end, or everything with ``verbose``. With ``container_env``
    every step runs in its image (``kfp.local.DockerRunner``, docker or podman's Docker API at
    ``DOCKER_HOST``) with that environment, on the host's network; kfp.local mounts ``pipeline_root`` only,
    at its own path, so every path the steps read or write must be under it."""
    import warnings

    from kfp import local

    from rloo.pipeline.compile import load_pipeline

    func = load_pipeline()
    params = check_names(params, required=True)  # before local.init: KFP's type check is a traceback
    root = Path(pipeline_root).resolve()
    root.mkdir(parents=True, exist_ok=True)
    logs = Path(log_dir) if log_dir else root.parent / LOGS_DIR / time.strftime("%Y%m%d-%H%M%S")
    runner: Any = local.SubprocessRunner(use_venv=False)
    if container_env is not None:
        runner = local.DockerRunner(network_mode="host", environment=container_env)
    local.init(runner=runner, pipeline_root=str(root))
    start = time.perf_counter()
    failure: str | None
    with warnings.catch_warnings():
        # cluster settings (display names, GPUs, secrets) that kfp.local says it ignores, twice per step
        warnings.filterwarnings(
            "ignore", message=".*no effect in the current local runner", category=UserWarning
        )
        warnings.filterwarnings("ignore", message="You may be attemping", category=RuntimeWarning)
        with step_console(logs, verbose=verbose) as console:
            try:
                with _without_retries(func.pipeline_spec):
                    func(**params)
            except RuntimeError as e:
                failure = run_failure(str(e), console.text)
                where = next(iter(console.failed_logs.values()), logs)
            else:
                failure = None
    if failure:
        raise UserError(f"{failure} (log: {where})")
    # this run's directory, by the name its own tasks were given: not the newest one under the root, which
    # another run into the same root may have written since
    mine = sorted(d for d in console.run_dirs if d.parent == root)
    if len(mine) != 1:
        found = ", ".join(map(str, mine)) or "none"
        raise UserError(
            f"the local run's steps named {found} as their output directory under {root}, not one."
        )
    run_dir = mine[0]
    outputs = {}
    for f in run_dir.glob("*/executor_output.json"):
        outputs[f.parent.name] = json.loads(f.read_text())
    return LocalResult(run_dir.name, run_dir, outputs, time.perf_counter() - start, log_dir=logs)


@contextmanager
def _without_retries(spec: Any) -> Iterator[None]:
    """Run ``spec`` (a PipelineSpec) with no task retried: kfp.local honours retry policies, and theirs are for
    a cluster's preempted nodes and flaky networks; here their minutes of backoff would only delay the error."""
    dags = [spec.root.dag, *(c.dag for c in spec.components.values() if c.HasField("dag"))]
    saved = [
        (task, task.retry_policy)
        for dag in dags
        for task in dag.tasks.values()
        if task.HasField("retry_policy")
    ]
    copies = [(task, type(policy)()) for task, policy in saved]
    for (task, policy), (_, copy) in zip(saved, copies, strict=True):
        copy.CopyFrom(policy)
        task.ClearField("retry_policy")
    try:
        yield
    finally:
        for task, copy in copies:
            task.retry_policy.CopyFrom(copy)


def prepare_tracking(workdir: Path, experiment: str) -> str:
    """Point every step at one MLflow store: ``MLFLOW_TRACKING_URI`` when set, else a sqlite store under
    ``<workdir>/mlruns`` whose experiment keeps its artifacts next to it (not in each step's cwd)."""
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        return uri
    import mlflow

    from rloo.tracking.experiment import get_or_create_experiment
    from rloo.tracking.server import resolve_tracking_uri

    uri, artifacts = resolve_tracking_uri(work_dir=workdir)
    Path(uri.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    db_log = logging.getLogger("mlflow.store.db.utils")  # "Creating initial MLflow database tables..."
    level = db_log.level
    db_log.setLevel(logging.WARNING)
    try:
        with store_init_lock(uri):
            get_or_create_experiment(mlflow.MlflowClient(tracking_uri=uri), experiment, artifacts)
    finally:
        db_log.setLevel(level)
    return uri


@contextmanager
def store_init_lock(uri: str) -> Iterator[None]:
    """Hold, across processes, the right to create the SQLite store ``uri`` (and its experiment). MLflow's
    tracking store creates its tables unlocked the first time it opens a new file: two runs doing that at
    once break each other's migrations (``table _alembic_tmp_experiments already exists``). The lock is
    the one MLflow's own job store takes for the same (``_safe_initialize_tables``: a file in the system
    temporary directory named after the database), not the database file, whose SQLite locks closing
    another descriptor of it would drop."""
    import fcntl
    import hashlib
    import tempfile

    from rloo.tracking.ui import sqlite_path

    path = sqlite_path(uri)
    if path is None:
        yield
        return
    key = hashlib.md5(str(path.resolve()).encode(), usedforsecurity=False).hexdigest()
    with open(Path(tempfile.gettempdir()) / f"rloo-store-init-{key}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        yield


def _parameters_set_by(extra_train_args: str) -> set[str]:
    """The training parameters that flags in ``extra_train_args`` also set (none when they do not parse: the
    validate step's checks say why)."""
    import shlex

    from rloo.config import RLOOConfig
    from rloo.parsing import parse_values
    from rloo.stages.plan import pipeline_fields

    try:
        fields = parse_values(RLOOConfig, shlex.split(extra_train_args), prog="rloo train").keys()
    except (UserError, ValueError):
        return set()
    return {p.name for p in pipeline_fields() if p.part == "train" and p.field in fields}


def _reward_source_gap(params: dict[str, Any]) -> str:
    """The reward source a run with the user's own model lacks too, said with the missing parameters (the
    validate step would only say it after they are given), else nothing."""
    extra = str(params.get("extra_train_args") or "")
    flags = ("--reward_funcs", "--reward-funcs", "--teacher_model_path", "--teacher-model-path")
    if params.get("reward_model_path") or any(flag in extra for flag in flags):
        return ""
    return "; also a reward source: reward_model_path, or --reward_funcs pkg.module:fn in extra_train_args"


def _precheck(params: dict[str, Any], *, own_model: bool) -> None:
    """The validate step's checks, plus what only this machine can tell: a local run has one node, and the GPUs
    it asks for must be here. ``own_model``: the user's model replaced the embedded defaults."""
    from rloo.pipeline.params import with_defaults
    from rloo.stages.validate import build_plan

    try:
        checked = check_names(params, required=True)
    except UserError as e:
        if own_model and str(e).startswith("missing"):
            raise UserError(
                f"{str(e).removesuffix('.')}{_reward_source_gap(params)}; with a model of your own, the demo's "
                "embedded datasets and reward model are not used."
            ) from None
        raise
    full = with_defaults(checked)
    if full["num_nodes"] > 1:
        raise UserError(
            f"num_nodes {full['num_nodes']}: a local run trains on this machine alone; pass --param num_nodes=1 "
            "(multi-node jobs run on a cluster: rloo pipeline submit)."
        )
    build_plan(full)
    import torch

    found = torch.cuda.device_count()
    if full["gpu_count"] > found:
        raise UserError(
            f"gpu_count {full['gpu_count']}: this machine has {found} CUDA GPU(s); pass --param "
            f"gpu_count={found}{' (0 trains on the CPU)' if found == 0 else ''}."
        )


def run_pipeline_locally(
    workdir: str | os.PathLike[str],
    user_params: dict[str, Any],
    *,
    defaults: Defaults | None = None,
    judge: LocalJudge | None = None,
    verbose: bool = False,
    precheck: bool = True,
    containers: bool = False,
) -> LocalResult:
    """The ``rloo pipeline run --local`` command: ``defaults`` built under ``workdir`` (unless ``model`` is
    given), one tracking store, ``judge`` served while the run needs it (unless ``judge_base_url`` is
    given). ``precheck``: the validate step's checks first, in this process (False: leave them to the
    step, to exercise the DAG's own failure path)."""
    from rloo.tracking.experiment import DEFAULT_EXPERIMENT

    user_params = check_names(user_params, required=False)  # before anything is built
    if containers:
        check_docker_api()  # before anything is built: the steps would only fail, one by one
    work = Path(workdir).resolve()
    check_tracking_store(work)
    with ExitStack() as stack:
        before = stack.enter_context(workdir_lock(work))
        try:
            own_model = "model" in user_params
            embedded: dict[str, Any] = {} if own_model or defaults is None else defaults(work)
            params = dict(embedded)
            params.setdefault("output_uri", str(work / STORE_DIR))
            params.update(user_params)
            if embedded and "extra_train_args" in user_params:
                # the user's flags add to the embedded recipe's (its reward function, epochs, ...) and win
                # where they set the same one: replacing them would silently train on another reward
                extra = str(user_params["extra_train_args"])
                params["extra_train_args"] = f"{embedded.get('extra_train_args', '')} {extra}".strip()
                for name in _parameters_set_by(extra):
                    if name not in user_params:  # the demo's value, not the user's: the user's flag wins
                        params.pop(name, None)
            if not params.get("judge_base_url") and judge is not None:
                params.update(stack.enter_context(judge()))
                if own_model:
                    print(
                        "[rloo] judging with the demo's toy judge; pass judge_base_url and judge_model for a real one",
                        file=sys.stderr,
                    )
            # the validate step's own checks, before anything starts: a bad value fails here in one line,
            # with no kfp.local workspace and no FAILED run in MLflow left behind
            if precheck:
                _precheck(params, own_model=own_model and defaults is not None)
            uri = None
            try:
                import mlflow  # noqa: F401

                uri = prepare_tracking(work, str(params.get("mlflow_experiment") or DEFAULT_EXPERIMENT))
            except ImportError:
                pass  # without the tracking extra the steps log to metrics.jsonl only
        except BaseException:
            _remove_new(work, before)  # nor what `defaults` built for it (the demo's models and datasets)
            raise
        if uri:  # inherited by every step's subprocess; this process's environment is left as it was
            stack.enter_context(_env(MLFLOW_TRACKING_URI=uri))
        print(f"running the pipeline on this machine (step logs: {work / LOGS_DIR})", flush=True)
        if containers:
            result = run_local(
                params,
                work,
                log_dir=work / LOGS_DIR / time.strftime("%Y%m%d-%H%M%S"),
                verbose=verbose,
                container_env=_container_env(work, uri),
            )
        else:
            result = run_local(params, work / KFP_DIR, verbose=verbose)
    result.tracking_uri = uri
    result.work_dir = work
    return result


class WorkdirBusy(UserError):
    """Another local run holds the work directory: the same command works once that run ends."""

    exit_code = 75


LOCK_FILE = ".rloo-run.lock"


@contextmanager
def workdir_lock(work: Path) -> Iterator[set[str] | None]:
    """Hold ``work`` for one local run: its steps' outputs, its logs and its MLflow store are found by
    position under it, and a refused run removes what appeared in it since it started, so a second run
    there is refused (exit 75, one line naming the first's process) rather than mixed in. Creates ``work``;
    yields its listing before (None when it did not exist), for :func:`_remove_new`. A work directory that
    cannot be written is one line, exit 2."""
    import fcntl

    created = False
    try:
        before = set(os.listdir(work)) if work.is_dir() else None
        if before is None:
            work.mkdir(parents=True, exist_ok=True)
            created = True
        lock = work / LOCK_FILE
        while True:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 32).decode(errors="replace").strip()
                os.close(fd)
                who = f" (process {holder})" if holder.isdigit() else ""
                raise WorkdirBusy(
                    f"another local run{who} is using the work directory {work}: wait for it to end, or "
                    "pass another --workdir."
                ) from None
            try:
                if os.stat(lock).st_ino == os.fstat(fd).st_ino:
                    break  # else its holder removed the file as it ended: lock the one there now
            except FileNotFoundError:
                pass
            os.close(fd)
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
    except OSError as e:
        if created:
            import shutil

            shutil.rmtree(work, ignore_errors=True)
        raise UserError(
            f"cannot write the work directory {work} ({e.strerror or e}): pass --workdir of a directory you "
            "can write."
        ) from None
    try:
        yield before
    finally:
        with contextlib.suppress(FileNotFoundError):
            if os.stat(lock).st_ino == os.fstat(fd).st_ino:
                lock.unlink()  # removed while held: a run starting now locks a new file (see above)
        os.close(fd)


def check_tracking_store(work: Path) -> None:
    """A one-line UserError (exit 2), before anything is built, when the run's SQLite MLflow store exists
    and SQLite cannot read it: every step would fail on it with SQLAlchemy's traceback."""
    from rloo.tracking.ui import check_store

    uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{work / MLFLOW_DIR / 'mlflow.db'}"
    check_store(uri, elsewhere="pass another --workdir")


def check_docker_api() -> None:
    """``--containers`` runs every step through kfp.local's DockerRunner, which asks the Docker API at
    ``DOCKER_HOST`` (docker's socket by default) for each step: one line before anything is built when it
    does not answer (exit 75: the daemon may be starting), or the ``docker`` package is missing (exit 2)."""
    try:
        import docker
    except ImportError:
        raise UserError(
            "--containers runs the steps through the Docker API and needs the docker package: pip install docker."
        ) from None
    where = os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"
    try:
        client = docker.from_env(timeout=10)
        try:
            client.ping()
        finally:
            client.close()
    except docker.errors.DockerException as e:
        reason = str(e).split(": ", 1)[-1][:200]
        raise ServiceUnavailable(
            f"--containers: no Docker API answers at {where} ({reason}): start docker, or podman's API "
            "(systemctl --user start podman.socket; export DOCKER_HOST=unix://$XDG_RUNTIME_DIR/podman/podman.sock), "
            "or run without --containers."
        ) from None


def _container_env(work: Path, tracking_uri: str | None) -> dict[str, str]:
    """What the steps' containers get of this process: the tracking store, offline switches. The work
    directory (the pipeline root, mounted at its own path) is opened to the images' non-root user."""
    for path in [work, *work.rglob("*")]:
        if not path.is_symlink():
            path.chmod(path.stat().st_mode | 0o666 | (0o111 if path.is_dir() else 0))
    env = {"MLFLOW_TRACKING_URI": tracking_uri} if tracking_uri else {}
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "MLFLOW_EXPERIMENT_NAME", "OPENAI_API_KEY"):
        if os.environ.get(name):
            env[name] = os.environ[name]
    return env


def _remove_new(work: Path, before: set[str] | None) -> None:
    """Remove what appeared in ``work`` since its listing ``before`` (all of it when it did not exist)."""
    import shutil

    if before is None:
        shutil.rmtree(work, ignore_errors=True)
        return
    for name in set(os.listdir(work)) - before:
        path = work / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


@contextmanager
def _env(**values: str) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def summary(result: LocalResult) -> list[str]:
    """The lines printed at the end of a local run: where the model, the metrics and the MLflow UI are."""
    from rloo.storage.redact import redact

    model = result.parameter("train-rloo")
    metrics = result.artifact_metadata("evaluate", "metrics")
    lines = [f"pipeline run {result.run_name} succeeded in {result.seconds:.0f}s"]
    lines.append(f"  trained model:   {model}")
    lines.append(f"  training curves: {model}/metrics.jsonl, {model}/plots/")
    if metrics:
        lines.append(
            "  evaluation:      win rate vs references: trained "
            f"{_rate(metrics, 'trained')}, SFT {_rate(metrics, 'baseline')}"
        )
    results = result.parameter("evaluate")
    if results:
        lines.append(f"  eval results:    {results} (report: eval_report.html next to it)")
    decision = result.parameter("push-model")
    if decision:
        lines.append(f"  push decision:   {decision}")
        pushed = _push_result(model)
        vs = pushed.get("against_champion")
        if isinstance(vs, dict) and vs.get("ci95"):
            lo, hi = vs["ci95"]
            lines.append(
                f"  vs champion:     {vs['estimate']:+.3f} [{lo:+.3f}, {hi:+.3f}] against {vs['champion']}"
            )
        published = _published(pushed)
        if published:
            lines.append(f"  published:       {published}")
    lines.append(f"  KFP step outputs: {result.run_dir}")
    if result.log_dir:
        lines.append(f"  step logs:       {result.log_dir}")
    if result.tracking_uri:
        uri = redact(result.tracking_uri)
        if uri.startswith(("http://", "https://")):
            lines.append(f"  MLflow:          {uri} (experiment of the run, parent run {result.run_name})")
        elif result.work_dir is not None:
            from rloo.tracking.ui import DEFAULT_PORT, ui_command

            lines.append(f"  MLflow UI:       {ui_command(result.work_dir)}")
            lines.append(
                f"                   (then open http://127.0.0.1:{DEFAULT_PORT}{_runs_page(result)})"
            )
    return lines


def _push_result(model: str | None) -> dict[str, Any]:
    """The push step's push_result.json (beside the model), when local; else empty."""
    if not model or "://" in model:
        return {}
    path = Path(model).parent / "push" / "push_result.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _published(pushed: dict[str, Any]) -> str | None:
    """Where the push step published the model (its versioned copy)."""
    storage = pushed.get("storage") or {}
    uri = storage.get("uri") if isinstance(storage, dict) else None
    return str(uri).removeprefix("file://") if uri else None


def _runs_page(result: LocalResult) -> str:
    """The UI's path of the runs table of the run's experiment, when the store can tell."""
    try:
        from mlflow.tracking import MlflowClient

        from rloo.tracking.tags import TAG_KFP_RUN_NAME, filter_value

        client = MlflowClient(tracking_uri=result.tracking_uri)
        runs = client.search_runs(
            [e.experiment_id for e in client.search_experiments()],
            filter_string=f"tags.`{TAG_KFP_RUN_NAME}` = '{filter_value(result.run_name)}'",
            max_results=1,
        )
    except Exception:  # a summary line is not worth failing a finished run
        return ""
    from rloo.tracking.ui import runs_path

    return runs_path(runs[0].info.experiment_id) if runs else ""


def _rate(metrics: dict[str, Any], who: str) -> str:
    rate = metrics.get(f"{who}_win_rate")
    lo, hi = metrics.get(f"{who}_win_rate_ci_low"), metrics.get(f"{who}_win_rate_ci_high")
    if rate is None:
        return "n/a"
    return f"{rate:.2f} [{lo:.2f}, {hi:.2f}]" if lo is not None and hi is not None else f"{rate:.2f}"
