"""The Hugging Face Hub out of reach: one retry cycle, one line naming the Hub and what to set, exit 75.

What the Hub client does (huggingface/huggingface_hub ``src/huggingface_hub/utils/_http.py``,
``_http_backoff_base``): a request that fails to connect is retried 5 times, 1 s doubling to 8 s, each
failure logged ("... thrown while requesting HEAD ...", "Retrying in Ns [Retry k/5]"), then the
``httpx.ConnectError`` is raised. ``file_download.py`` (``_get_metadata_or_catch_error``,
``_raise_on_head_call_error``) turns it into a ``LocalEntryNotFoundError`` raised *from* it when the file is
not in the cache, which transformers re-raises as an ``OSError`` from that; ``HF_HUB_OFFLINE=1``
(``constants.py``) skips the Hub and reads only the cache. transformers' ``AutoTokenizer.from_pretrained``
asks for ``config.json`` twice, so a Hub out of reach cost two whole cycles before rloo said anything.

The Hub cannot run here: ``HF_ENDPOINT`` points at a closed local port, and each command runs in a process of
its own (huggingface_hub reads ``HF_ENDPOINT`` and ``HF_HUB_OFFLINE`` once, when it is imported).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rloo.demo.tiny import TinySetup
from tests.fixtures.servers import free_port

pytestmark = pytest.mark.filterwarnings("ignore:You may be attemping:RuntimeWarning")

OFFLINE_VARS = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")


def _hub_env(tmp_path: Path) -> tuple[dict[str, str], str]:
    """The environment of a machine whose Hub (``HF_ENDPOINT``) refuses connections, with an empty cache."""
    endpoint = f"http://127.0.0.1:{free_port()}"
    env = {k: v for k, v in os.environ.items() if k not in OFFLINE_VARS}
    env.update(
        HF_ENDPOINT=endpoint,
        HF_HOME=str(tmp_path / "hf-home"),
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
    )
    return env, endpoint


def _train(env: dict[str, str], model: str, dataset: str, out: Path) -> subprocess.CompletedProcess[str]:
    argv = [
        "--model_name_or_path", model,
        "--dataset_name", dataset,
        "--reward_funcs", "rloo.demo.toy:letter_reward",
        "--output_dir", str(out),
        "--per_device_train_batch_size", "4",
        "--rloo_k", "2",
        "--response_length", "4",
        "--max_steps", "1",
        "--num_sample_generations", "0",
    ]  # fmt: skip
    return subprocess.run(
        [sys.executable, "-m", "rloo.cli", "train", *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _check_one_line(proc: subprocess.CompletedProcess[str], what: str, endpoint: str) -> str:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 75, proc.stderr[-3000:]
    last = lines[-1]
    assert last.startswith(f"rloo train: error: {what}: the Hugging Face Hub at {endpoint} is unreachable")
    assert "HF_HUB_OFFLINE" in last and "HF_ENDPOINT" in last
    assert "Traceback" not in proc.stderr
    return last


def test_train_with_a_hub_model_and_the_hub_out_of_reach(
    tiny_setup: TinySetup, toy_dataset: Path, tmp_path: Path
) -> None:
    env, endpoint = _hub_env(tmp_path)
    proc = _train(env, "org/sft-model", str(toy_dataset), tmp_path / "out")
    last = _check_one_line(proc, "--model_name_or_path org/sft-model", endpoint)
    # one retry cycle of huggingface_hub (5 retries), not one per time transformers asks
    retries = [line for line in proc.stderr.splitlines() if "Retrying in" in line]
    assert 1 <= len(retries) <= 5, retries
    assert "re-download" not in last and "re-save" not in last  # nothing is wrong with any file


def test_train_with_a_hub_dataset_and_the_hub_out_of_reach(tiny_setup: TinySetup, tmp_path: Path) -> None:
    env, endpoint = _hub_env(tmp_path)
    proc = _train(env, str(tiny_setup.policy), "org/prompts", tmp_path / "out")
    _check_one_line(proc, "--dataset_name org/prompts", endpoint)


def test_the_fetch_step_with_the_hub_out_of_reach(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """The pipeline's fetch step, run by kfp.local in a process of its own, as a pod runs it: one line and
    exit 75 (KFP retries the step), not a ``ConnectError`` traceback."""
    local = pytest.importorskip("kfp.local")
    from rloo.pipeline.compile import repo_root
    from rloo.stages.validate import build_plan
    from tests.stages.test_validate import good

    env, endpoint = _hub_env(tmp_path)
    for name in OFFLINE_VARS:
        monkeypatch.delenv(name, raising=False)
    for name in ("HF_ENDPOINT", "HF_HOME"):
        monkeypatch.setenv(name, env[name])
    plan = build_plan(good(model="org/sft-model", output_uri=str(tmp_path / "runs")), check_paths=False)
    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(tmp_path / "root"))
    monkeypatch.syspath_prepend(str(repo_root()))
    from components.fetch_sft.component import fetch_sft

    with pytest.raises(RuntimeError, match="FAILURE"):
        fetch_sft(plan=plan.to_json(), kfp_run_id="run-1")
    out = capfd.readouterr().out
    assert (
        f"fetching the SFT model failed: model org/sft-model: the Hugging Face Hub at {endpoint} is unreachable"
        in out
    )
    assert "Traceback" not in out


def test_train_offline_with_a_hub_model_not_in_the_cache(
    tiny_setup: TinySetup, toy_dataset: Path, tmp_path: Path
) -> None:
    """``HF_HUB_OFFLINE=1`` with the model not in the cache: nothing to retry (exit 2), and the line says the
    cache lacks it, not that a save is corrupt. huggingface_hub raises ``LocalEntryNotFoundError`` with no
    cause here (``file_download.py``, ``_raise_on_head_call_error`` with ``local_files_only``)."""
    env, _ = _hub_env(tmp_path)
    env["HF_HUB_OFFLINE"] = "1"
    proc = _train(env, "org/sft-model", str(toy_dataset), tmp_path / "out")
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert last.startswith(
        "rloo train: error: --model_name_or_path org/sft-model: not in this machine's Hub cache"
    )
    assert "HF_HUB_OFFLINE" in last and "re-download" not in last and "Retrying" not in proc.stderr
