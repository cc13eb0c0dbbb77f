"""The CUDA images as built (``make images-cuda``): what a GPU step needs of them, checked without a GPU.

Opt-in (``RLOO_TEST_CUDA_IMAGES=1``, which ``make images-cuda`` sets after building them): the images are
~10 GB each, so CI does not build them. The images are the ones images/build.py tags from
``RLOO_IMAGE_REGISTRY``/``RLOO_IMAGE_TAG``; the builder is ``RLOO_BUILDER`` (default: docker when its daemon
answers, else podman; podman here with ``CONTAINERS_CONF=images/ci/containers.conf``). No GPU is needed:
torch, vLLM and DeepSpeed import without one, and nvcc compiles for a named architecture without one.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(
    os.environ.get("RLOO_TEST_CUDA_IMAGES") != "1",
    reason="the CUDA images: 'make images-cuda' builds and checks them",
)

_spec = importlib.util.spec_from_file_location("images_build", ROOT / "images" / "build.py")
assert _spec and _spec.loader
build = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(build)

CUDA_IMAGES = ("train", "eval")
IMPORTS = {
    "train": ("torch", "vllm", "deepspeed", "rloo", "rloo.training.trainer", "rloo.training.vllm_backend"),
    "eval": ("torch", "vllm", "rloo", "rloo.eval.runner", "rloo.eval.generation"),
}


def _pins() -> dict[str, str]:
    text = (ROOT / "constraints.txt").read_text() + (ROOT / "constraints-vllm.txt").read_text()
    pins = dict(re.findall(r"^([\w.-]+)==(\S+)$", text, flags=re.M))
    (deepspeed,) = re.findall(r"'deepspeed==([^']+)'", (ROOT / "images" / "train" / "Dockerfile").read_text())
    return {"torch": pins["torch"], "vllm": pins["vllm"], "deepspeed": deepspeed}


def run(name: str, program: str, script: str, *opts: str, timeout: int = 600) -> str:
    """``program -c script`` (sh or python3) in a throwaway container of image ``name``, as the image's
    user; its stdout."""
    builder = build.pick_builder(os.environ.get("RLOO_BUILDER", "auto"))
    cmd = [builder, "run", "--rm", *opts, "--entrypoint", program, build.reference(name), "-c", script]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd[:-1])}: {proc.stderr[-4000:]}"
    return proc.stdout


@pytest.mark.parametrize("name", CUDA_IMAGES)
def test_runs_as_uid_1000_with_the_checkout_s_rloo(name: str) -> None:
    """The pods run as uid/gid 1000 (src/rloo/stages/constants.py); the image's rloo is this checkout's."""
    out = run(name, "sh", "id -u; id -g; rloo --version").split()
    checkout = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert out == ["1000", "1000", "rloo", checkout], out


@pytest.mark.parametrize("name", CUDA_IMAGES)
def test_the_gpu_stack_imports_at_its_pins(name: str) -> None:
    """torch is PyPI's CUDA 13 build of the pin (a CPU build would import too: the CUDA version tells),
    vLLM and DeepSpeed are the pinned ones, and the steps' modules import beside them."""
    script = (
        "import importlib, json, sys\n"
        f"for m in {IMPORTS[name]!r}: importlib.import_module(m)\n"
        "import torch, vllm\n"
        "from importlib.metadata import version\n"
        "out = {'torch': version('torch'), 'cuda': torch.version.cuda, 'vllm': vllm.__version__}\n"
        "if 'deepspeed' in sys.modules: out['deepspeed'] = sys.modules['deepspeed'].__version__\n"
        "print(json.dumps(out))\n"
    )
    out = run(name, "python3", script)
    got = json.loads(out.strip().splitlines()[-1])
    pins = _pins()
    assert got["torch"] == pins["torch"] and got["cuda"].startswith("13."), got
    assert got["vllm"] == pins["vllm"], got
    if name == "train":
        assert got["deepspeed"] == pins["deepspeed"], got


@pytest.mark.parametrize("name", CUDA_IMAGES)
def test_the_compilers_that_kernels_need_at_run_time(name: str) -> None:
    """Triton compiles each kernel's launcher with ``gcc`` (or ``clang``, ``CC``) against Python's headers
    when it first runs (``triton-lang/triton python/triton/runtime/build.py`` ``_build``), and
    ``torch.utils.cpp_extension`` finds the CUDA toolkit of DeepSpeed's JIT ops at ``CUDA_HOME``, else
    ``nvcc`` on PATH, else /usr/local/cuda (``pytorch/pytorch torch/utils/cpp_extension.py``
    ``_find_cuda_home``): the nvcc there is the CUDA release torch was built with."""
    script = (
        'set -e; command -v gcc; command -v g++; command -v ninja; test -f "$(python3 -c \'import sysconfig; print(sysconfig.get_paths()["include"])\')/Python.h"; '
        "nvcc --version | tail -n 2; "
        "python3 -c 'import torch.utils.cpp_extension as c, torch; print(c.CUDA_HOME, torch.version.cuda)' 2>/dev/null"
    )
    out = run(name, "sh", script).splitlines()
    assert [Path(p).name for p in out[:3]] == ["gcc", "g++", "ninja"], out
    release = re.search(r"release (\d+\.\d+)", "\n".join(out))
    cuda_home, torch_cuda = out[-1].split()
    assert cuda_home == "/usr/local/cuda" and release and release[1] == torch_cuda, out


def test_deepspeed_compiles_its_ops_without_a_prebuilt_toolkit() -> None:
    """DeepSpeed is installed without ops (DS_BUILD_OPS=0): an op is compiled with ninja, g++ and nvcc
    under CUDA_HOME the first time it is used (``deepspeedai/DeepSpeed op_builder/builder.py``
    ``OpBuilder.jit_load``, ``torch.utils.cpp_extension.load``). FusedAdam (DeepSpeed's own Adam, used when
    a DeepSpeed config names an optimizer) compiles and loads here, for Hopper, with no GPU present:
    ``DS_ACCELERATOR=cuda`` selects the CUDA builders a GPU node detects by itself."""
    script = (
        "import os, time\n"
        "from deepspeed.ops.op_builder import FusedAdamBuilder\n"
        "start = time.monotonic()\n"
        "module = FusedAdamBuilder().load(verbose=False)\n"
        "print('loaded', module.__file__, round(time.monotonic() - start))\n"
    )
    opts = ("--env", "DS_ACCELERATOR=cuda", "--env", "TORCH_CUDA_ARCH_LIST=9.0", "--env", "MAX_JOBS=2")
    out = run("train", "python3", script, *opts, timeout=1200)
    loaded = [line for line in out.splitlines() if line.startswith("loaded ")]
    assert loaded and "fused_adam" in loaded[0], out
    print(f"DeepSpeed FusedAdam JIT: {loaded[0].split()[-1]} s", file=sys.stderr)
