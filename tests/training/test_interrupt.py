"""Ctrl-C during ``rloo train`` (a real subprocess sent SIGINT): the first one checkpoints at the next safe
point and exits 130, and the same command resumes from that checkpoint; a second one quits at once, leaving
no half-written checkpoint behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from rloo.demo.tiny import TinySetup
from rloo.training.checkpoint import checkpoint_problem


def _argv(tiny: TinySetup, data: Path, out: Path, max_steps: int) -> list[str]:
    return [
        "train", "--disable_tqdm",
        "--model_name_or_path", str(tiny.policy),
        "--reward_funcs", "rloo.demo.toy:letter_reward",
        "--dataset_name", str(data),
        "--output_dir", str(out),
        "--per_device_train_batch_size", "4",
        "--rloo_k", "2",
        "--num_ppo_epochs", "1",
        "--response_length", "4",
        "--max_steps", str(max_steps),
        "--save_steps", "1000",
        "--num_sample_generations", "0",
        "--seed", "5",
    ]  # fmt: skip


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def _start(argv: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "rloo.cli", *argv],
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # Ctrl-C as a terminal delivers it, even when this test runs where SIGINT is ignored (a background job)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def _wait_for_updates(proc: subprocess.Popen[str], out: Path, n: int) -> None:
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 180
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= n):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "training never got going"
        time.sleep(0.1)


def _updates(out: Path) -> list[int]:
    return [json.loads(line)["update"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_ctrl_c_checkpoints_exits_130_and_the_same_command_resumes(
    tiny_setup: TinySetup, toy_dataset: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    proc = _start(_argv(tiny_setup, toy_dataset, out, max_steps=100_000))
    _wait_for_updates(proc, out, 2)
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
    resumed = subprocess.run(
        [sys.executable, "-m", "rloo.cli", *_argv(tiny_setup, toy_dataset, out, max_steps=done + 1)],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from {ckpt} (update {done} of {done + 1})" in resumed.stdout
    assert _updates(out) == list(range(1, done + 2))
    assert (out / "training_complete.json").is_file()


INTERRUPT_AT = Path(__file__).resolve().parent / "interrupt_at.py"


def test_a_second_ctrl_c_quits_at_once_without_a_checkpoint(
    tiny_setup: TinySetup, toy_dataset: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    argv = _argv(tiny_setup, toy_dataset, out, max_steps=6)
    once = subprocess.run(
        [sys.executable, str(INTERRUPT_AT), "3:optimization:1", *argv],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert once.returncode == 130, once.stderr
    # update index 3 had sampled but not stepped: the checkpoint is the state it started from
    assert [c.name for c in out.glob("checkpoint-*")] == ["checkpoint-3"]
    out2 = tmp_path / "out2"
    twice = subprocess.run(
        [sys.executable, str(INTERRUPT_AT), "3:optimization:2", *_argv(tiny_setup, toy_dataset, out2, 6)],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert twice.returncode == 130, twice.stderr
    assert twice.stderr.strip().splitlines() == ["rloo train: interrupted."], twice.stderr
    assert "Ctrl-C again: quitting now, without a checkpoint" in twice.stdout
    assert not list(out2.glob("checkpoint-*")) and not list(out2.glob(".checkpoint-*"))
    assert _updates(out2) == [1, 2, 3]  # what was trained before is kept
