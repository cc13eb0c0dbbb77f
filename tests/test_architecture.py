"""The import-linter contracts of pyproject.toml hold: dependencies point one way (cli/components -> pipeline
-> stages -> k8s/eval/push/training -> shared -> algo), rloo.algo imports nothing from rloo, rloo.k8s nothing
about RL, no package's modules import each other in a circle, and no production module imports the demo
fixtures. ``make lint`` runs the same check as ``lint-imports``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = ROOT / "pyproject.toml"


def _contracts() -> list[dict]:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    return tomllib.loads(PYPROJECT.read_text())["tool"]["importlinter"]["contracts"]


def test_import_contracts_hold() -> None:
    # A subprocess: lint_imports() reconfigures logging (dictConfig), which would disable this process's
    # loggers for the tests after it. This checkout's src/ and root (components/, pipelines/) come first.
    path = os.pathsep.join([str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")])
    code = "import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports(no_cache=True))"
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_every_rloo_module_is_in_a_layer() -> None:
    """A new top-level module or package of rloo has to be placed in a layer, or nothing checks it."""
    (layers,) = [c for c in _contracts() if c["type"] == "layers"]
    placed = {m.strip() for layer in layers["layers"] for m in layer.replace("|", ":").split(":")}
    src = ROOT / "src" / "rloo"
    modules = {f"rloo.{p.stem}" for p in src.glob("*.py") if p.stem not in {"__init__", "py"}}
    modules |= {f"rloo.{p.parent.name}" for p in src.glob("*/__init__.py")}
    assert modules - placed == set()


def test_no_import_is_exempted() -> None:
    """No arrow is exempted from the layers: a new exemption needs a reason, not just an entry here."""
    (layers,) = [c for c in _contracts() if c["type"] == "layers"]
    assert layers.get("ignore_imports", []) == []
