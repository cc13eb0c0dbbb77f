"""``rloo train --use_vllm --vllm_mode server`` against a real ``rloo vllm-serve`` (vLLM's OpenAI server, CPU).

The server is a separate process started by the command users run; the trainer reaches it over HTTP only
(``/v1/completions`` for the rollouts, ``/collective_rpc`` for the weights: vllm/entrypoints/serve/dev/rpc/
api_router.py). The proof that the server samples from the policy being trained is the colocated tests':
``objective/vllm_logp_diff_abs_mean``, the gap between the server's log-probs of the sampled tokens and the
trainer's forward on the weights of the rollout, stays rounding (``TOLERANCE``) at every update, while an
engine that misses the pushes is far off from the second update (test_train_vllm.py shows the check can fail).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from rloo.demo.tiny import TinySetup
from rloo.demo.toy import write_toy_dataset
from tests.fixtures.servers import free_port, stop_process, wait_until_serving
from tests.vllm_engine.conftest import metrics, needs_vllm, rloo
from tests.vllm_engine.test_train_vllm import GAP, TOLERANCE, train_args

pytestmark = needs_vllm

ROLLOUT_STATS = ("objective/scores", "objective/rlhf_reward", "objective/kl", "objective/entropy")


@dataclass(frozen=True)
class PolicyServer:
    url: str
    proc: subprocess.Popen[bytes]
    log: Path


def start_server(model: Path, env: dict[str, str], root: Path) -> PolicyServer:
    """``rloo vllm-serve`` on CPU: the flags a CPU deployment gives (float32, a bounded KV cache)."""
    port = free_port()
    log = root / f"server-{port}.log"
    cmd = [sys.executable, "-m", "rloo.cli", "vllm-serve", "--model", str(model), "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--dtype", "float32", "--max-model-len", "256", "--max-num-seqs", "16"]
    cmd += [f"--kv-cache-memory-bytes={64 << 20}", "--served-model-name", "policy", "--enforce-eager"]
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    wait_until_serving(proc, url + "/health", log, "rloo vllm-serve", timeout=300)
    return PolicyServer(url, proc, log)


@pytest.fixture(scope="module")
def server(
    qwen: TinySetup, vllm_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[PolicyServer]:
    s = start_server(qwen.policy, vllm_env, tmp_path_factory.mktemp("policy-server"))
    yield s
    stop_process(s.proc)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def prompts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_toy_dataset(tmp_path_factory.mktemp("prompts"), num_train=32, num_test=4)


def server_args(qwen: TinySetup, data: Path, out: Path, url: str, *extra: str, steps: int = 4) -> list[str]:
    return train_args(
        qwen, data, out, "--vllm_mode", "server", "--vllm_server_base_url", url, *extra, steps=steps
    )


def served_info(url: str) -> dict:
    body = json.dumps({"method": "rloo_model_info", "kwargs": {}}).encode()
    req = urllib.request.Request(
        url + "/collective_rpc", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())["results"][0]


def _ok(proc: subprocess.CompletedProcess[str]) -> None:
    assert proc.returncode == 0, proc.stderr[-4000:]


def test_the_server_samples_from_the_policy_at_every_update(
    qwen: TinySetup, prompts: Path, vllm_env: dict[str, str], server: PolicyServer, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    proc = rloo(server_args(qwen, prompts, out, server.url), vllm_env)
    _ok(proc)
    rows = metrics(out)
    gaps = [r[GAP] for r in rows]
    assert len(gaps) == 4 and max(gaps) < TOLERANCE, gaps
    assert rows[-1]["objective/kl"] > rows[0]["objective/kl"]  # the policy moved, so pushes mattered
    # the weights of optimizer step 3 went in before update 4's rollout, and the server kept them
    info = served_info(server.url)
    assert info["version"] == 3 and info["architectures"] == ["Qwen2ForCausalLM"]
    assert f"rollouts: the vLLM server at {server.url}" in proc.stdout + proc.stderr


def test_server_mode_matches_the_colocated_engine_on_the_same_seed(
    qwen: TinySetup, prompts: Path, vllm_env: dict[str, str], server: PolicyServer, tmp_path: Path
) -> None:
    """The same requests (one per completion, its own seed) to the same weights: the same first rollout.
    The server holds another run's weights here; the first rollout pushes the policy's regardless."""
    colocated, served = tmp_path / "colocated", tmp_path / "served"
    _ok(rloo(train_args(qwen, prompts, colocated, steps=1), vllm_env))
    _ok(rloo(server_args(qwen, prompts, served, server.url, steps=1), vllm_env))
    (a,), (b,) = metrics(colocated), metrics(served)
    for key in ROLLOUT_STATS:
        assert abs(a[key] - b[key]) <= TOLERANCE * max(1.0, abs(a[key])), (key, a[key], b[key])


def test_lora_in_server_mode_pushes_the_merged_weights(
    qwen: TinySetup, prompts: Path, vllm_env: dict[str, str], server: PolicyServer, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    lora = ("--use_peft", "--lora_r", "8", "--lora_alpha", "16")
    _ok(rloo(server_args(qwen, prompts, out, server.url, *lora, steps=3), vllm_env))
    rows = metrics(out)
    assert max(r[GAP] for r in rows) < TOLERANCE, rows
    assert rows[-1]["objective/kl"] > 0


@pytest.mark.parametrize("ahead", [False, True], ids=["sync", "async"])
def test_two_training_processes_share_one_server(
    qwen: TinySetup,
    prompts: Path,
    vllm_env: dict[str, str],
    server: PolicyServer,
    tmp_path: Path,
    ahead: bool,
) -> None:
    """Async: the first process sends the weights from its worker, the second waits on its own worker until
    the server reports their version before it samples (no collective off the training thread)."""
    out = tmp_path / "out"
    args = server_args(qwen, prompts, out, server.url, *(["--async_generation"] if ahead else []), steps=3)
    args[args.index("--per_device_train_batch_size") + 1] = "2"  # the same 4 prompts per update, 2 a rank
    launcher = ["--standalone", "--nproc_per_node", "2", "-m", "rloo.cli"]
    _ok(rloo([*launcher, *args], vllm_env, module="torch.distributed.run"))
    rows = metrics(out)
    gaps = [r[GAP] for r in rows]
    if ahead:  # batch 1 from the starting weights, then one step old: the gap shows it was not sampled late
        assert [r["async/staleness"] for r in rows] == [0.0, 1.0, 1.0]
        assert gaps[0] < TOLERANCE < gaps[2], gaps
    else:
        assert len(gaps) == 3 and max(gaps) < TOLERANCE, gaps


def test_a_server_lost_mid_run_checkpoints_exits_75_and_the_run_resumes(
    qwen: TinySetup,
    prompts: Path,
    vllm_env: dict[str, str],
    server: PolicyServer,
    tmp_path: Path,
) -> None:
    doomed = start_server(qwen.policy, vllm_env, tmp_path)
    out = tmp_path / "out"
    args = server_args(qwen, prompts, out, doomed.url, "--vllm_server_timeout", "5", steps=8)
    run = subprocess.Popen(
        [sys.executable, "-m", "rloo.cli", *args],
        env=vllm_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 300
        while not (out / "metrics.jsonl").exists() or len(metrics(out)) < 2:
            assert run.poll() is None and time.monotonic() < deadline, run.communicate()[1][-3000:]
            time.sleep(0.2)
    finally:
        stop_process(doomed.proc, signal.SIGKILL)  # type: ignore[arg-type]
    _, err = run.communicate(timeout=300)
    assert run.returncode == 75, err[-3000:]
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"rloo train: error: the vLLM server at {doomed.url} did not answer"), last
    done = len(metrics(out))
    assert (out / f"checkpoint-{done}").is_dir(), sorted(p.name for p in out.iterdir())

    # the same run, pointed at a server that answers, goes on from there
    resumed = server_args(qwen, prompts, out, server.url, steps=8)
    proc = rloo(resumed, vllm_env)
    _ok(proc)
    rows = metrics(out)
    assert [r["update"] for r in rows] == list(range(1, 9))
    assert max(r[GAP] for r in rows) < TOLERANCE


def test_async_generation_overlaps_the_server_with_training_one_update_off_policy(
    qwen: TinySetup, prompts: Path, vllm_env: dict[str, str], server: PolicyServer, tmp_path: Path
) -> None:
    """--async_generation: the server generates the batch of update u + 1 from update u's weights (pushed
    before update u trains) while update u trains. The first rollout is the synchronous run's (the same
    weights and seeds); later ones are one optimizer step old, which the log-prob gap between the server's
    sampling and today's forward shows (a synchronous run keeps it at rounding), and the server holds the
    weights of the last batch's launch at the end."""
    sync, out = tmp_path / "sync", tmp_path / "async"
    _ok(rloo(server_args(qwen, prompts, sync, server.url, steps=1), vllm_env))
    proc = rloo(server_args(qwen, prompts, out, server.url, "--async_generation", steps=4), vllm_env)
    _ok(proc)
    rows = metrics(out)
    (first,) = metrics(sync)
    for key in ROLLOUT_STATS:
        assert abs(rows[0][key] - first[key]) <= TOLERANCE * max(1.0, abs(first[key])), key
    assert [r["async/staleness"] for r in rows] == [0.0, 1.0, 1.0, 1.0]
    gaps = [r[GAP] for r in rows]
    assert gaps[0] < TOLERANCE and min(gaps[2:]) > 10 * TOLERANCE, gaps
    # batch 4 (the last) was generated from the weights after 2 optimizer steps, during update 3
    assert served_info(server.url)["version"] == 2
    assert all(r["time/generation_wait_s"] >= 0 for r in rows)
