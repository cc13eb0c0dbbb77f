"""Fixtures of the evaluation tests: the scripted judge server and a real ``transformers serve``."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from rloo.demo.tiny import TinySetup
from tests.eval.scripted_server import ScriptedJudge
from tests.fixtures.servers import wait_until_serving


@pytest.fixture
def scripted_judge() -> Iterator[ScriptedJudge]:
    with ScriptedJudge(stall_seconds=10.0) as server:
        yield server


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def transformers_server(tiny_setup: TinySetup, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``transformers serve`` on 127.0.0.1 serving the tiny local policy; yields its /v1 base URL."""
    exe = shutil.which("transformers", path=str(Path(sys.executable).parent)) or shutil.which("transformers")
    if exe is None:
        pytest.fail("the 'transformers' CLI is missing: install the eval extra")
    port = _free_port()
    log_path = tmp_path_factory.mktemp("serve") / "serve.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    cmd = [
        exe,
        "serve",
        str(tiny_setup.policy),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--device",
        "cpu",
    ]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        url = f"http://127.0.0.1:{port}/health"
        wait_until_serving(proc, url, log_path, "transformers serve", timeout=120)  # a start-up wait
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
