"""The client install: a machine that only talks to Kubeflow Pipelines compiles, checks parameters and submits
without PyTorch (``pip install -e '.[client]'``), while every install that runs models still gets it.

What the client resolves to is read as pip reads it: pyproject's ``dependencies`` and the ``client`` extra, then
each distribution's installed metadata (``Requires-Dist`` with its markers, pypa/packaging
``src/packaging/markers.py``). The commands then run in a subprocess where every installed package *outside*
that set is unimportable (``None`` in ``sys.modules``, which ``importlib.util.find_spec`` reports as missing:
transformers' ``is_torch_available`` asks exactly that, huggingface/transformers
``src/transformers/utils/import_utils.py`` ``_is_package_available``), against the stand-in of KFP's v2beta1
API that the real ``kfp.Client`` calls (``create_experiment`` lists experiments by display name, then
``run_pipeline`` posts the run: kubeflow/pipelines ``sdk/python/kfp/client/client.py``).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.fixtures.kfp_api import kfp_api

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
EXAMPLE = ROOT / "pipelines" / "params.example.yaml"


def _own_requirements(extras: set[str]) -> list[Requirement]:
    reqs = list(PROJECT["dependencies"])
    for extra in sorted(extras):
        reqs += PROJECT["optional-dependencies"][extra]
    return [Requirement(r) for r in reqs]


def resolve(extras: set[str]) -> tuple[set[str], set[str]]:
    """The distributions ``pip install '.[extras]'`` brings, by canonical name, and those of them not installed
    here (whose own requirements are therefore unknown)."""
    own = canonicalize_name(PROJECT["name"])
    queue, own_done = _own_requirements(extras), set(extras)
    seen: set[tuple[str, frozenset[str]]] = set()
    names: set[str] = set()
    missing: set[str] = set()
    while queue:
        req = queue.pop()
        name = canonicalize_name(req.name)
        if name == own:  # an extra naming others of the project's extras ('rloo-kfp[kfp]')
            queue += _own_requirements(req.extras - own_done)
            own_done |= req.extras
            continue
        if (name, frozenset(req.extras)) in seen:
            continue
        seen.add((name, frozenset(req.extras)))
        names.add(name)
        try:
            requires = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            missing.add(name)
            continue
        for r in map(Requirement, requires):
            if r.marker is None or any(r.marker.evaluate({"extra": e}) for e in req.extras | {""}):
                queue.append(r)
    return names, missing


def test_the_client_extra_brings_no_torch() -> None:
    client, missing = resolve({"client"})
    assert "kfp" in client and "transformers" in client  # what it is for: KFP's SDK and the config parsers
    assert missing == set(), "the client's requirements are installed here, so the resolution is complete"
    assert "torch" not in client


def _installs() -> list[tuple[str, set[str]]]:
    """Every ``pip install ... '.[extras]'`` of the Makefile and the images' Dockerfiles."""
    found = []
    for path in [ROOT / "Makefile", *sorted((ROOT / "images").rglob("*Dockerfile"))]:
        for extras in re.findall(r"'\.\[([a-z,]+)\]'", path.read_text()):
            found.append((str(path.relative_to(ROOT)), set(extras.split(","))))
    return found


def test_every_install_that_ran_models_still_gets_torch() -> None:
    """The Makefile's venvs and the images got torch from the core dependencies before; now from their extras
    (the slim image's stages too: push and validate load torch for their weight and model checks)."""
    installs = _installs()
    assert {p for p, _ in installs} >= {"Makefile", "images/slim/Dockerfile", "images/train/cpu.Dockerfile"}
    for path, extras in installs:
        if extras == {"bench"}:  # `make bench` installs into the venv of `make install` (its prerequisite)
            continue
        assert "torch" in resolve(extras)[0], f"{path}: '.[{','.join(sorted(extras))}]' brings no torch"


def _outside_the_client() -> list[str]:
    """Top-level import names of the installed distributions the client does not bring."""
    client = resolve({"client"})[0] | {canonicalize_name(PROJECT["name"])}
    blocked = {
        top
        for top, dists in importlib.metadata.packages_distributions().items()
        if not {canonicalize_name(d) for d in dists} & client
    }
    assert "torch" in blocked and "mlflow" in blocked  # installed here, for the tests of the stages
    return sorted(blocked)


# Runs one `rloo` command with the packages outside the client unimportable; says what of torch got loaded.
PRELUDE = """
import json, os, sys
sys.modules.update(dict.fromkeys(json.loads(os.environ["BLOCKED"])))
from rloo.cli import main
code = main(sys.argv[1:])
print("torch in sys.modules:", sys.modules.get("torch") is not None, file=sys.stderr)
sys.exit(code)
"""


def _rloo(*argv: str, blocked: list[str]) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "AWS_", "S3_"))}
    env["BLOCKED"] = json.dumps(blocked)
    env["RLOO_REPO_ROOT"] = str(ROOT)
    proc = subprocess.run(
        [sys.executable, "-c", PRELUDE, *argv],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert "torch in sys.modules: False" in proc.stderr, proc.stderr
    return proc


def test_compile_check_and_submit_without_torch(tmp_path: Path) -> None:
    blocked = _outside_the_client()
    out = tmp_path / "rloo_pipeline.yaml"
    proc = _rloo("pipeline", "compile", "--output", str(out), blocked=blocked)
    assert proc.returncode == 0, proc.stderr
    spec = yaml.safe_load_all(out.read_text())
    assert next(spec)["pipelineInfo"]["name"] == "rloo-rlhf"

    # the configs' own checks run before anything is contacted: the parameter in one line, exit 2
    proc = _rloo("pipeline", "submit", "--host", "http://127.0.0.1:9", "--params", str(EXAMPLE),
                 "--param", "rloo_k=1", blocked=blocked)  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "rloo_k must be >= 2" in proc.stderr and "Traceback" not in proc.stderr

    with kfp_api() as api:
        proc = _rloo("pipeline", "submit", "--host", api.url, "--params", str(EXAMPLE), blocked=blocked)
        assert proc.returncode == 0, proc.stderr
        (run,) = api.runs
    example: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    assert run["runtime_config"]["parameters"]["model"] == example["model"]
    assert run["pipeline_version_reference"]["pipeline_version_id"] == api.pipelines[0].versions[0]["id"]
    assert "started run rloo-rlhf-" in proc.stdout and "/#/runs/details/r0" in proc.stdout

    proc = _rloo("pipeline", "manifest", "--param", "num_nodes=2", blocked=blocked)
    assert proc.returncode == 0, proc.stderr
    assert yaml.safe_load(proc.stdout)["kind"] == "TrainJob"


def test_a_command_that_runs_models_says_what_to_install(tmp_path: Path) -> None:
    """Without torch, ``rloo train`` parses its flags (so --help works) and then stops in one line."""
    argv = ["--model_name_or_path", "m", "--dataset_name", "d", "--output_dir", str(tmp_path / "out")]
    argv += ["--reward_funcs", "rloo.demo.toy:letter_reward"]
    proc = _rloo("train", *argv, blocked=["torch"])
    assert proc.returncode == 2, proc.stderr
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("rloo train:")]
    assert "needs PyTorch" in line and "'.[train]'" in line and "Traceback" not in proc.stderr


@pytest.mark.parametrize("package", ["rloo.algo", "rloo.eval", "rloo.push"])
def test_the_lazy_packages_export_what_they_list(package: str) -> None:
    """The packages whose names load on first use (so that importing their torch-free modules stays torch-free)
    give every listed name, the defining module's own object."""
    module = importlib.import_module(package)
    assert set(module.__all__) == set(module._WHERE)
    for name in module.__all__:
        defining = importlib.import_module(f"{package}.{module._WHERE[name]}")
        assert getattr(module, name) is getattr(defining, name)
