"""Ctrl-C during ``rloo train`` (a real subprocess sent SIGINT): the first one checkpoints at the next safe
point and exits 130, and the same command resumes from that checkpoint; a second one quits at once, leaving
no half-written checkpoint behind."""

from __future__ import annotations

import signal
from pathlib import Path

from rloo.demo.tiny import TinySetup
from rloo.training.checkpoint import checkpoint_problem
from tests.fixtures import recipes, zygote
from tests.fixtures.train_cli import start_train, train_argv, updates, wait_for_updates


def test_ctrl_c_checkpoints_exits_130_and_the_same_command_resumes(
    tiny_setup: TinySetup, toy_dataset: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    proc = start_train(train_argv(tiny_setup, toy_dataset, out, max_steps=100_000))
    wait_for_updates(proc, out, 2)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr
    assert "Ctrl-C (SIGINT) received: checkpointing at the next safe point" in stdout
    assert "press Ctrl-C again to quit at once" in stdout
    (ckpt,) = out.glob("checkpoint-*")
    assert checkpoint_problem(ckpt) is None
    done = int(ckpt.name.split("-")[1])
    assert done >= 2
    assert f"Ctrl-C: saved {ckpt} after {done} of 100000 updates; run the same command again" in stdout
    assert not list(out.glob(".checkpoint-*"))  # nothing half-written
    # the same command (one more update to go) resumes from it and keeps metrics.jsonl in order
    resumed = zygote.run(
        ["-m", "rloo.cli", *train_argv(tiny_setup, toy_dataset, out, max_steps=done + 1)],
        env=recipes.subprocess_env(),
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from {ckpt} (update {done} of {done + 1})" in resumed.stdout
    assert updates(out) == list(range(1, done + 2))
    assert (out / "training_complete.json").is_file()


INTERRUPT_AT = Path(__file__).resolve().parent / "interrupt_at.py"


def test_a_second_ctrl_c_quits_at_once_without_a_checkpoint(
    tiny_setup: TinySetup, toy_dataset: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    argv = train_argv(tiny_setup, toy_dataset, out, max_steps=6)
    once = zygote.run(
        [str(INTERRUPT_AT), "3:optimization:1", *argv], env=recipes.subprocess_env(), timeout=300
    )
    assert once.returncode == 130, once.stderr
    # update index 3 had sampled but not stepped: the checkpoint is the state it started from
    assert [c.name for c in out.glob("checkpoint-*")] == ["checkpoint-3"]
    out2 = tmp_path / "out2"
    twice = zygote.run(
        [str(INTERRUPT_AT), "3:optimization:2", *train_argv(tiny_setup, toy_dataset, out2, 6)],
        env=recipes.subprocess_env(),
        timeout=300,
    )
    assert twice.returncode == 130, twice.stderr
    assert twice.stderr.strip().splitlines() == ["rloo train: interrupted."], twice.stderr
    assert "Ctrl-C again: quitting now, without a checkpoint" in twice.stdout
    assert not list(out2.glob("checkpoint-*")) and not list(out2.glob(".checkpoint-*"))
    assert updates(out2) == [1, 2, 3]  # what was trained before is kept
