"""``rloo train`` with stderr to a pipe, as in a Kubeflow step's log: progress comes as a few whole lines,
never a bar whose carriage-return redraws make one line of tens of kilobytes."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from rloo.demo.tiny import TinySetup


def test_progress_in_a_log_is_a_few_short_lines(
    tiny_setup: TinySetup, toy_dataset: Path, tmp_path: Path
) -> None:
    argv = [
        "--model_name_or_path", str(tiny_setup.policy),
        "--reward_funcs", "rloo.demo.toy:letter_reward",
        "--dataset_name", str(toy_dataset),
        "--output_dir", str(tmp_path / "out"),
        "--per_device_train_batch_size", "4",
        "--rloo_k", "2",
        "--num_ppo_epochs", "1",
        "--response_length", "4",
        "--max_steps", "60",
        "--save_steps", "0",
        "--num_sample_generations", "2",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "rloo.cli", "train", *argv],
        env=env,
        capture_output=True,  # pipes: not a terminal; bytes, as a log stores them (text mode reads '\r' as '\n')
        timeout=300,
    )
    stderr = proc.stderr.decode()
    assert proc.returncode == 0, stderr[-2000:]
    lines = stderr.split("\n")
    assert max(map(len, lines)) <= 500, max(lines, key=len)[:300]
    assert "\r" not in stderr
    progress = [line for line in lines if line.startswith("rloo: ")]
    # a line per tenth of the run, and on a slow machine one a minute in between
    assert 2 <= len(progress) <= 10 + (time.monotonic() - start) / 60 + 1, progress
    assert progress[-1].startswith("rloo: 60/60 updates (100%), ")
    assert "reward=" in progress[-1] and "kl=" in progress[-1]
