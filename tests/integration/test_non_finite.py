"""Training that goes non-finite stops at once, in one line, and leaves no model a reader would take as trained.

The real ``rloo train`` in a subprocess. A learning rate of 1e30 is the test's way to get there: after the
first optimizer step the weights are ~1e30, so the next forward overflows to inf/NaN. Rewards of 3e38
(finite, so accepted) reach the gradient norm instead.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from rloo.demo.tiny import TinySetup
from tests.fixtures import recipes, zygote

BAD_REWARDS_DIR = Path(__file__).resolve().parents[1] / "cli"


def _train(tiny: TinySetup, data: Path, out: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    # the recipe with the default PPO epochs; later flags win
    argv = [*recipes.argv(tiny, data, out, max_steps=3, num_ppo_epochs=None, learning_rate=1e30), *flags]
    # tests/cli/bad_rewards.py, importable by the subprocess
    path = os.pathsep.join([str(BAD_REWARDS_DIR), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env = recipes.subprocess_env(PYTHONPATH=path)
    return zygote.run(["-m", "rloo.cli", "train", *argv], env=env, timeout=300)


def _one_error_line(proc: subprocess.CompletedProcess[str]) -> str:
    report = f"exit {proc.returncode}\n--- stderr:\n{proc.stderr}\n--- stdout:\n{proc.stdout}"
    assert "Traceback" not in proc.stderr + proc.stdout, report
    assert proc.returncode == 2, report
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    assert len(errors) == 1, report
    return errors[0]


@pytest.mark.parametrize(
    ("flags", "update", "phase", "what"),
    [
        # one optimizer step per update: update 1 is finite, update 2 samples from ~1e30 weights
        (["--num_ppo_epochs", "1"], 2, "rollout/logprobs", "non-finite policy or reference log-probs"),
        # two PPO epochs: the second epoch's forward of update 1 already overflows, in the loss
        (["--num_ppo_epochs", "2"], 1, "loss", "non-finite policy loss"),
        # finite rewards of 3e38 (accepted) at an ordinary learning rate: the loss is finite, its gradient not
        (
            ["--reward_funcs", "bad_rewards:huge_reward", "--learning_rate", "3e-6"],
            1,
            "grad norm",
            "non-finite gradient norm",
        ),
        # a checkpoint after update 1: its ~1e30 weights (finite, overflowing) are refused, not written
        (["--num_ppo_epochs", "1", "--save_steps", "1"], 1, "save", "tensor 'gpt_neox."),
    ],
)
def test_training_stops_at_the_first_non_finite_value(
    tiny: TinySetup, toy_data: Path, tmp_path: Path, flags: list[str], update: int, phase: str, what: str
) -> None:
    out = tmp_path / "out"
    proc = _train(tiny, toy_data, out, *flags)
    line = _one_error_line(proc)
    assert line.startswith(f"rloo train: error: update {update} of 3: "), line
    assert f"(phase {phase})" in line and what in line and "--learning_rate" in line, line
    # nothing a reader would take as a trained model, and no checkpoint of the diverged weights
    assert not (out / "training_complete.json").exists()
    assert not (out / "model.safetensors").exists()
    assert not list(out.glob("*checkpoint-*"))
    if phase not in ("loss", "grad norm"):
        # update 1 finished: its metrics are kept (the other cases failed inside update 1, before any output)
        rows = [json.loads(r) for r in (out / "metrics.jsonl").read_text().splitlines()]
        assert [r["update"] for r in rows] == [1]
    else:
        assert not out.exists()
