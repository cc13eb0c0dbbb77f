"""The vLLM releases the project allows can be installed with the project's pins.

A real resolve of the `vllm` extra downloads GBs (PyPI serves vLLM's and torch's metadata only inside the
wheels, so pip fetches whole CUDA wheels to read it). Instead the Requires-Dist of every vLLM release around
the allowed range is stored in tests/fixtures/vllm_metadata/ (copied from the wheels' METADATA) and checked
here against the pins the vLLM images install: constraints.txt with constraints-vllm.txt in place of its
pins, as images/merge_constraints.py builds them. The one network test (PyPI, skipped offline) checks that
the fixtures are complete and true to the wheels.
"""

from __future__ import annotations

import importlib.util
import io
import json
import re
import sys
import urllib.error
import urllib.request
import zipfile
from pathlib import Path
from typing import Any

import pytest
import tomllib
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "vllm_metadata"


def _merge_module() -> Any:
    spec = importlib.util.spec_from_file_location(
        "merge_constraints", ROOT / "images" / "merge_constraints.py"
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["merge_constraints"] = module
    spec.loader.exec_module(module)
    return module


mc = _merge_module()

# Where the images run vLLM: Linux x86_64, the vLLM image's Python (3.12).
IMAGE_ENV = {**default_environment(), "sys_platform": "linux", "platform_system": "Linux"}
IMAGE_ENV |= {"platform_machine": "x86_64", "python_version": "3.12", "python_full_version": "3.12.3"}


def vllm_extra() -> SpecifierSet:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    (req,) = [Requirement(r) for r in extras["vllm"]]
    assert req.name == "vllm"
    return req.specifier


def image_pins() -> dict[str, str]:
    """The pins the vLLM images install with (torch included: vLLM needs the base image's to be 2.13.0)."""
    merged = mc.merge((ROOT / "constraints.txt").read_text(), (ROOT / "constraints-vllm.txt").read_text())
    return mc.pins(merged)


def fixture_versions() -> dict[Version, Path]:
    return {Version(p.name.removeprefix("vllm-").removesuffix(".METADATA")): p for p in FIXTURES.iterdir()}


def requirements(metadata: str) -> list[Requirement]:
    """vLLM's install requirements on the image's platform (no extras)."""
    reqs = [
        Requirement(line.split(":", 1)[1])
        for line in metadata.splitlines()
        if line.startswith("Requires-Dist:")
    ]
    return [r for r in reqs if r.marker is None or r.marker.evaluate({**IMAGE_ENV, "extra": ""})]


def conflicts(metadata: str, pins: dict[str, str]) -> list[str]:
    """Requirements of one vLLM release that a pin violates: "name==pin vs requirement"."""
    out = []
    for req in requirements(metadata):
        pin = pins.get(mc.canonical(req.name))
        if pin is not None and not req.specifier.contains(pin, prereleases=True):
            out.append(f"{req.name}=={pin} vs {req}")
    return out


def test_merge_replaces_pins_instead_of_adding_a_second_one() -> None:
    merged = mc.merge(
        "# c\ntorch==2.13.0\nFastAPI==0.165.0\nrich==15.0.0\n", "fastapi==0.136.3\n", ("torch",)
    )
    assert mc.pins(merged) == {"fastapi": "0.136.3", "rich": "15.0.0"}
    assert merged.startswith("# c\n")


def test_every_allowed_release_has_its_metadata_stored() -> None:
    allowed = [v for v in fixture_versions() if vllm_extra().contains(v)]
    assert allowed, "no stored metadata inside the vllm extra's range"
    # the fixtures bracket the range, so a release added to it cannot go unchecked
    assert min(fixture_versions()) < min(allowed) and max(fixture_versions()) > max(allowed)


@pytest.mark.parametrize("version", sorted(fixture_versions()), ids=str)
def test_allowed_releases_accept_the_image_pins(version: Version) -> None:
    bad = conflicts(fixture_versions()[version].read_text(), image_pins())
    if vllm_extra().contains(version):
        assert bad == [], f"vllm {version} is allowed by the vllm extra but conflicts: {bad}"
    else:
        # what keeps it out of the range: if it no longer conflicts, the range can be widened
        assert bad, f"vllm {version} installs with the pins: consider allowing it"


def test_the_pinned_vllm_is_allowed_and_the_images_use_it() -> None:
    pinned = image_pins()["vllm"]
    assert vllm_extra().contains(pinned)
    assert Version(pinned) in fixture_versions()
    # the images install vLLM from PyPI at the pin (images/cuda_stack.sh, the layer both share)
    stack = (ROOT / "images" / "cuda_stack.sh").read_text()
    assert "vllm=$(sed -n 's/^vllm==//p' constraints-vllm.txt)" in stack and '"vllm==$vllm"' in stack
    for name in ("eval", "train"):
        text = (ROOT / "images" / name / "Dockerfile").read_text()
        assert "sh images/cuda_stack.sh" in text, name
        assert "merge_constraints.py constraints.txt constraints-vllm.txt" in text, name
        assert re.search(r"'\.\[[a-z,]*vllm[a-z,]*\]'", text), f"{name} image does not install the vllm extra"


def test_plain_constraints_would_conflict() -> None:
    """Why constraints-vllm.txt exists: constraints.txt alone breaks every allowed vLLM (fastapi)."""
    plain = mc.pins((ROOT / "constraints.txt").read_text())
    for version, path in fixture_versions().items():
        if vllm_extra().contains(version):
            assert any(c.startswith("fastapi==") for c in conflicts(path.read_text(), plain))


def test_the_project_extras_accept_the_image_pins() -> None:
    """The extras the vLLM images install allow the pins they get (fastapi comes in through mlflow-skinny)."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    pins = image_pins()
    for extra in ("train", "eval", "tracking", "kfp", "vllm"):
        for req in map(Requirement, extras[extra]):
            pin = pins.get(mc.canonical(req.name))
            if pin is not None:
                assert req.specifier.contains(pin, prereleases=True), f"[{extra}] {req} vs =={pin}"


# ------------------------------------------------------------------------------------------------------
# against PyPI (a package registry): the stored metadata is complete and true to the wheels
def _get(url: str, headers: dict[str, str] | None = None) -> bytes:
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=30) as r:
        return r.read()


class _RangeFile(io.RawIOBase):
    """A remote file read with HTTP range requests: zipfile reads the wheel's directory and one member."""

    def __init__(self, url: str, size: int) -> None:
        self.url, self.size, self.pos = url, size, 0

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = {0: offset, 1: self.pos + offset, 2: self.size + offset}[whence]
        return self.pos

    def readinto(self, buf: Any) -> int:
        end = min(self.size, self.pos + len(buf)) - 1
        if end < self.pos:
            return 0
        data = _get(self.url, {"Range": f"bytes={self.pos}-{end}"})
        buf[: len(data)] = data
        self.pos += len(data)
        return len(data)


@pytest.fixture(scope="module")
def pypi_files() -> list[dict[str, Any]]:
    try:
        index = _get("https://pypi.org/simple/vllm/", {"Accept": "application/vnd.pypi.simple.v1+json"})
    except (urllib.error.URLError, OSError) as exc:
        pytest.skip(f"PyPI not reachable: {exc}")
    return json.loads(index)["files"]


def test_stored_metadata_covers_every_release_in_range(pypi_files: list[dict[str, Any]]) -> None:
    released = {Version(f["filename"].split("-")[1]) for f in pypi_files if f["filename"].endswith(".whl")}
    in_range = {v for v in released if vllm_extra().contains(v)}
    assert in_range <= set(fixture_versions()), (
        f"store the METADATA of {sorted(in_range - set(fixture_versions()))}"
    )


def test_stored_metadata_of_the_pin_matches_the_wheel(pypi_files: list[dict[str, Any]]) -> None:
    pinned = image_pins()["vllm"]
    name = f"vllm-{pinned}-cp38-abi3-manylinux_2_28_x86_64.whl"
    (entry,) = [f for f in pypi_files if f["filename"] == name]
    wheel = zipfile.ZipFile(io.BufferedReader(_RangeFile(entry["url"], int(entry["size"])), 1 << 16))
    member = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
    live = [r for r in wheel.read(member).decode().splitlines() if r.startswith("Requires-Dist:")]
    stored = [
        r
        for r in fixture_versions()[Version(pinned)].read_text().splitlines()
        if r.startswith("Requires-Dist:")
    ]
    assert stored == live
