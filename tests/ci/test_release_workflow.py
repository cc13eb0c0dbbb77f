"""The release workflow (.github/workflows/release.yml) cannot run here; actionlint checks it, and every
project command it runs is parsed by that command's own parser (the container tests run the same commands:
build, push, record, SBOM, compile --images)."""

from __future__ import annotations

import importlib.util
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rloo.pipeline.images import FLAVOURS, IMAGE_EXTRAS

ROOT = Path(__file__).resolve().parents[2]
WORKFLOW = ROOT / ".github" / "workflows" / "release.yml"
_spec = importlib.util.spec_from_file_location("images_build", ROOT / "images" / "build.py")
assert _spec and _spec.loader
build = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(build)


def _commands() -> list[list[str]]:
    """Each command line of the workflow's run steps, as words (continuation lines joined)."""
    steps = yaml.safe_load(WORKFLOW.read_text())["jobs"]["images"]["steps"]
    lines = []
    for step in steps:
        script = step.get("run", "").replace("\\\n", " ")
        lines += [shlex.split(line, comments=True) for line in script.splitlines() if line.strip()]
    return [words for words in lines if words]


def test_actionlint_passes() -> None:
    actionlint = shutil.which("actionlint", path=str(Path(sys.executable).parent)) or shutil.which(
        "actionlint"
    )
    assert actionlint, "actionlint is missing: make install (the dev extra) installs it"
    proc = subprocess.run([actionlint, str(WORKFLOW)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_actionlint_can_fail(tmp_path: Path) -> None:
    broken = tmp_path / ".github" / "workflows" / "release.yml"
    broken.parent.mkdir(parents=True)
    broken.write_text(WORKFLOW.read_text().replace("runs-on: ubuntu-latest", "runs-on: [ubuntu-latest"))
    actionlint = shutil.which("actionlint", path=str(Path(sys.executable).parent)) or "actionlint"
    proc = subprocess.run([actionlint, str(broken)], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0


def test_every_image_is_built_pushed_recorded_and_given_its_sbom() -> None:
    builds = [words for words in _commands() if words[:2] == ["python", "images/build.py"]]
    built = set()
    for words in builds:
        args = build.make_parser().parse_args(words[2:])
        assert args.push and args.sbom and str(args.record) == "$RECORD", words
        built.update(args.names)
    assert built == {*IMAGE_EXTRAS, *FLAVOURS}


def test_the_pipeline_is_compiled_for_the_recorded_images() -> None:
    from rloo.cli.pipeline_cmd import build_parser

    (compile_,) = [words for words in _commands() if words[:3] == ["rloo", "pipeline", "compile"]]
    ns = build_parser().parse_args(compile_[2:])
    assert ns.images == "$RECORD" and ns.output
    (release,) = [words for words in _commands() if words[:3] == ["gh", "release", "create"]]
    assert ns.output in release and "$RECORD" in release and "dist/sbom/*.cdx.json" in release


@pytest.mark.parametrize("words", [w for w in _commands() if w[:3] == ["python", "-m", "pip"]])
def test_installs_use_the_pins(words: list[str]) -> None:
    assert any("constraints.txt" in w for w in words), words
