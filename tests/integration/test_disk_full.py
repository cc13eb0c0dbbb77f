"""A disk that fills up during a checkpoint, the final save or the plot: one line naming the path and the
space needed, a non-zero exit, and nothing half-written where a reader would take it.

The disk is real: ``rloo train`` runs in a user + mount namespace (``unshare -rm``, no root needed) whose
``output_dir`` is a tmpfs of a chosen size, so the writers meet a genuine ENOSPC. The sizes come from a
reference run on an ordinary disk, so each case fills up exactly at the step under test.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from rloo.demo.tiny import TinySetup
from tests.fixtures import recipes, zygote

LISTING = "=== files ==="


def _can_mount() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        [
            "unshare",
            "-rm",
            "sh",
            "-c",
            "mount -t tmpfs -o size=64k tmpfs /mnt || mount -t tmpfs -o size=64k tmpfs /tmp",
        ],
        capture_output=True,
    )
    return probe.returncode == 0


pytestmark = pytest.mark.skipif(
    not _can_mount(), reason="needs unprivileged user+mount namespaces (unshare -rm) for a real small tmpfs"
)


def _flags(tiny: TinySetup, data: Path, out: Path, save_steps: int) -> list[str]:
    return recipes.argv(tiny, data, out, max_steps=2, save_steps=save_steps, seed=1)


@dataclass
class Run:
    returncode: int
    stderr: str
    files: dict[str, int]  # path under output_dir -> size (directories end with '/')


def _train_on_small_disk(flags: list[str], out: Path, kib: int) -> Run:
    """``rloo train`` with ``out`` a ``kib``-KiB tmpfs; what it left there is listed before the namespace goes."""
    out.mkdir(parents=True)
    script = (
        'mount -t tmpfs -o size="$1"k tmpfs "$2" || exit 99; shift 2; "$@"; rc=$?; '
        f'echo "{LISTING}"; cd "$OUT" && find . -mindepth 1 -printf "%y %s %P\\n"; exit $rc'
    )
    proc = subprocess.run(
        ["unshare", "-rm", "sh", "-c", script, "sh", str(kib), str(out), sys.executable, "-m", "rloo.cli",
         "train", *flags],
        env={**recipes.subprocess_env(), "OUT": str(out)}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode != 99, proc.stderr
    files = {}
    for line in proc.stdout.split(LISTING, 1)[1].splitlines():
        if line.strip():
            kind, size, name = line.split(" ", 2)
            files[name + ("/" if kind == "d" else "")] = int(size)
    return Run(proc.returncode, proc.stderr, files)


@pytest.fixture(scope="module")
def sizes(tiny: TinySetup, toy_data: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, int]:
    """Bytes each part of a complete run takes, from the same run on an ordinary disk."""
    out = tmp_path_factory.mktemp("reference") / "out"
    proc = zygote.run(
        ["-m", "rloo.cli", "train", *_flags(tiny, toy_data, out, save_steps=1)], env=recipes.subprocess_env()
    )
    assert proc.returncode == 0, proc.stderr

    def du(paths: list[Path]) -> int:  # tmpfs charges whole 4 KiB pages
        return sum(-(-p.stat().st_size // 4096) * 4096 for p in paths if p.is_file())

    top = [p for p in out.iterdir() if p.is_file()]
    return {
        "checkpoint": du(list((out / "checkpoint-1").iterdir())),
        "final": du([p for p in top if p.name != "metrics.jsonl"]),
        "metrics": du([out / "metrics.jsonl"]),
        "plot": du([out / "plots" / "training_curves.png"]),
    }


def _one_line(run: Run, what: str, out: Path) -> str:
    report = f"exit {run.returncode}\n--- stderr:\n{run.stderr}\n--- files: {run.files}"
    assert "Traceback" not in run.stderr, report
    assert run.returncode == 2, report
    errors = [line for line in run.stderr.splitlines() if line.startswith("rloo train: error:")]
    assert len(errors) == 1, report
    line = errors[0]
    assert line.startswith(f"rloo train: error: no space left on the disk of {out}"), line
    assert f"while writing {what}: it needs about " in line and "MiB free now" in line, line
    return line


def test_disk_full_at_a_checkpoint(
    tiny: TinySetup, toy_data: Path, tmp_path: Path, sizes: dict[str, int]
) -> None:
    out = tmp_path / "out"
    kib = (sizes["metrics"] + sizes["checkpoint"] // 2) // 1024
    run = _train_on_small_disk(_flags(tiny, toy_data, out, save_steps=1), out, kib)
    line = _one_line(run, "checkpoint checkpoint-1", out)
    assert str(out / "checkpoint-1") in line
    # the half-written checkpoint is gone (its space freed), and nothing names a finished model
    assert not any("checkpoint" in name for name in run.files), run.files
    assert "training_complete.json" not in run.files and "model.safetensors" not in run.files


def test_disk_full_at_the_final_save(
    tiny: TinySetup, toy_data: Path, tmp_path: Path, sizes: dict[str, int]
) -> None:
    out = tmp_path / "out"
    kib = (sizes["metrics"] + sizes["final"] // 2) // 1024
    run = _train_on_small_disk(_flags(tiny, toy_data, out, save_steps=0), out, kib)
    _one_line(run, "the final model", out)
    # no config.json without weights, no truncated weights, no marker: the directory holds no model
    # (the failed run's curves are still drawn when it closes, and fit: whole, never 0 bytes)
    assert set(run.files) <= {"metrics.jsonl", "plots/", "plots/training_curves.png"}, run.files
    assert run.files.get("plots/training_curves.png", 1) > 0


def test_disk_full_at_the_plot(
    tiny: TinySetup, toy_data: Path, tmp_path: Path, sizes: dict[str, int]
) -> None:
    out = tmp_path / "out"
    kib = (sizes["metrics"] + sizes["final"] + sizes["plot"] // 2) // 1024
    run = _train_on_small_disk(_flags(tiny, toy_data, out, save_steps=0), out, kib)
    _one_line(run, "the training-curve plot", out)
    assert "plots/training_curves.png" not in run.files  # not a 0-byte PNG
    assert not any(name.endswith(".tmp") for name in run.files), run.files
    # the model itself was complete before the plot: it is whole
    assert run.files["model.safetensors"] > 0 and "training_complete.json" in run.files
