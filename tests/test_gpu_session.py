"""benchmarks/gpu_session.sh, the next GPU session's three stages, checked here without a GPU: its stage
argument, the commands each stage runs (every file they name exists, every flag parses with the script's
own parser), the time budgets, and how a stage reports a step that fails, runs out of time or is skipped."""

from __future__ import annotations

import json
import os
import re
import shlex
import stat
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.fixtures.scripts import load_script

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "gpu_session.sh"
STAGE_LIMIT = 510  # the script's default: 8.5 minutes of a 10-minute command
SETUP_S = 30  # wheel installation and the environment report, before the first step
STEPS = {
    "1": ["decode", "bench-0.5b-ours", "profile-0.5b"],
    "2": ["tests", "zero-setup", "zero2", "zero3"],
    "3": ["bench-0.5b-vs-trl", "bench-1.5b-ours", "bench-0.5b-ours-layers"],
}


def _session(
    *args: str, env: dict[str, str] | None = None, timeout: int = 120
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(SCRIPT), *args],
        env={**os.environ, "PYTHON": sys.executable, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def _module(path: Path) -> ModuleType:
    return sys.modules.get(path.stem) or load_script(path)


def test_scripts_parse() -> None:
    for name in ("gpu_session.sh", "gpu_env.sh", "gpu_check.sh"):
        proc = subprocess.run(["bash", "-n", str(REPO / "benchmarks" / name)], capture_output=True, text=True)
        assert proc.returncode == 0, (name, proc.stderr)
    assert os.stat(SCRIPT).st_mode & stat.S_IXUSR


@pytest.mark.parametrize("args", [[], ["0"], ["4", "out"], ["one", "out"], ["1 2", "out"]])
def test_a_bad_stage_is_one_line_and_exit_2(args: list[str]) -> None:
    proc = _session(*args)
    assert proc.returncode == 2
    assert proc.stdout == ""
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("gpu_session: STAGE must be 1, 2 or 3")


def test_no_out_folder_is_exit_2() -> None:
    proc = _session("1")
    assert proc.returncode == 2
    assert (
        proc.stderr.strip()
        == "gpu_session: no OUT folder given; usage: benchmarks/gpu_session.sh STAGE OUT (STAGE: 1, 2 or 3)"
    )


def _dry_run(stage: str, out: Path) -> list[tuple[str, int, list[list[str]]]]:
    """The stage's steps as (name, budget, commands) from its dry run."""
    proc = _session(stage, str(out), env={"DRY_RUN": "1"})
    assert proc.returncode == 0, proc.stderr
    assert not out.exists()  # a dry run writes nothing
    steps: list[tuple[str, int, list[list[str]]]] = []
    for line in proc.stdout.splitlines():
        if m := re.fullmatch(r"step (\S+) \(budget (\d+) s\)", line):
            steps.append((m[1], int(m[2]), []))
        elif line.startswith("  $ "):
            steps[-1][2].append(shlex.split(line[4:]))
    return steps


def _check_python_command(argv: list[str], out: Path, work: Path) -> None:
    assert argv[0] == sys.executable
    argv = [a.replace("$WORK", str(work)) for a in argv[1:]]
    for a in argv:  # results go under OUT, scratch under the work folder
        if a.startswith("/"):
            assert a.startswith((str(out) + "/", str(work) + "/")), a
    if argv[0].startswith("benchmarks/"):
        script = REPO / argv[0]
        assert script.is_file(), script
        _module(script).parse_args(argv[1:])  # SystemExit(2) on a flag the script does not take
    elif argv[:2] == ["-m", "pytest"]:
        assert "-p" in argv and argv[argv.index("-p", argv.index("no:cacheprovider")) + 1] == "no:logging"
        assert (REPO / "tests" / "gpu").is_dir() and "tests/gpu" in argv
        assert "--timeout" in argv or "faulthandler_timeout=120" in argv
        # the DeepSpeed tests it leaves out are the ones the zero steps run
        assert argv[argv.index("-k") + 1] == "not deepspeed"
        assert "def test_deepspeed_" in (REPO / "tests" / "gpu" / "test_gpu_train.py").read_text()
    elif argv[:2] == ["-m", "accelerate.commands.launch"]:
        config = argv[argv.index("--config_file") + 1]
        assert (REPO / config).is_file(), config
        cli = argv.index("rloo.cli")
        assert argv[cli - 1] == "-m" and argv[cli + 1] == "train"
        from rloo.config import RLOOConfig
        from rloo.parsing import parse_config

        cfg = parse_config(RLOOConfig, argv[cli + 2 :], prog="rloo train")
        assert cfg.bf16 and cfg.save_steps == 1
    elif argv[0] == "-c":
        compile(argv[1], "<gpu_session -c>", "exec")
    else:
        raise AssertionError(f"a command this test does not know: {argv}")


@pytest.mark.parametrize("stage", sorted(STEPS))
def test_dry_run_commands_name_real_files_and_flags(stage: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    steps = _dry_run(stage, out)
    assert [name for name, _, _ in steps] == STEPS[stage]
    # every step within the stage's limit, after the set-up
    assert sum(budget for _, budget, _ in steps) <= STAGE_LIMIT - SETUP_S
    for name, _, commands in steps:
        assert commands, name
        for argv in commands:
            _check_python_command(argv, out, Path("/work-folder"))


def test_dry_run_stage_contents(tmp_path: Path) -> None:
    out = tmp_path / "out"
    commands = {name: cmds for name, _, cmds in _dry_run("1", out)}
    (decode,) = commands["decode"]
    assert decode[1:4] == ["benchmarks/bench_decode.py", "--preset", "0.5b"]
    (bench,) = commands["bench-0.5b-ours"]
    assert bench[bench.index("--only") + 1] == "ours" and bench[bench.index("--generation") + 1] == "compiled"
    commands = {name: cmds for name, _, cmds in _dry_run("2", out)}
    for stage in ("2", "3"):
        first, resume = commands[f"zero{stage}"]  # run 2 updates, then resume to 4 in the same folder
        assert f"configs/accelerate/deepspeed_zero{stage}.yaml" in first
        assert first[:-1] == resume[:-1] and (first[-1], resume[-1]) == ("2", "4")
    commands = {name: cmds for name, _, cmds in _dry_run("3", out)}
    (trl,) = commands["bench-0.5b-vs-trl"]
    assert "--only" not in trl and trl[trl.index("--sizes") + 1] == "0.5b"
    (big,) = commands["bench-1.5b-ours"]
    assert big[big.index("--sizes") + 1] == "1.5b" and big[big.index("--only") + 1] == "ours"


FAKE_PYTHON = """#!/usr/bin/env bash
# a stand-in python: the benchmarks fail, hang or write figures as the test asks; the rest is real python
json_arg() {{ while [ $# -gt 0 ]; do [ "$1" = --json ] && echo "$2"; shift; done; }}
case "$1" in
  benchmarks/bench_decode.py) cp {decode_json} "$(json_arg "$@")"; echo "decode table"; exit 3 ;;
  benchmarks/bench_gpu.py) echo started; exec sleep 60 ;;
  benchmarks/*) echo "should have been skipped"; exit 0 ;;
  -c) [ "$2" = "import torch" ] && exit 0 ;;
  -) if [ -z "${{GPU_SESSION_OUT:-}}" ]; then cat >/dev/null; echo "cuda: None available: False"; exit 0; fi ;;
esac
exec {python} "$@"
"""


def test_a_stage_reports_failures_timeouts_and_skips(tmp_path: Path) -> None:
    # decode fails (exit 3: its greedy agreement below 90%) having written its figures; the benchmark hangs until its
    # budget (here the whole stage's 8 s) runs out; no time is left for the profile: every step is
    # accounted for, the stage exits 1, and the summary table comes last
    decode = {
        "variants": {
            "fp32-autocast": {"figures": {"decode_ms_per_step": 6.5}},
            "whole-step": {"figures": {"decode_ms_per_step": 2.25}},
            "dynamic": {"error": "failed: RuntimeError: x"},
        },
        "checks": [{"ok": False, "greedy": 0.5}],
    }
    (tmp_path / "decode.json").write_text(json.dumps(decode))
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON.format(decode_json=tmp_path / "decode.json", python=sys.executable))
    fake.chmod(0o755)
    out = tmp_path / "out"
    proc = _session(
        "1",
        str(out),
        env={"PYTHON": str(fake), "WHEELS": str(tmp_path / "none"), "STAGE_LIMIT": "8", "MIN_STEP": "2"},
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    table = proc.stdout.strip().splitlines()[-5:]
    assert table[:2] == ["| step | status | seconds | headline |", "|---|---|---:|---|"]
    decode_row, bench_row, profile_row = (line.split(" | ") for line in table[2:])
    assert decode_row[:2] == ["| decode", "FAILED (exit 3)"]
    assert "fp32-autocast 6.50, whole-step 2.25" in decode_row[3]
    assert "greedy MISMATCH (50.0% equal)" in decode_row[3]
    assert bench_row[:2] == ["| bench-0.5b-ours", "TIMEOUT"] and int(bench_row[2]) <= 8
    assert profile_row[:2] == ["| profile-0.5b", "skipped"] and "no time left" in profile_row[3]
    assert (out / "decode.out").read_text() == "decode table\n"
    assert (out / "bench-0.5b-ours.out").read_text() == "started\n"
    assert not (out / "profile-0.5b.out").exists()
    assert (out / "summary.md").read_text().strip().splitlines() == table
    assert "available: False" in (out / "environment.txt").read_text()


FAKE_BENCH_PYTHON = """#!/usr/bin/env bash
# a stand-in python: bench_gpu.py writes the prepared figures of its step; the rest is real python
json_arg() {{ while [ $# -gt 0 ]; do [ "$1" = --json ] && echo "$2"; shift; done; }}
case "$1" in
  benchmarks/bench_gpu.py) f=$(json_arg "$@"); [ -f {figures}/"${{f##*/}}" ] && cp {figures}/"${{f##*/}}" "$f"; echo table; exit 0 ;;
  -c) [ "$2" = "import torch" ] && exit 0 ;;
  -) if [ -z "${{GPU_SESSION_OUT:-}}" ]; then cat >/dev/null; echo "cuda: None available: False"; exit 0; fi ;;
esac
exec {python} "$@"
"""


def _bench_json(**steady: float) -> dict[str, object]:
    runs = {
        trainer: {
            "steady_episodes_per_s": eps,
            "generation_fraction_of_read_bound": 0.5,
            "training_mfu_executed": 0.25,
            "training_mfu": 0.75,
        }
        for trainer, eps in steady.items()
    }
    return {"figures": {"0.5b": runs}}


@pytest.mark.parametrize("with_trl_run", [True, False])
def test_stage_3_summary_gives_the_torch_compile_ratio(tmp_path: Path, with_trl_run: bool) -> None:
    # ours with --torch_compile (12 ep/s steady) against the ours row of bench-0.5b-vs-trl (8): 1.50x;
    # without that run the layers row still has its own headline, and no ratio
    figures = tmp_path / "figures"
    figures.mkdir()
    (figures / "bench-0.5b-ours-layers.json").write_text(json.dumps(_bench_json(ours=12.0)))
    if with_trl_run:
        (figures / "bench-0.5b-vs-trl.json").write_text(json.dumps(_bench_json(ours=8.0, trl=4.0)))
    fake = tmp_path / "python"
    fake.write_text(FAKE_BENCH_PYTHON.format(figures=figures, python=sys.executable))
    fake.chmod(0o755)
    out = tmp_path / "out"
    proc = _session("3", str(out), env={"PYTHON": str(fake), "WHEELS": str(tmp_path / "none")})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {
        r[0]: r for r in (line.split(" | ") for line in (out / "summary.md").read_text().splitlines()[2:])
    }
    layers = rows["| bench-0.5b-ours-layers"]
    assert layers[1] == "ok"
    assert "0.5b ours: 12.0 ep/s steady" in layers[3] and "MFU 25% exec / 75% nominal" in layers[3]
    ratio = "--torch_compile / without (bench-0.5b-vs-trl ours): 1.50x steady"
    if with_trl_run:
        assert ratio in layers[3]
        assert "ratio 2.00x steady" in rows["| bench-0.5b-vs-trl"][3]
    else:
        assert "--torch_compile / without" not in layers[3]
    assert not (out / "summary.err").read_text().strip()


def _fake(tmp_path: Path, text: str, **fields: object) -> Path:
    fake = tmp_path / "python"
    fake.write_text(text.format(python=sys.executable, **fields))
    fake.chmod(0o755)
    return fake


def _rows(out: Path) -> dict[str, list[str]]:
    """summary.md's rows by step: [name, status, seconds, headline]."""
    rows = {}
    for line in (out / "summary.md").read_text().splitlines()[2:]:
        assert line.startswith("| ") and line.endswith(" |"), line
        cells = re.split(r" \| ", line[2:-2])  # "\|" in a headline is not a column
        assert len(cells) == 4, line
        rows[cells[0]] = cells
    return rows


NO_TORCH_PYTHON = """#!/usr/bin/env bash
# a stand-in for a node's default python that is not the one with its CUDA torch
if [ "$1" = -c ] && [ "$2" = "import torch" ]; then
  printf 'Traceback (most recent call last):\\n  File "<string>", line 1\\nModuleNotFoundError: No module named %s\\n' "'torch'" >&2
  exit 1
fi
exec {python} "$@"
"""
NO_TORCH_LINE = (
    "gpu_session: {py} cannot import torch: set PYTHON to the interpreter with the node's CUDA torch "
    "(e.g. PYTHON=/usr/bin/python3.12)"
)


@pytest.mark.parametrize("python", ["without-torch", "absent"])
def test_a_python_without_torch_stops_before_any_step(tmp_path: Path, python: str) -> None:
    py = _fake(tmp_path, NO_TORCH_PYTHON) if python == "without-torch" else tmp_path / "no-such-python"
    out = tmp_path / "out"
    env = {"PYTHON": str(py), "WHEELS": str(tmp_path / "none")}
    proc = _session("1", str(out), env=env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stdout == ""  # no environment report, no step, no summary
    assert NO_TORCH_LINE.format(py=py) in proc.stderr.splitlines()
    assert "Traceback" not in proc.stderr and "ModuleNotFoundError" not in proc.stderr
    assert sorted(p.name for p in out.iterdir()) == []
    # a dry run runs nothing, so needs no torch
    dry = _session("1", str(tmp_path / "dry"), env={**env, "DRY_RUN": "1"})
    assert dry.returncode == 0, dry.stderr
    assert "step decode (budget 200 s)" in dry.stdout.splitlines()


FAILING_PYTHON = """#!/usr/bin/env bash
# a stand-in python: decode dies on an import, the benchmark on a long error line; the profile writes nothing
case "$1" in
  benchmarks/bench_decode.py) printf 'Traceback (most recent call last):\\n  File "x", line 1\\nModuleNotFoundError: No module named %s\\n\\n' "'x'" >&2; exit 1 ;;
  benchmarks/bench_gpu.py) printf 'RuntimeError: a|b %0300d\\n' 0 >&2; exit 1 ;;
  benchmarks/profile_gpu.py) echo "a warning" >&2; exit 0 ;;
  -c) [ "$2" = "import torch" ] && exit 0 ;;
  -) if [ -z "${{GPU_SESSION_OUT:-}}" ]; then cat >/dev/null; echo "cuda: None available: False"; exit 0; fi ;;
esac
exec {python} "$@"
"""


def test_a_failed_step_without_a_headline_shows_its_stderr(tmp_path: Path) -> None:
    fake = _fake(tmp_path, FAILING_PYTHON)
    out = tmp_path / "out"
    proc = _session("1", str(out), env={"PYTHON": str(fake), "WHEELS": str(tmp_path / "none")})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    rows = _rows(out)
    assert rows["decode"][1:] == ["FAILED (exit 1)", "0", "stderr: ModuleNotFoundError: No module named 'x'"]
    bench = rows["bench-0.5b-ours"]
    assert bench[1] == "FAILED (exit 1)"
    assert bench[3].startswith("stderr: RuntimeError: a\\|b 000") and bench[3].endswith("0...")
    assert len(bench[3]) == len("stderr: ") + 100 + len("...") + 1  # cut to 100 characters, the | escaped
    assert rows["profile-0.5b"][1:] == ["ok", "0", ""]  # a step that did not fail: its stderr is not news

    # a step cut off before its command ran: the reason is the last line of its stderr too
    out = tmp_path / "out-timeout"
    proc = _session(
        "1",
        str(out),
        env={"PYTHON": str(fake), "WHEELS": str(tmp_path / "none"), "STAGE_LIMIT": "4", "MIN_STEP": "1"},
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    decode = _rows(out)["decode"]
    assert decode[1] == "TIMEOUT"
    assert decode[3] == "stderr: gpu_session: decode: no time left in the step"


def _dry_run_budgets(stage: str, env: dict[str, str]) -> list[tuple[str, int | None]]:
    """(step, budget) from a dry run, budget None for a step it says would be skipped (and gives no command)."""
    proc = _session(stage, "out", env={"DRY_RUN": "1", **env})
    assert proc.returncode == 0, proc.stderr
    steps: list[tuple[str, int | None]] = []
    lines = proc.stdout.splitlines()
    assert f"setup (~{SETUP_S} s)" in lines[1]  # the estimate the budgets below count on
    for i, line in enumerate(lines):
        if m := re.fullmatch(r"step (\S+) \(budget (\d+) s\)", line):
            steps.append((m[1], int(m[2])))
        elif m := re.fullmatch(r"step (\S+) \(skipped: no time left, (\d+) s of the stage\)", line):
            steps.append((m[1], None))
            assert i + 1 == len(lines) or not lines[i + 1].startswith("  $"), line
    return steps


def test_dry_run_budgets_under_a_stage_limit() -> None:
    # the lease's example: 240 s for stage 3 is 210 s after the set-up, the ratio's 170 s, then 40 s: too little
    assert _dry_run_budgets("3", {"STAGE_LIMIT": "240"}) == [
        ("bench-0.5b-vs-trl", 170),
        ("bench-1.5b-ours", None),
        ("bench-0.5b-ours-layers", None),
    ]
    assert _dry_run_budgets("1", {"STAGE_LIMIT": "300"}) == [
        ("decode", 200),
        ("bench-0.5b-ours", 70),  # cut to what is left
        ("profile-0.5b", None),
    ]
    assert _dry_run_budgets("1", {"STAGE_LIMIT": "300", "MIN_STEP": "80"}) == [
        ("decode", 200),
        ("bench-0.5b-ours", None),
        ("profile-0.5b", None),
    ]


@pytest.mark.parametrize("stage", sorted(STEPS))
@pytest.mark.parametrize("limit", [60, 100, 240, 330, 420, 510, 900])
def test_dry_run_budgets_follow_the_stage_rule(stage: str, limit: int) -> None:
    # the rule of the real run, each step before taking its whole budget: cut to what is left, skipped under
    # MIN_STEP (45 s); the default limit cuts nothing
    full = _dry_run_budgets(stage, {})
    assert [name for name, _ in full] == STEPS[stage] and all(b for _, b in full)
    expected: list[tuple[str, int | None]] = []
    left = limit - SETUP_S
    for name, budget in full:
        assert budget is not None
        if left < 45:
            expected.append((name, None))
            continue
        expected.append((name, min(budget, left)))
        left -= min(budget, left)
    assert _dry_run_budgets(stage, {"STAGE_LIMIT": str(limit)}) == expected


@pytest.mark.parametrize("var", ["STAGE_LIMIT", "MIN_STEP"])
@pytest.mark.parametrize("value", ["abc", "0", "-5", "1.5", " 60", "60s", "0x10"])
@pytest.mark.parametrize("dry", [True, False])
def test_a_bad_stage_limit_or_min_step_is_one_line_and_exit_2(
    tmp_path: Path, var: str, value: str, dry: bool
) -> None:
    out = tmp_path / "out"
    env = {var: value, "WHEELS": str(tmp_path / "none"), **({"DRY_RUN": "1"} if dry else {})}
    proc = _session("1", str(out), env=env)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.splitlines() == [
        f"gpu_session: {var} must be a whole number of seconds above 0, not '{value}'"
    ]
    assert not out.exists()


def test_stage_2_dry_run_is_readable() -> None:
    proc = _session("2", "out", env={"DRY_RUN": "1"})
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    (work,) = [line for line in lines if line.startswith("$WORK: ")]  # what $WORK in the commands is
    assert "scratch folder" in work and "mktemp -d" in work
    commands = [line for line in lines if line.startswith("  $ ")]
    assert all("\\" not in line for line in commands), commands  # no \$WORK, no "import\ sys\;"
    assert any(" --model_name_or_path $WORK/tiny/policy " in line for line in commands)
    (setup,) = [line for line in commands if " -c " in line]
    assert setup.startswith(
        f'  $ {sys.executable} -c "import sys; from rloo.demo.tiny import build_tiny_setup; '
    )
    assert setup.endswith('" $WORK/tiny $WORK/toy')
    # stages without $WORK do not explain it
    assert not any(
        line.startswith("$WORK") for line in _session("1", "out", env={"DRY_RUN": "1"}).stdout.splitlines()
    )


@pytest.mark.slow
def test_stage_2_without_a_gpu(tmp_path: Path) -> None:
    # the real thing on CPU: pytest -m gpu with the session's flags skips its modules, the tiny model is
    # built, and the ZeRO steps say why they did not run
    out = tmp_path / "out"
    proc = _session(
        "2", str(out), env={"CUDA_VISIBLE_DEVICES": "", "WHEELS": str(tmp_path / "none")}, timeout=600
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    rows = [line.split(" | ") for line in (out / "summary.md").read_text().splitlines()[2:]]
    assert [(r[0], r[1]) for r in rows] == [
        ("| tests", "ok"),
        ("| zero-setup", "ok"),
        ("| zero2", "skipped"),
        ("| zero3", "skipped"),
    ]
    assert "skipped" in rows[0][3]  # pytest's "2 skipped in ..."
    assert "no CUDA GPU" in rows[2][3]
    assert (out / "gpu-tests.xml").is_file()
