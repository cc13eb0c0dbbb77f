"""benchmarks/gpu_window.py (the next GPU session: one call, the same call again for what did not finish)
and benchmarks/gpu_report.py, checked here without a GPU: the budgets of both calls against the device
time, the commands each step runs (every file they name exists, every flag parses with its script's own
parser), the state that makes a second call rerun only unfinished steps, packing into at most 8 files, and
the report on a fixture results folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.fixtures.scripts import load_script

REPO = Path(__file__).resolve().parents[1]
WINDOW = REPO / "benchmarks" / "gpu_window.py"
REPORT = REPO / "benchmarks" / "gpu_report.py"


def _module(path: Path) -> ModuleType:
    return sys.modules.get(path.stem) or load_script(path)


@pytest.fixture(scope="module")
def window() -> ModuleType:
    return _module(WINDOW)


@pytest.fixture(scope="module")
def report() -> ModuleType:
    return _module(REPORT)


def _run(*argv: str, timeout: int = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *argv], cwd=REPO, capture_output=True, text=True, timeout=timeout, check=False
    )


# ------------------------------------------------------------------------------------------------------
# the plan
def test_dry_run_fits_both_calls_in_the_device_time() -> None:
    proc = _run(str(WINDOW), "--dry-run")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "fits" in proc.stdout and "DOES NOT FIT" not in proc.stdout
    assert "vLLM is not sent" in proc.stdout
    # every step appears in one of the two calls with a budget (none left out at the default budget)
    assert "not in either call" not in proc.stdout


def test_dry_run_budget_sums(window: ModuleType) -> None:
    first = window.plan_call(window.CALL_BUDGET_S, set())
    second_budget = window.second_call_budget(window.CALL_BUDGET_S)
    second = window.plan_call(second_budget, {p.step.name for p in first if p.budget})
    for plan, budget in ((first, window.CALL_BUDGET_S), (second, second_budget)):
        serial = sum(p.budget for p in plan if not p.step.background)
        assert window.WHEELS_S + window.PACK_S + serial <= budget
        for p in plan:  # a step runs with at least its minimum, or not at all
            assert p.budget == 0 or p.step.minimum <= p.budget <= p.step.budget
    assert window.STARTUP_S + window.CALL_BUDGET_S + window.BETWEEN_CALLS_S + second_budget <= 900
    ran = [p.step.name for plan in (first, second) for p in plan if p.budget]
    assert sorted(ran) == sorted(window.STEP_NAMES)  # between them, every step
    assert first[0].step.background and first[0].step.name == "zero"  # started first, beside the rest


def test_a_budget_that_does_not_fit_is_exit_2() -> None:
    proc = _run(str(WINDOW), "--dry-run", "--budget", "700")
    assert proc.returncode == 2
    assert "DOES NOT FIT" in proc.stdout


def test_a_bad_budget_is_a_usage_error() -> None:
    proc = _run(str(WINDOW), "--budget", "10")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("gpu_window.py: error: --budget")


def test_the_plan_skips_below_a_minimum_and_leaves_out_finished_steps(window: ModuleType) -> None:
    # 200 s: 35 for the wheels and the pack; tests take 120; 45 s is below every later minimum
    plan = {p.step.name: p for p in window.plan_call(200, set())}
    assert plan["tests"].budget == 120
    assert all(plan[name].budget == 0 for name in ("bench-0.5b-vs-trl", "decode", "bench-0.5b-ours-layers"))
    assert "needs 100" in plan["bench-0.5b-vs-trl"].why
    assert plan["zero"].budget == 120  # the background step, beside the untimed tests
    again = window.plan_call(200, {"tests", "zero"})
    assert again[0].step.name == "bench-0.5b-vs-trl"
    assert again[0].budget == 140


def test_a_timed_step_waits_for_the_background_step(
    window: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the background step outlasting the untimed tests delays the first timed step by the difference
    zero, tests = window.STEPS[0], window.STEPS[1]
    assert zero.background and not tests.timed
    monkeypatch.setattr(
        window, "STEPS", (window.Step("zero", 150, 10, "", background=True), *window.STEPS[1:])
    )
    plan = {p.step.name: p for p in window.plan_call(1000, set())}
    # 1000 - 35: tests 120, a 30 s wait for the background step, then the timed steps in turn
    assert plan["bench-0.5b-vs-trl"].budget == 140
    assert plan["decode"].budget == 90
    assert window._serial_seconds(list(plan.values())) == 150 + 140 + 90 + 175 + 90


# ------------------------------------------------------------------------------------------------------
# the commands
def _check_command(argv: list[str], raw: Path, scratch: Path) -> None:
    assert argv[0] == "python"
    for a in argv[1:]:  # results under the step's raw folder, models and checkpoints under scratch
        if a.startswith("/"):
            assert a.startswith((str(raw) + "/", str(scratch) + "/")), a
    if argv[1].startswith("benchmarks/"):
        script = REPO / argv[1]
        assert script.is_file(), script
        _module(script).parse_args(argv[2:])  # SystemExit(2) on a flag the script does not take
    elif argv[1:3] == ["-m", "pytest"]:
        assert "--timeout" in argv and "tests/gpu" in argv and "no:logging" in argv
        selection = argv[argv.index("-k") + 1]
        source = "".join(p.read_text() for p in (REPO / "tests" / "gpu").glob("test_*.py"))
        for name in selection.split(" or "):  # every name selects a GPU test that exists
            assert f"def test_{name.strip()}" in source or f"_{name.strip()}" in source, name
    elif argv[1:3] == ["-m", "accelerate.commands.launch"]:
        config = argv[argv.index("--config_file") + 1]
        assert (REPO / config).is_file(), config
        cli = argv.index("rloo.cli")
        from rloo.config import RLOOConfig
        from rloo.parsing import parse_config

        cfg = parse_config(RLOOConfig, argv[cli + 2 :], prog="rloo train")
        assert cfg.bf16 and cfg.save_steps == 1 and cfg.max_steps in (2, 4)
    elif argv[1] == "-c":
        compile(argv[2], "<gpu_window -c>", "exec")
    else:
        raise AssertionError(f"a command this test does not know: {argv}")


@pytest.mark.parametrize("step", ["zero", "tests", "bench-0.5b-vs-trl", "decode", "bench-1.5b-ours-layers"])
def test_step_commands_name_real_files_and_flags(window: ModuleType, step: str, tmp_path: Path) -> None:
    raw, scratch = tmp_path / "raw", tmp_path / "scratch"
    commands = window.step_commands(step, "python", raw, scratch)
    assert commands
    for _, argv in commands:
        _check_command(argv, raw, scratch)


def test_layers_steps_compile_the_layers_and_the_vs_trl_step_runs_both(window: ModuleType) -> None:
    raw, scratch = Path("/r"), Path("/s")
    for name, size in (("bench-1.5b-ours-layers", "1.5b"), ("bench-0.5b-ours-layers", "0.5b")):
        argv = window.step_commands(name, "python", raw, scratch)[0][1]
        assert "--torch-compile" in argv and argv[argv.index("--sizes") + 1] == size
        assert argv[argv.index("--only") + 1] == "ours"
    versus = window.step_commands("bench-0.5b-vs-trl", "python", raw, scratch)[0][1]
    assert "--only" not in versus and "--torch-compile" not in versus
    zero = [log for log, _ in window.step_commands("zero", "python", raw, scratch)]
    assert zero == ["zero-setup", "zero2-first", "zero2-resume", "zero3-first", "zero3-resume"]


def test_node_env_puts_the_checkout_first_and_names_deepspeeds_accelerator(
    window: ModuleType, tmp_path: Path
) -> None:
    env = window.node_env(tmp_path / "site")
    assert env["DS_ACCELERATOR"] == "cuda" and env["HF_HUB_OFFLINE"] == "1"
    assert env["PYTHONPATH"].split(os.pathsep)[:2] == [str(REPO / "src"), str(tmp_path / "site")]


# ------------------------------------------------------------------------------------------------------
# running: state, reruns, packing
FAKE_STEPS = "fake"


def _fake_steps(
    window: ModuleType, monkeypatch: pytest.MonkeyPatch, tmp: Path, exits: dict[str, Any]
) -> Path:
    """Small stand-in steps: each writes a marker file and exits as ``exits`` says ("sleep": runs past
    its 2-s budget); the real steps' order and background flag."""
    marks = tmp / "marks"
    marks.mkdir(exist_ok=True)
    steps = tuple(
        window.Step(s.name, 2, 1, s.what, background=s.background) for s in window.STEPS
    )  # 2 s budgets
    monkeypatch.setattr(window, "STEPS", steps)
    monkeypatch.setattr(window, "PACK_S", 0)

    def commands(name: str, py: str, raw: Path, scratch: Path) -> list[tuple[str, list[str]]]:
        outcome = exits.get(name, 0)
        body = f"open({str(marks / name)!r}, 'a').write('x'); print('ran {name}')"
        body += "; import time; time.sleep(30)" if outcome == "sleep" else f"; raise SystemExit({outcome})"
        return [("main", [sys.executable, "-c", body])]

    monkeypatch.setattr(window, "step_commands", commands)
    monkeypatch.setattr(window, "zero_check", lambda raw, scratch: "")
    return marks


def _call(window: ModuleType, work: Path, out: Path, state: dict[str, Any], seconds: float = 60) -> Any:
    import time

    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    return window.Call(work, out, sys.executable, time.monotonic() + seconds, env, state)


def test_a_second_call_reruns_only_what_did_not_finish(
    window: ModuleType, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    work, out = tmp_path / "work", tmp_path / "out"
    marks = _fake_steps(window, monkeypatch, tmp_path, {"decode": 3, "bench-0.5b-ours-layers": "sleep"})
    state = window.load_state(work)
    state["calls"] = 1
    assert window.run_call(_call(window, work, out, state)) == 1
    steps = json.loads((work / "state.json").read_text())["steps"]
    assert steps["decode"]["status"] == "failed (exit 3)"
    assert steps["bench-0.5b-ours-layers"]["status"] == "timeout"
    assert {n for n, r in steps.items() if r["status"] == "ok"} == set(window.STEP_NAMES) - {
        "decode",
        "bench-0.5b-ours-layers",
    }
    assert sorted(p.name for p in marks.iterdir()) == sorted(window.STEP_NAMES)
    # the second call on a fresh machine: only the first call's results.tar.gz carried back
    work2 = tmp_path / "work2"
    work2.mkdir()
    (work2 / "results.tar.gz").write_bytes((out / "results.tar.gz").read_bytes())
    for mark in marks.iterdir():
        mark.unlink()
    _fake_steps(window, monkeypatch, tmp_path, {})
    state = window.load_state(work2)
    # a failed step is not run again (the same code fails the same way; its output is packed)
    assert window.finished(state) == set(window.STEP_NAMES) - {"bench-0.5b-ours-layers"}
    state["calls"] = 2
    assert window.run_call(_call(window, work2, tmp_path / "out2", state)) == 1  # decode still failed
    assert sorted(p.name for p in marks.iterdir()) == ["bench-0.5b-ours-layers"]
    final = json.loads((work2 / "state.json").read_text())["steps"]
    assert final["bench-0.5b-ours-layers"]["call"] == 2 and final["tests"]["call"] == 1
    assert final["decode"] == steps["decode"]
    # the earlier call's raw output of a finished step is still there to pack
    assert (work2 / "raw" / "tests" / "main.out").read_text().strip() == "ran tests"


def test_a_step_with_too_little_time_left_is_skipped_for_the_next_call(
    window: ModuleType, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    marks = _fake_steps(window, monkeypatch, tmp_path, {})
    state = {"calls": 1, "steps": {}}
    assert window.run_call(_call(window, tmp_path / "w", tmp_path / "o", state, seconds=0.5)) == 1
    steps = json.loads((tmp_path / "w" / "state.json").read_text())["steps"]
    assert {r["status"] for r in steps.values()} == {"skipped"}
    assert not list(marks.iterdir())
    assert window.finished(steps and {"steps": steps}) == set()


def test_packing_is_at_most_8_files_and_cuts_long_logs(
    window: ModuleType, report: ModuleType, tmp_path: Path
) -> None:
    work, out = tmp_path / "work", tmp_path / "out"
    for step in window.STEP_NAMES:
        (work / "raw" / step).mkdir(parents=True)
        (work / "raw" / step / "main.err").write_text(f"{step} log\n")
    big = work / "raw" / "tests" / "pytest.out"
    big.write_bytes(b"x" * (3 * window.LOG_TAIL_BYTES) + b"\nthe last line\n")
    state = {"calls": 1, "steps": {}}
    window.record_step(state, "tests", "ok", 12.0)
    window.save_state(work, state)
    files = window.pack(work, out, window.summarize)
    assert len(list(out.iterdir())) == len(files) <= window.MAX_RESULT_FILES
    assert all(f.stat().st_size < window.MAX_FILE_BYTES for f in files)
    with tarfile.open(out / "results.tar.gz") as tar:
        names = tar.getnames()
        assert "state.json" in names and len([n for n in names if n.endswith("main.err")]) == 6
        packed = tar.extractfile("raw/tests/pytest.out")
        assert packed is not None
        data = packed.read()
    assert len(data) == window.LOG_TAIL_BYTES and data.endswith(b"the last line\n")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"]["tests"]["status"] == "ok"


def test_a_python_without_torch_is_one_line_and_exit_2(tmp_path: Path) -> None:
    fake = tmp_path / "python"  # pip "installs" the wheels; nothing imports torch
    fake.write_text('#!/bin/sh\n[ "$1 $2" = "-m pip" ] && exit 0\nexit 1\n')
    fake.chmod(0o755)
    (tmp_path / "wheels").mkdir()
    (tmp_path / "wheels" / "rloo_kfp-0-py3-none-any.whl").write_bytes(b"")
    proc = _run(
        str(WINDOW),
        "--python",
        str(fake),
        "--wheels",
        str(tmp_path / "wheels"),
        "--work",
        str(tmp_path / "work"),
        "--out",
        str(tmp_path / "out"),
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "cannot import torch" in proc.stderr


def test_the_session_wrapper_passes_its_arguments_on() -> None:
    proc = subprocess.run(
        [str(REPO / "benchmarks" / "gpu_session.sh"), "--dry-run"],
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "call 2" in proc.stdout


# ------------------------------------------------------------------------------------------------------
# the report
def _bench_fixture() -> dict[str, Any]:
    """bench_gpu.py's JSON for ours and TRL at 0.5B, its figures computed by bench_gpu.figures."""
    bench = _module(REPO / "benchmarks" / "bench_gpu.py")
    preset = bench.PRESETS["0.5b"]
    base = {
        "seconds": 60.0,
        "episodes": 384,
        "phase_seconds": {"generation": 5.0, "logprobs": 1.0, "scoring": 0.5, "optimization": 4.0},
        "generated_tokens": 5 * 64 * 53.0,
        "train_tokens": 5 * 64 * (460 + 53.0),
        "prompt_tokens_per_completion": 460.0,
        "prompt_width": 470.0,
        "decode_weights": "bf16",
        "decode_cache": "static",
        "rollouts": 5,
        "peak_memory_bytes": 2**33,
    }
    ours = {**base, "trainer": "ours", "update_wall_s": [30.0, 8.0, 2.0, 2.0, 2.0, 2.0]}
    ours |= {"dynamo": {"unique_graphs": 3, "cudagraph_skips": 0, "graph_breaks": 0}}
    ours |= {"settings": {"decode": "static cache, compiled step", "micro-batch": "32"}}
    trl = {**base, "trainer": "trl", "update_wall_s": [20.0, 9.0, 8.0, 8.0, 8.0, 8.0]}
    trl |= {"decode_weights": "fp32-autocast", "decode_cache": "dynamic", "trl_version": "1.16.0"}
    trl |= {"settings": {"decode": "dynamic cache", "micro-batch": "32"}}
    trl["phase_seconds"] = {"generation": 20.0, "logprobs+scoring": 4.0, "optimization": 10.0}
    matmul = bench.preset_param_counts(preset)[1]
    peak = ("H100 SXM", 989e12, 3.35e12)
    figures = {t: bench.figures(r, preset, matmul, peak) for t, r in (("ours", ours), ("trl", trl))}
    return {
        "gpu": "NVIDIA H100 80GB HBM3",
        "peak": peak,
        "raw": {"0.5b": {"ours": ours, "trl": trl}},
        "figures": {"0.5b": figures},
    }


def _results_folder(window: ModuleType, tmp_path: Path) -> Path:
    work = tmp_path / "work"
    (work / "raw" / "bench-0.5b-vs-trl").mkdir(parents=True)
    (work / "raw" / "environment.txt").write_text(
        "python: 3.12.3\ngpu: NVIDIA H100 80GB HBM3, 79.1 GiB, 132 SMs\n"
    )
    (work / "raw" / "bench-0.5b-vs-trl" / "bench.json").write_text(json.dumps(_bench_fixture()))
    (work / "raw" / "decode").mkdir()
    (work / "raw" / "decode" / "decode.err").write_text("Traceback ...\nRuntimeError: CUDA out of memory\n")
    state = {"calls": 1, "steps": {}}
    window.record_step(state, "bench-0.5b-vs-trl", "ok", 150.0)
    window.record_step(state, "decode", "failed (exit 1)", 30.0)
    window.record_step(state, "bench-1.5b-ours-layers", "skipped", 0.0, "20 s left, needs 110")
    window.save_state(work, state)
    out = tmp_path / "out"
    window.pack(work, out, window.summarize)
    return out


def test_report_turns_packed_results_into_the_results_table(
    window: ModuleType, report: ModuleType, tmp_path: Path
) -> None:
    out = _results_folder(window, tmp_path)
    proc = _run(str(REPORT), str(out), "--output", str(tmp_path / "report.md"))
    assert proc.returncode == 0, proc.stderr
    text = (tmp_path / "report.md").read_text()
    assert text == proc.stdout
    assert "GPU window on NVIDIA H100 80GB HBM3" in text
    rows = {line.split(" | ")[0].strip("| "): line for line in text.splitlines() if line.startswith("| ")}
    # ours: 64 episodes a 2-s update; TRL: a 8-s update; the steady ratio is theirs
    assert "0.5b ours: 32.0 ep/s steady" in rows["bench-0.5b-vs-trl"]
    assert "ours/TRL 4.00x steady" in rows["bench-0.5b-vs-trl"]
    assert "stderr: RuntimeError: CUDA out of memory" in rows["decode"]
    assert "skipped" in rows["bench-1.5b-ours-layers"] and "needs 110" in rows["bench-1.5b-ours-layers"]
    assert rows["tests"].startswith("| tests | not run")
    assert "0.5B TRL 1.16.0, use_vllm=False" in text
    assert "settings differ: decode: ours static cache, compiled step, TRL dynamic cache" in text
    # the same markdown as the call's own summary
    assert (out / "summary.md").read_text() == text


def test_report_of_a_folder_without_results_is_one_line_and_exit_2(tmp_path: Path) -> None:
    proc = _run(str(REPORT), str(tmp_path))
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "neither results.tar.gz nor state.json" in proc.stderr


def test_a_python_that_sees_no_gpu_measures_nothing_and_exits_75(tmp_path: Path) -> None:
    fake = tmp_path / "python"  # imports "torch" fine, sees no CUDA device
    fake.write_text("#!/bin/sh\necho 'cuda: None available: False'\n")
    fake.chmod(0o755)
    (tmp_path / "wheels").mkdir()
    (tmp_path / "wheels" / "rloo_kfp-0-py3-none-any.whl").write_bytes(b"")  # "installed" by the fake pip
    work = tmp_path / "work"
    proc = _run(
        str(WINDOW), "--python", str(fake), "--wheels", str(tmp_path / "wheels"), "--work", str(work),
        "--out", str(tmp_path / "out"),
    )  # fmt: skip
    assert proc.returncode == 75
    assert proc.stderr.strip().count("\n") == 0 and "sees no CUDA GPU" in proc.stderr
    assert not (work / "state.json").exists()  # no step recorded as done: the next call runs them all


def test_gpu_wheels_builds_our_wheel_without_the_venv(tmp_path: Path) -> None:
    # `make -n` prints every recipe it would run: a dependency on `install` would show the venv's build
    proc = subprocess.run(
        ["make", "-n", "gpu-wheels", "VENV=" + str(tmp_path / "no-venv")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "pip wheel -q --no-deps -w gpu-wheels ." in proc.stdout
    assert "-r benchmarks/gpu-requirements.txt" in proc.stdout
    assert "venv" not in proc.stdout and "pip install" not in proc.stdout
    pins = (REPO / "benchmarks" / "gpu-requirements.txt").read_text()
    assert "pytest-timeout==" in pins and "vllm" not in pins.lower().replace("use_vllm", "")


def test_each_gpu_test_the_window_selects_exists(window: ModuleType) -> None:
    """The window runs the GPU tests by ``pytest -k``: a renamed test would silently drop out of it."""
    import re

    names = re.findall(r"^def (test_\w+)", (REPO / "tests" / "gpu" / "test_gpu_train.py").read_text(), re.M)
    for term in window.GPU_TESTS.split(" or "):
        assert [n for n in names if term in n], term


def test_no_wheels_is_one_line_and_exit_2(tmp_path: Path) -> None:
    """Without the carried wheels (TRL, DeepSpeed, pytest-timeout are not on the node) every step would
    fail in turn for ten minutes: the call stops at once and says how to build them."""
    (tmp_path / "empty").mkdir()
    for wheels in (tmp_path / "missing", tmp_path / "empty"):
        proc = _run(
            str(WINDOW), "--wheels", str(wheels), "--work", str(tmp_path / "w"), "--out", str(tmp_path / "o")
        )
        assert proc.returncode == 2
        assert proc.stderr.strip().count("\n") == 0 and "make gpu-wheels" in proc.stderr
