"""Every Dockerfile under images/, read as the builders read it: each image builds from the one plain
Debian/Python base (no base image that only a vendor's registry serves), the CUDA images take torch, the
CUDA compiler and vLLM from PyPI in one layer they share, and torch is PyPI's CUDA build even where a mirror
offers a CPU one beside it."""

from __future__ import annotations

import importlib.util
import re
import subprocess
from pathlib import Path

import pytest
from packaging.specifiers import Specifier
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
IMAGES = ROOT / "images"
DOCKERFILES = sorted({*IMAGES.glob("**/Dockerfile"), *IMAGES.glob("**/*.Dockerfile")})
# Docker Hub's official python image, Debian bookworm, slim: published by Docker for every registry mirror
# to carry; everything on top of it comes from Debian's archive and PyPI.
PLAIN_BASE = re.compile(r"(docker\.io/)?(library/)?python:3\.\d+(\.\d+)?-slim-bookworm")
CUDA_IMAGES = ("train", "eval")

_spec = importlib.util.spec_from_file_location("images_build", IMAGES / "build.py")
assert _spec and _spec.loader
build = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(build)


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, its arguments) in order: comment lines dropped, backslash-continued lines joined."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in text.splitlines():
        if line.lstrip().startswith("#") or not (pending or line.strip()):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        op, _, args = (pending + line).strip().partition(" ")
        out.append((op.upper(), " ".join(args.split())))
        pending = ""
    return out


def expand(word: str, args: dict[str, str]) -> str:
    """``$NAME``, ``${NAME}`` and ``${NAME:-default}`` replaced from ``args`` (an unknown name: empty)."""

    def one(m: re.Match[str]) -> str:
        name = m["braced"] or m["bare"]
        value = args.get(name, "")
        return value if value or m["default"] is None else m["default"]

    pattern = r"\$(?:\{(?P<braced>\w+)(?::-(?P<default>[^}]*))?\}|(?P<bare>\w+))"
    return re.sub(pattern, one, word)


def bases(text: str) -> list[str]:
    """The images a Dockerfile builds FROM when no build argument is given: each FROM's name expanded with
    the defaults of the ARGs declared before the first FROM; a FROM naming an earlier stage is not a base."""
    meta: dict[str, str] = {}
    stages: set[str] = set()
    found: list[str] = []
    seen_from = False
    for op, args in instructions(text):
        if op == "ARG" and not seen_from:
            name, _, default = args.partition("=")
            meta[name] = default
        elif op == "FROM":
            seen_from = True
            words = [w for w in args.split() if not w.startswith("--")]  # --platform=...
            ref = expand(words[0], meta)
            if ref not in stages:
                found.append(ref)
            if len(words) == 3 and words[1].lower() == "as":
                stages.add(words[2])
    return found


def test_the_reader_follows_from_and_its_args() -> None:
    """The reader itself, on the forms the Dockerfile reference allows: ARG defaults before FROM, braces,
    a default in the expansion, --platform, a stage named and built upon."""
    text = (
        "ARG REG=mirror.corp\nARG TAG\n# FROM ignored:comment\n"
        "FROM --platform=$BUILDPLATFORM ${REG}/python:3.11-slim-bookworm AS deps\nRUN true \\\n  && true\n"
        "FROM deps AS again\nFROM $REG/library/python:${TAG:-3.11}-slim-bookworm\nCOPY --from=deps /x /x\n"
    )
    assert bases(text) == [
        "mirror.corp/python:3.11-slim-bookworm",
        "mirror.corp/library/python:3.11-slim-bookworm",
    ]
    assert ("RUN", "true && true") in instructions(text)


def test_every_dockerfile_is_read() -> None:
    names = {p.relative_to(IMAGES).as_posix() for p in DOCKERFILES}
    assert {"slim/Dockerfile", "train/Dockerfile", "eval/Dockerfile", "train/cpu.Dockerfile"} <= names


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.relative_to(IMAGES).as_posix())
def test_every_image_builds_from_the_plain_python_base(path: Path) -> None:
    """Each FROM, as BuildKit resolves it without build arguments (the ARGs before the first FROM are the
    meta args, expanded into each stage's base name with their defaults: ``moby/buildkit
    frontend/dockerfile/instructions/parse.go`` ``Parse``, ``frontend/dockerfile/dockerfile2llb/convert.go``
    ``buildMetaArgs`` and ``buildDispatchStates``), names Docker Hub's python slim-bookworm image: a base
    any registry mirror carries, where a vendor's CUDA or vLLM image (pytorch/pytorch, vllm/vllm-openai,
    nvcr.io) is served by that vendor alone. The stand-in base of images/ci is the exception: it is built
    from a debootstrap root filesystem that images/build.py imports locally, no registry at all."""
    found = bases(path.read_text())
    assert found, f"{path}: no FROM"
    if path.parent.name == "ci":
        assert found == [build.CI_DEBIAN], found
        return
    for ref in found:
        assert PLAIN_BASE.fullmatch(ref), f"{path.relative_to(ROOT)}: FROM {ref} is not the plain python base"


def test_all_images_share_one_base() -> None:
    """One base to mirror and patch: the CUDA images build on exactly the slim image's base."""
    found = {ref for p in DOCKERFILES if p.parent.name != "ci" for ref in bases(p.read_text())}
    assert len(found) == 1, found


def test_the_cuda_images_share_their_cuda_layer() -> None:
    """train and eval run the same instructions up to and including the one that installs the CUDA stack
    (images/cuda_stack.sh), so that layer is one: a builder reuses a layer when every instruction before
    it and the instruction itself match (``containers/buildah imagebuildah/stage_executor.go``
    ``historyAndDiffIDsMatch``: the base's history and diff IDs, then the instruction's created-by), a
    registry stores the blob once and a node that pulls both images downloads it once."""
    prefixes = []
    for name in CUDA_IMAGES:
        steps = instructions((IMAGES / name / "Dockerfile").read_text())
        stack = [i for i, (op, args) in enumerate(steps) if op == "RUN" and "images/cuda_stack.sh" in args]
        assert len(stack) == 1, f"{name}: expected one RUN of images/cuda_stack.sh"
        prefixes.append(steps[: stack[0] + 1])
        # the package and its extras come after the shared layer: a pyproject change leaves it cached
        assert [op for op, args in steps[: stack[0]] if "pyproject.toml" in args] == [], name
    assert prefixes[0] == prefixes[1]


def _torch_requirement() -> str:
    """The requirement images/cuda_stack.sh installs torch by, with the pin of constraints.txt in place of
    its variable."""
    script = (IMAGES / "cuda_stack.sh").read_text()
    (line,) = [ln for ln in script.splitlines() if re.match(r"\s*pip install .*\"torch", ln)]
    (requirement,) = re.findall(r'"(torch[^"]+)"', line)
    pin = re.search(r"^torch==(\S+)$", (ROOT / "constraints.txt").read_text(), flags=re.M)
    assert pin and "$torch" in requirement
    assert re.search(r"torch=\$\(sed -n 's/\^torch==//p' constraints.txt\)", script)
    return requirement.replace("$torch", pin[1])


def test_torch_is_pypis_cuda_build_even_beside_a_local_cpu_build() -> None:
    """PyPI's torch wheel of the pin is the CUDA 13 build; a mirror or a find-links directory may offer
    ``<pin>+cpu`` beside it (this machine's does). PEP 440's ``==`` ignores a candidate's local label, so
    both match, and pip takes the highest version, which is the local one: ``pypa/packaging
    src/packaging/specifiers.py`` (``Specifier.contains``/``filter``: ``===`` compares the whole string,
    ``==`` matches without the local label). The images ask for the exact string."""
    requirement = _torch_requirement()
    spec = Specifier(requirement.removeprefix("torch"))
    pin = spec.version
    offered = [pin, f"{pin}+cpu", f"{pin}+cu126"]
    assert list(spec.filter(offered)) == [pin]
    # what a plain == would have installed
    assert max(Specifier(f"=={pin}").filter(offered), key=Version) != pin


def test_the_cuda_stack_checks_what_it_installed() -> None:
    """A dependency that swaps torch for another build fails the build, not the first GPU step."""
    script = (IMAGES / "cuda_stack.sh").read_text()
    assert script.index("torch.version.cuda") > script.rindex("pip install")
    assert re.search(r'pip install -c /tmp/constraints.txt "vllm==\$vllm"', script)
    assert "vllm=$(sed -n 's/^vllm==//p' constraints-vllm.txt)" in script


def test_the_cuda_images_have_their_own_make_target_outside_ci() -> None:
    """``make images-cuda`` builds train and eval and checks them; CI (.ci/run) does not run it."""
    dry = subprocess.run(
        ["make", "-n", "--no-print-directory", "images-cuda"], cwd=ROOT, capture_output=True, text=True
    )
    assert dry.returncode == 0, dry.stderr
    builds = [line for line in dry.stdout.splitlines() if "images/build.py" in line]
    assert len(builds) == 1 and builds[0].split()[-2:] == ["train", "eval"], dry.stdout
    assert "tests/images/test_cuda_images.py" in dry.stdout
    assert "images-cuda" not in (ROOT / ".ci" / "run").read_text()
