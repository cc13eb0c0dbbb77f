"""The import-linter contracts of pyproject.toml hold: dependencies point one way (cli/components -> pipeline
-> stages -> k8s/eval/push/training -> shared -> algo), rloo.algo imports nothing from rloo, rloo.k8s nothing
about RL, no package's modules import each other in a circle, and no production module imports the demo
fixtures. ``make lint`` runs the same check as ``lint-imports``."""

from __future__ import annotations

import os
import re
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


# A name or comment that points at the project's history (an issue number, a "round" of work) says nothing
# about what the code does; name the concept instead. Written so that the pattern itself does not match.
_HISTORY_NAME = re.compile(r"round[ _-]?two|(?<![a-z])issue[ _-]?\d+", re.IGNORECASE)


_TEXT_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".toml", ".txt", ".sh", ".tpl", ".cfg", ".ini", ".json"}


def _tracked_text_files() -> list[Path]:
    """Every text file of the checkout as git tracks it (code, tests, benchmarks, components, the chart, the
    images, docs; build output, caches and virtual environments are not the project's); without git, every
    file but .git's and the virtual environments'."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True
        ).stdout.decode()
        paths = [ROOT / name for name in listed.split("\0") if name]
    except (OSError, subprocess.CalledProcessError):
        paths = [
            p
            for p in ROOT.rglob("*")
            if not {".git", ".venv"} & {part.split("-")[0] for part in p.relative_to(ROOT).parts}
        ]
    return [
        p
        for p in paths
        if p.is_file() and (p.suffix in _TEXT_SUFFIXES or p.name in {"Makefile", "Dockerfile", "run"})
    ]


def test_no_name_or_comment_refers_to_an_issue_or_a_round() -> None:
    """Identifiers, test names, comments and docs say what a thing is, never which issue or round of work
    brought it (the developers' guide). Case-insensitive, in every spelling: words apart, joined by '_' or
    '-', or inside a longer identifier such as a test's name."""
    hits = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()[:80]}"
        for path in _tracked_text_files()
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
        if _HISTORY_NAME.search(line)
    ]
    assert hits == [], "\n".join(hits)


# The pipeline's steps, one module each in rloo.stages; what they share lives in the other modules there
STEP_MODULES = ("fetch", "validate", "train", "evaluate", "push", "finish")
COMPONENT_MAX_LINES = 40  # a component unpacks KFP's types around one step call; its work is in rloo.stages


def _stage_imports(path: Path) -> set[str]:
    """The rloo.stages modules ``path`` imports, at module level or inside a function."""
    import ast

    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == "rloo.stages":
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("rloo.stages."):
            found.add(str(node.module).split(".")[2])
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[2] for a in node.names if a.name.startswith("rloo.stages.")}
    return found


def test_steps_stand_on_one_floor() -> None:
    """No step module of rloo.stages imports another (what two steps share is a module of its own, such as
    rloo.stages.sft or rloo.stages.context), and every KFP component but the generated validate one stays
    thin: KFP serializes the component function's own source into the pipeline
    (kubeflow/pipelines sdk/python/kfp/dsl/component_factory.py, _get_function_source_definition), so its
    logic belongs in rloo.stages, where it is tested as library code."""
    stages = ROOT / "src" / "rloo" / "stages"
    crossed = {
        name: sorted(_stage_imports(stages / f"{name}.py") & (set(STEP_MODULES) - {name}))
        for name in STEP_MODULES
    }
    assert {k: v for k, v in crossed.items() if v} == {}
    components = sorted((ROOT / "components").glob("*/component.py"))
    assert len(components) >= 6
    long = {
        str(f.relative_to(ROOT)): n
        for f in components
        if f.parent.name != "validate" and (n := len(f.read_text().splitlines())) > COMPONENT_MAX_LINES
    }
    assert long == {}


# A module's basename says what it is, so that a traceback, a `git log -- '*/name.py'` or an import read alone
# names one thing. A package may have its own of these (its typed settings, its entry point, its errors).
PER_PACKAGE_BASENAMES = {"__init__.py", "config.py", "runner.py", "errors.py"}
# The names still shared, each path listed: a new module of one of these names is refused too. Each pair is two
# different things of the same word (KFP's parameters and MLflow's params, torch.compile and the KFP compiler,
# ...), kept until they are renamed.
SHARED_BASENAMES = {
    "base.py": {"parsing/base.py", "tracking/base.py"},
    "compile.py": {"pipeline/compile.py", "training/compile.py"},
    "data.py": {"data.py", "eval/data.py"},
    "generation.py": {"generation.py", "eval/generation.py"},
    "hub.py": {"push/hub.py", "storage/hub.py"},
    "images.py": {"k8s/images.py", "pipeline/images.py"},
    "params.py": {"pipeline/params.py", "tracking/params.py"},
    "rewards.py": {"algo/rewards.py", "training/rewards.py"},
}


def test_no_two_modules_share_a_basename() -> None:
    """No two modules of rloo have the same file name, but a package's own __init__/config/runner/errors and
    the pairs of SHARED_BASENAMES (renaming one of them shrinks the list): a new duplicate fails here."""
    src = ROOT / "src" / "rloo"
    by_name: dict[str, set[str]] = {}
    for path in src.rglob("*.py"):
        by_name.setdefault(path.name, set()).add(path.relative_to(src).as_posix())
    shared = {
        name: paths
        for name, paths in by_name.items()
        if len(paths) > 1
        and name not in PER_PACKAGE_BASENAMES
        and not paths <= SHARED_BASENAMES.get(name, set())
    }
    assert shared == {}


# Classes over MAX_CLASS_LINES body lines, kept until they are split (none today). The list can only shrink.
MAX_CLASS_LINES = 600
LONG_CLASSES: set[str] = set()


def _class_body_lines() -> dict[str, int]:
    import ast

    src = ROOT / "src" / "rloo"
    sizes = {}
    for path in src.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ClassDef):
                end = node.end_lineno or node.body[-1].lineno
                sizes[f"{path.relative_to(src).as_posix()}::{node.name}"] = end - node.body[0].lineno + 1
    return sizes


def test_no_class_is_over_the_size_limit() -> None:
    """No class of rloo has more than MAX_CLASS_LINES body lines (the trainer's work lives in parts with
    their own interfaces: producing experience, the update, preemption, the step timer), but the ones listed
    in LONG_CLASSES; an entry that has come under the limit fails too, so that the list shrinks."""
    sizes = _class_body_lines()
    over = {name: n for name, n in sizes.items() if n > MAX_CLASS_LINES}
    assert set(over) - LONG_CLASSES == set(), over
    assert LONG_CLASSES - set(over) == set(), "under the limit now: drop from LONG_CLASSES"


def test_the_trainer_module_stays_small() -> None:
    """``training/trainer.py`` wires the run together (set-up, the loop, checkpoints, reports) in at most 900
    lines; what one update produces and how it is consumed live in ``experience.py`` and ``update.py``."""
    lines = (ROOT / "src" / "rloo" / "training" / "trainer.py").read_text().splitlines()
    assert len(lines) <= 900, len(lines)
