"""The forked processes the tests run ``rloo`` in behave as ``python`` processes do (tests/fixtures/zygote.py).

Each case runs the same command twice, forked from the warm server and as a plain ``subprocess``, and
compares what a test can observe: exit code, stdout, stderr, ``sys.argv``, working directory, environment,
death by a signal, Ctrl-C, atexit handlers.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.fixtures import ranks, recipes, zygote

CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "accelerate"

SHOW = textwrap.dedent(
    """
    import atexit, os, sys
    atexit.register(lambda: print("atexit ran", flush=True))
    print(sys.argv[1:], os.getcwd(), os.environ.get("RLOO_ZYGOTE_PROBE"), sys.stdin.read() == "")
    print("to stderr", file=sys.stderr)
    sys.exit(int(sys.argv[1]))
    """
)
SLEEP = "import time; print('started', flush=True); time.sleep(60)"


def _plain(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )


def test_a_forked_run_looks_like_a_python_run(tmp_path: Path) -> None:
    env = recipes.subprocess_env(RLOO_ZYGOTE_PROBE="probe")
    script = tmp_path / "show.py"
    script.write_text(SHOW)
    for args in (["-c", SHOW, "3", "x y"], [str(script), "0", "x y"]):
        forked = zygote.popen(args, env=env, cwd=tmp_path)
        assert isinstance(forked, zygote.Forked)
        out, err = forked.communicate(timeout=120)
        plain = _plain(args, env, tmp_path)
        assert (forked.returncode, out, err) == (plain.returncode, plain.stdout, plain.stderr)
        assert "atexit ran" in out and "'x y'" in out and "probe" in out


def test_the_module_form_runs_the_module_as_main(tmp_path: Path) -> None:
    forked = zygote.run(["-m", "rloo.cli", "--help"], env=recipes.subprocess_env(), cwd=tmp_path)
    plain = _plain(["-m", "rloo.cli", "--help"], recipes.subprocess_env(), tmp_path)
    assert forked.returncode == plain.returncode == 0
    assert forked.stdout == plain.stdout


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGKILL, -9), (signal.SIGTERM, -15), (signal.SIGINT, -2)])
def test_signals_end_a_forked_process_as_they_end_python(sig: int, code: int) -> None:
    proc = zygote.popen(["-c", SLEEP], env=recipes.subprocess_env())
    assert isinstance(proc, zygote.Forked)
    deadline = time.monotonic() + 30
    while "started" not in Path(proc.stdout_path).read_text():  # the handlers are the script's from here on
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    proc.send_signal(sig)
    assert proc.wait(timeout=30) == code
    if sig == signal.SIGINT:
        assert "KeyboardInterrupt" in proc.communicate()[1]


def test_an_environment_read_at_import_time_gets_a_plain_process() -> None:
    proc = zygote.popen(["-c", "pass"], env=recipes.subprocess_env(HF_HOME="/elsewhere"))
    assert isinstance(proc, subprocess.Popen)
    proc.communicate(timeout=60)


def test_a_timeout_kills_the_child() -> None:
    with pytest.raises(subprocess.TimeoutExpired):
        zygote.run(["-c", SLEEP], env=recipes.subprocess_env(), timeout=2)


# --- tests/fixtures/ranks.py: the ranks of a launch ----------------------------------------------------
SHOW_RANK = textwrap.dedent(
    """
    import json, os
    keep = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
            "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "TORCHELASTIC_", "TORCH_NCCL_",
            "ACCELERATE_")
    # one write: under the real launcher the ranks share stdout, and two lines could run into one
    os.write(1, (json.dumps({k: v for k, v in os.environ.items() if k.startswith(keep)}) + "\\n").encode())
    """
)
LAUNCHER_ONLY = ("TORCHELASTIC_", "TORCH_NCCL_")  # the elastic agent's own: restarts, its store, NCCL


def _by_rank(stdout: str) -> dict[str, dict[str, str]]:
    rows = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    return {row["RANK"]: row for row in rows}


@pytest.mark.parametrize("config", [None, "deepspeed_zero2.yaml"])
def test_a_launch_gives_each_rank_what_the_real_launcher_gives_it(tmp_path: Path, config: str | None) -> None:
    """The variables torchrun's agent sets (torch/distributed/elastic/agent/server/local_elastic_agent.py,
    ``_start_workers``) and, with a config, those ``accelerate launch`` adds (accelerate/commands/launch.py):
    the forked ranks get the same ones, but for the agent's own."""
    script = tmp_path / "show.py"
    script.write_text(SHOW_RANK)
    env = recipes.subprocess_env()
    if config is None:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(script)]
    else:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIGS / config)]
        cmd += ["--num_processes", "2", str(script)]
    real = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert real.returncode == 0, real.stderr[-3000:]
    forked = ranks.launch(
        2, [str(script)], env=env, accelerate_config=config and CONFIGS / config, cwd=tmp_path
    )
    assert forked.returncode == 0, forked.stderr[-3000:]
    want = {
        rank: {k: v for k, v in row.items() if not k.startswith(LAUNCHER_ONLY)}
        for rank, row in _by_rank(real.stdout).items()
    }
    assert set(want) == {"0", "1"} and _by_rank(forked.stdout) == want
    if config is not None:
        assert want["0"]["ACCELERATE_USE_DEEPSPEED"] == "true"


def test_a_failed_rank_stops_the_others_and_the_launch_exits_1() -> None:
    code = "import os, sys, time\nif os.environ['RANK'] == '1': sys.exit(3)\ntime.sleep(120)"
    start = time.monotonic()
    proc = ranks.launch(2, ["-c", code], env=recipes.subprocess_env(), timeout=200)
    assert proc.returncode == 1
    assert time.monotonic() - start < 60  # rank 0 was stopped, not waited for
