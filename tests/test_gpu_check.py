"""benchmarks/gpu_check.sh, the one command for a bare GPU node, run here where there is no GPU: it installs
the wheels it is given into a scratch folder, records the environment, and each step says it skipped."""

from __future__ import annotations

import os
import subprocess
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "gpu_check.sh"


def _wheel(folder: Path) -> Path:
    """A minimal real wheel (a one-module package) that pip installs from a folder, offline."""
    folder.mkdir()
    path = folder / "gpucheckprobe-1.0-py3-none-any.whl"
    info = "gpucheckprobe-1.0.dist-info"
    files = {
        "gpucheckprobe.py": "VALUE = 42\n",
        f"{info}/METADATA": "Metadata-Version: 2.1\nName: gpucheckprobe\nVersion: 1.0\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files[f"{info}/RECORD"] = "".join(f"{name},,\n" for name in [*files, f"{info}/RECORD"])
    with zipfile.ZipFile(path, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
    return path


@pytest.mark.slow
def test_gpu_check_without_a_gpu(tmp_path: Path) -> None:
    wheels, out = tmp_path / "wheels", tmp_path / "out"
    _wheel(wheels)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHON": str(Path(os.sys.executable))}
    proc = subprocess.run(
        [str(SCRIPT), str(wheels), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    environment = (out / "environment.txt").read_text()
    assert "wheels installed from the folder: gpucheckprobe==1.0" in environment
    assert not (out / "site").exists()  # the output folder holds results only
    assert "torch: " in environment and "available: False" in environment
    assert "skipped" in (out / "gpu-tests.log").read_text()  # pytest -m gpu ran and skipped
    assert (out / "gpu-tests.xml").is_file()
    assert (out / "bench.md").read_text().strip() == "no GPU: skipped"
    assert (out / "bench-compiled.md").read_text().strip() == "no GPU: skipped"


def test_gpu_check_refuses_a_broken_wheel_folder(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "broken-1.0-py3-none-any.whl").write_bytes(b"not a zip")
    proc = subprocess.run(
        [str(SCRIPT), str(wheels), str(tmp_path / "out")],
        env={**os.environ, "PYTHON": os.sys.executable},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == f"gpu_check: installing the wheels in {wheels} failed"
