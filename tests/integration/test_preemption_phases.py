"""SIGTERM or Ctrl-C at every point of a run: each ends in a checkpoint (or the finished model) and exit 130 / 143,
and the same command then ends where an uninterrupted run ends, weights, metrics and sample tables alike.

Kubernetes evicts a pod with SIGTERM and SIGKILLs it ``terminationGracePeriodSeconds`` later
(kubernetes/kubernetes pkg/kubelet/kuberuntime/kuberuntime_container.go, ``killContainer``), whatever the
process is doing then: rolling out, optimizing, drawing its sample table, writing metrics, a checkpoint, the plots
or the final model. The signal is delivered to this process (``os.kill``) from inside the phase named, as the
kubelet's would arrive there.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from rloo.config import RLOOConfig
from rloo.demo.tiny import TinySetup
from rloo.training import checkpoint_manager, trainer
from rloo.training.checkpoint import checkpoint_problem, list_checkpoints
from rloo.training.metrics import MetricsLogger
from tests.fixtures import recipes, zygote

pytestmark = pytest.mark.slow

TIMING = ("time/", "memory/", "throughput/", "eps", "timestamp")  # measurements, not results
UPDATES = 4


def _config(tiny: TinySetup, data: Path, out: Path, **change: Any) -> RLOOConfig:
    # a sample table after every update, a periodic checkpoint after update 2
    return recipes.config(
        tiny,
        data,
        out,
        recipes.LEARNING,
        per_device_train_batch_size=8,
        max_steps=UPDATES,
        save_steps=2,
        num_sample_generations=UPDATES,
        per_device_eval_batch_size=2,
        preemption_grace_seconds=3600,
        seed=3,
        **change,
    )


def _metrics(out: Path) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in rows]


def _samples(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def uninterrupted(tiny: TinySetup, toy_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("straight") / "out"
    trainer.train(_config(tiny, toy_data, out))
    return out


@pytest.fixture
def ctrl_c_handled() -> Iterator[None]:
    """Ctrl-C reaches the trainer even where the tests run with SIGINT ignored (a background job)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def _signal(signum: int) -> None:
    os.kill(os.getpid(), signum)


# Each phase: how to deliver the signal from inside it (patching the trainer t, or the classes it uses).
def _in_rollout(t: trainer.RLOOTrainer, mp: pytest.MonkeyPatch, signum: int) -> None:
    generate, calls = t.generator.generate, []

    def wrapped(*args: Any, **kw: Any) -> Any:
        if not args[3].greedy:  # the rollout's sampling, not the sample table's
            calls.append(1)
            if len(calls) == 3:
                _signal(signum)
        return generate(*args, **kw)

    mp.setattr(t.generator, "generate", wrapped)


def _in_optimization(t: trainer.RLOOTrainer, mp: pytest.MonkeyPatch, signum: int) -> None:
    update, calls = t.updater.update, []

    def wrapped(*args: Any, **kw: Any) -> Any:
        calls.append(1)
        if len(calls) == 2:  # the second update's optimization
            _signal(signum)
        return update(*args, **kw)

    mp.setattr(t.updater, "update", wrapped)


def _in_sample_table(t: trainer.RLOOTrainer, mp: pytest.MonkeyPatch, signum: int) -> None:
    generate, calls = t.generator.generate, []

    def wrapped(*args: Any, **kw: Any) -> Any:
        if args[3].greedy:  # between decode steps of the sample table's generation
            calls.append(1)
            if len(calls) == 2:
                _signal(signum)
        return generate(*args, **kw)

    mp.setattr(t.generator, "generate", wrapped)


def _logger_method(
    name: str, at_update: int
) -> Callable[[trainer.RLOOTrainer, pytest.MonkeyPatch, int], None]:
    def patch(t: trainer.RLOOTrainer, mp: pytest.MonkeyPatch, signum: int) -> None:
        original = getattr(MetricsLogger, name)

        def wrapped(self: MetricsLogger, first: Any, *args: Any) -> Any:
            step = first["update"] if isinstance(first, dict) else first
            if step == at_update:
                _signal(signum)
            return original(self, first, *args)

        mp.setattr(MetricsLogger, name, wrapped)

    return patch


def _in_checkpoint_write(t: trainer.RLOOTrainer, mp: pytest.MonkeyPatch, signum: int) -> None:
    save, calls = checkpoint_manager.save_checkpoint, []

    def wrapped(out_dir: Path, update: int, **kw: Any) -> Any:
        calls.append(update)
        if len(calls) == 1:  # the periodic checkpoint after update 2
            _signal(signum)
        return save(out_dir, update, **kw)

    mp.setattr(checkpoint_manager, "save_checkpoint", wrapped)


def _in_final_model_write(t: trainer.RLOOTrainer, mp: pytest.MonkeyPatch, signum: int) -> None:
    write = t.checkpoints._write_final

    def wrapped(*args: Any) -> Any:
        _signal(signum)
        return write(*args)

    mp.setattr(t.checkpoints, "_write_final", wrapped)


def _in_plots(t: trainer.RLOOTrainer, mp: pytest.MonkeyPatch, signum: int) -> None:
    from rloo.tracking import plots

    draw = plots.plot_training_curves

    def wrapped(*args: Any, **kw: Any) -> Any:
        _signal(signum)
        return draw(*args, **kw)

    mp.setattr(plots, "plot_training_curves", wrapped)


PHASES = {
    "rollout": _in_rollout,
    "optimization": _in_optimization,
    "sample_table": _in_sample_table,
    "metrics_write": _logger_method("log", 2),
    "last_metrics_write": _logger_method("log", UPDATES),
    "sample_table_write": _logger_method("samples", 2),
    "checkpoint_write": _in_checkpoint_write,
    "final_model_write": _in_final_model_write,
    "plots": _in_plots,
}


def _interrupted_then_resumed(
    tiny: TinySetup, data: Path, out: Path, phase: str, signum: int, mp: pytest.MonkeyPatch
) -> None:
    t = trainer.RLOOTrainer(_config(tiny, data, out))
    with mp.context() as patched:
        PHASES[phase](t, patched, signum)
        with pytest.raises(SystemExit) as stopped:
            t.train()
    assert stopped.value.code == 128 + signum
    # what the run stopped at is whole: a checkpoint that matches its manifest, or the finished model
    newest = list_checkpoints(out)[0][1] if list_checkpoints(out) else None
    finished = (out / "training_complete.json").is_file()
    assert finished or (newest is not None and checkpoint_problem(newest) is None)
    assert not list(out.glob(".checkpoint-*"))
    trainer.train(_config(tiny, data, out))  # the same command


def _assert_same_run(out: Path, uninterrupted: Path) -> None:
    """The interrupted-then-resumed run ends as the uninterrupted one: weights, metrics and sample tables."""
    straight, resumed = (
        load_file(str(uninterrupted / "model.safetensors")),
        load_file(str(out / "model.safetensors")),
    )
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)
    assert _metrics(out) == _metrics(uninterrupted)
    assert _samples(out) == _samples(uninterrupted)


@pytest.mark.parametrize("phase", sorted(PHASES))
def test_ctrl_c_in_each_phase_checkpoints_and_resumes_exactly(
    tiny: TinySetup,
    toy_data: Path,
    tmp_path: Path,
    uninterrupted: Path,
    ctrl_c_handled: None,
    monkeypatch: pytest.MonkeyPatch,
    phase: str,
) -> None:
    out = tmp_path / "out"
    _interrupted_then_resumed(tiny, toy_data, out, phase, signal.SIGINT, monkeypatch)
    _assert_same_run(out, uninterrupted)
    assert [m["update"] for m in _metrics(out)] == list(range(1, UPDATES + 1))


@pytest.mark.parametrize("phase", ["sample_table", "optimization", "last_metrics_write", "plots"])
def test_sigterm_in_a_phase_exits_143_and_resumes_exactly(
    tiny: TinySetup,
    toy_data: Path,
    tmp_path: Path,
    uninterrupted: Path,
    monkeypatch: pytest.MonkeyPatch,
    phase: str,
) -> None:
    out = tmp_path / "out"
    _interrupted_then_resumed(tiny, toy_data, out, phase, signal.SIGTERM, monkeypatch)
    _assert_same_run(out, uninterrupted)


SIGNAL_IN_SAMPLE_TABLE = Path(__file__).resolve().parent / "signal_in_sample_table.py"


@pytest.mark.parametrize("name", ["SIGTERM", "SIGINT"])
def test_rloo_train_signalled_in_its_sample_table_exits_without_a_traceback_and_resumes(
    tiny: TinySetup, toy_data: Path, tmp_path: Path, name: str
) -> None:

    from tests.fixtures.train_cli import train_argv

    out = tmp_path / "out"
    argv = train_argv(tiny, toy_data, out, max_steps=3)
    argv[argv.index("--num_sample_generations") + 1] = "3"  # a table after every update
    stopped = zygote.run(
        [str(SIGNAL_IN_SAMPLE_TABLE), name, *argv], env=recipes.subprocess_env(), timeout=300
    )
    assert stopped.returncode == 128 + getattr(signal, name), stopped.stderr
    assert "Traceback" not in stopped.stderr
    (ckpt,) = out.glob("checkpoint-*")
    assert (
        ckpt.name == "checkpoint-1" and checkpoint_problem(ckpt) is None
    )  # update 1 trained, its table owed
    who = "Ctrl-C" if name == "SIGINT" else "SIGTERM"
    assert f"{who}: saved {ckpt} after 1 of 3 updates; run the same command again" in stopped.stdout
    assert not (out / "samples.jsonl").exists()
    resumed = zygote.run(["-m", "rloo.cli", *argv], env=recipes.subprocess_env(), timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert sorted({row["update"] for row in _samples(out)}) == [1, 2, 3]
    assert [m["update"] for m in _metrics(out)] == [1, 2, 3]


def test_sigterm_while_the_next_batch_generates_resumes_exactly(
    tiny: TinySetup, toy_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--async_generation: SIGTERM in update 2's optimization, while the worker generates batch 3. The batch in
    flight is finished and kept in the checkpoint (rollouts_ahead.pt), which is taken after update 2; the
    resumed run trains on it and ends as the uninterrupted asynchronous run, bit for bit."""
    straight, out = tmp_path / "straight", tmp_path / "out"
    trainer.train(_config(tiny, toy_data, straight, async_generation=True))
    t = trainer.RLOOTrainer(_config(tiny, toy_data, out, async_generation=True))
    with monkeypatch.context() as patched:
        _in_optimization(t, patched, signal.SIGTERM)
        with pytest.raises(SystemExit) as stopped:
            t.train()
    assert stopped.value.code == 143
    (update, newest), *_ = list_checkpoints(out)
    assert update == 2 and checkpoint_problem(newest) is None
    ahead = torch.load(newest / "rollouts_ahead.pt", weights_only=True)
    assert [sorted(part) for part in ahead["parts"]] == [[2]]
    trainer.train(_config(tiny, toy_data, out, async_generation=True))
    _assert_same_run(out, straight)
