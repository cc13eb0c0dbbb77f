#!/usr/bin/env python
"""The next GPU window: every GPU measurement in one command of under 10 minutes on a bare, air-gapped
GPU node, and the same command again to rerun only what did not finish.

A lent device gives a session 15 minutes of device time in all (a few minutes of start-up, idle time and
every command included), at most 10 minutes a command and 8 result files. This driver, in one call:

1. installs the carried wheels (``make gpu-wheels``: ours, TRL, DeepSpeed, pytest-timeout...) with
   ``pip install --no-index --no-deps`` into a scratch folder, ahead of nothing the node has;
2. launches, in the background, ZeRO-2 and ZeRO-3 runs of a tiny rloo.demo model (2 updates, then
   resumed to 4; DS_ACCELERATOR=cuda) beside the GPU tests, which time nothing: every timed step
   waits for them, so no figure is measured beside another job on the GPU;
3. runs, in order of value, each bounded by what is left of the call and skipped below its minimum:
   the bf16 / whole-step / static-cache / packed-row / shared-prefix GPU tests (with a per-test
   timeout), ours vs TRL at 0.5B (bench_gpu.py), the decode A/B (bench_decode.py), ours at 1.5B with
   compiled layers (--torch-compile), ours at 0.5B with compiled layers;
4. after every step, packs what there is into OUT (at most 8 files: results.tar.gz with every step's
   raw output, summary.md, summary.json, state.json), so that a call cut short still returns what it
   measured.

A state file (WORK/state.json) records how each step ended. The second call -- the same command, with
the first call's results.tar.gz carried back in WORK -- reruns only the steps that did not get to an end
(ran out of time, or skipped for time); a step that failed is not run again (its output says why, and
the same code would fail the same way).

vLLM is not sent: its wheels are hundreds of MB (the carry limit is 64 MiB) and its pin needs another
torch than the node's; the vLLM paths are covered on CPU (make test-vllm).

    python benchmarks/gpu_window.py --out "$OUT"              # on the node (benchmarks/README.md)
    python benchmarks/gpu_window.py --dry-run                 # the plan of both calls, its budget check
    python benchmarks/gpu_report.py RESULTS_DIR               # here: the RESULTS.md tables

Exit status: 0 when every step planned for this call finished, 1 when one failed, ran out of time or was
skipped for time (its results are packed all the same), 2 for a usage error, wheels pip cannot install,
a missing wheels folder, or a python that cannot import torch (one line, no traceback); 2 too for a dry run whose plan does not
fit the device time; 75 when the python sees no CUDA GPU (nothing is run or recorded: a later call may
find it).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DEVICE_SECONDS = 900  # a session's device time: 15 minutes, start-up and idle time included
STARTUP_S = 180  # the device's start-up, counted against the session
BETWEEN_CALLS_S = 20  # idle time between the two calls (reading the first call's reply, carrying back)
CALL_BUDGET_S = 560  # one call: inside a 10-minute command, with room for the pack and the kill grace
WHEELS_S = 20  # installing the carried wheels and the environment report, every call
PACK_S = 15  # the final pack and the wait for the background steps' last seconds
MAX_RESULT_FILES = 8
MAX_FILE_BYTES = 16 * 2**20
LOG_TAIL_BYTES = 2 * 2**20  # a log longer than this is packed as its last 2 MiB (the error is at the end)
RESULT_FILES = ("results.tar.gz", "summary.md", "summary.json", "state.json")
# the GPU tests worth the window: bf16 training, greedy/sampling parity, static and whole-step decode
GPU_TESTS = (
    "bf16_first_ratio or bf16_run_trains_without_nan or static_decode_matches_dynamic"
    " or whole_step_graph_replays or bf16_run_samples_from_a_bf16_copy"
    " or packed_rows_match or shared_prefix_decode_matches or compiled_race_draws"
)
ZERO_STAGES = (2, 3)


@dataclass(frozen=True)
class Step:
    """One measurement: a name (its folder under raw/), its budget and the least it starts with."""

    name: str
    budget: int  # seconds
    minimum: int  # seconds: with less left than this, the step is skipped (for the next call)
    what: str
    background: bool = False
    timed: bool = True  # False: measures no time, so the background step may run beside it


# In order of value. Budgets from the last H100 session (benchmarks/RESULTS.md): ours at 0.5B with the
# compiled decode ~55 s (model build and load included), TRL at 0.5B ~40 s; 1.5B ~175 s with layers
# compiled; the decode A/B ~100 s (four variants, CUDA-graph capture each); a DeepSpeed launch of the
# tiny model ~30 s (four of them, in the background beside the untimed tests, as long as they are).
STEPS: tuple[Step, ...] = (
    Step("zero", 120, 90, "ZeRO-2 and ZeRO-3: tiny model, 2 updates then resumed to 4", background=True),
    Step(
        "tests",
        120,
        60,
        "GPU tests: bf16, static cache, whole-step graph, packed rows, shared prefix (pytest -m gpu)",
        timed=False,
    ),
    Step("bench-0.5b-vs-trl", 140, 100, "ours vs TRL at 0.5B (bench_gpu.py, compiled decode)"),
    Step("decode", 90, 60, "decode A/B at 0.5B (bench_decode.py: 4 variants)"),
    Step("bench-1.5b-ours-layers", 175, 110, "ours at 1.5B, compiled layers (--torch-compile)"),
    Step("bench-0.5b-ours-layers", 90, 60, "ours at 0.5B, compiled layers (--torch-compile)"),
)
STEP_NAMES = tuple(step.name for step in STEPS)


# ------------------------------------------------------------------------------------------------------
# the plan: which steps run, with what budget
@dataclass
class PlannedStep:
    step: Step
    budget: int  # 0: skipped
    why: str = ""


def plan_call(budget: int, done: set[str]) -> list[PlannedStep]:
    """The steps a call of ``budget`` seconds runs if each takes its whole budget: the wheels and the
    final pack first set aside, each foreground step cut to what is left and skipped below its minimum;
    the background step runs beside the untimed steps, and the first timed step waits for it to end.
    Finished steps are not planned."""
    left = budget - WHEELS_S - PACK_S
    background = 0  # seconds the background step may still run when the next timed step would start
    planned = []
    for step in STEPS:
        if step.name in done:
            continue
        if step.timed and not step.background and background > 0:
            left -= background  # the timed step waits for the background one
            background = 0
        room = left
        if room < step.minimum:
            planned.append(PlannedStep(step, 0, f"skipped: {max(room, 0)} s left, needs {step.minimum}"))
            continue
        granted = min(step.budget, room)
        if step.background:
            background = granted
        else:
            left -= granted
            if not step.timed:
                background = max(background - granted, 0)
        planned.append(PlannedStep(step, granted))
    return planned


def _serial_seconds(plan: list[PlannedStep]) -> int:
    """The call's seconds if every planned step takes its budget: the foreground steps, and the wait for
    the background step where it outlasts the untimed steps beside it."""
    background = [p.budget for p in plan if p.step.background]
    beside = sum(p.budget for p in plan if not p.step.background and not p.step.timed)
    timed = sum(p.budget for p in plan if not p.step.background and p.step.timed)
    return max(beside, *background, 0) + timed


def second_call_budget(first_budget: int) -> int:
    """The device time a second call has: the session's, less start-up, the first call and the gap."""
    return DEVICE_SECONDS - STARTUP_S - first_budget - BETWEEN_CALLS_S


def dry_run(budget: int) -> int:
    """Print both calls' plans with their budgets; 0 when they fit the device time, 2 when not."""
    first = plan_call(budget, set())
    ran = {p.step.name for p in first if p.budget}
    second_budget = second_call_budget(budget)
    second = plan_call(second_budget, ran) if second_budget > 0 else []
    print(f"device time {DEVICE_SECONDS} s = start-up {STARTUP_S} s + call 1 + {BETWEEN_CALLS_S} s + call 2")
    print("vLLM is not sent: its wheels are hundreds of MB (64 MiB may be carried) and it pins another torch")
    for number, call_budget, plan in ((1, budget, first), (2, second_budget, second)):
        print(f"call {number}: budget {call_budget} s (wheels {WHEELS_S} s, pack {PACK_S} s)")
        for p in plan:
            where = "background" if p.step.background else "foreground"
            status = f"{p.budget} s" if p.budget else p.why
            if p.budget and p.budget < p.step.budget:
                status = f"{p.budget} s (cut from {p.step.budget})"
            print(f"  {p.step.name:<24} {where:<10} {status:<28} {p.step.what}")
    serial = [WHEELS_S + PACK_S + _serial_seconds(plan) for plan in (first, second)]
    total = STARTUP_S + budget + BETWEEN_CALLS_S + max(second_budget, 0)
    fits = serial[0] <= budget and serial[1] <= max(second_budget, 0) and total <= DEVICE_SECONDS
    left_out = [p.step.name for p in second if not p.budget]
    print(f"call 1 uses {serial[0]} of {budget} s; call 2 {serial[1]} of {max(second_budget, 0)} s")
    print(f"total {total} s of {DEVICE_SECONDS}: {'fits' if fits else 'DOES NOT FIT'}")
    if left_out:
        print(f"not in either call if every step takes its whole budget: {', '.join(left_out)}")
    return 0 if fits else 2


# ------------------------------------------------------------------------------------------------------
# the state between calls
def load_state(work: Path) -> dict[str, Any]:
    """WORK/state.json, unpacked first from a carried-back results.tar.gz when only that is there."""
    state_file = work / "state.json"
    archive = work / "results.tar.gz"
    if not state_file.is_file() and archive.is_file():
        with tarfile.open(archive) as tar:
            tar.extractall(work, filter="data")
    if state_file.is_file():
        return dict(json.loads(state_file.read_text()))
    return {"calls": 0, "steps": {}}


def finished(state: dict[str, Any]) -> set[str]:
    """The steps a previous call got to an end, passed or failed: they are not run again (a failure
    would repeat, and its output is packed). Steps that ran out of time or were skipped for it are."""
    return {
        name
        for name, record in state.get("steps", {}).items()
        if str(record.get("status")).startswith(("ok", "failed"))
    }


def record_step(state: dict[str, Any], name: str, status: str, seconds: float, note: str = "") -> None:
    state.setdefault("steps", {})[name] = {
        "status": status,
        "seconds": round(seconds, 1),
        "call": state.get("calls", 0),
        "note": note,
    }


def save_state(work: Path, state: dict[str, Any]) -> None:
    tmp = work / "state.json.tmp"
    tmp.write_text(json.dumps(state, indent=2))
    tmp.replace(work / "state.json")


# ------------------------------------------------------------------------------------------------------
# packing: everything back in at most 8 files
def pack(work: Path, out: Path, summary: Callable[[Path], tuple[str, dict[str, Any]]]) -> list[Path]:
    """Write OUT/results.tar.gz (state.json and every raw/ file, each log cut to its last 2 MiB, smaller
    still if the archive would pass 16 MiB), summary.md, summary.json and state.json; return them."""
    out.mkdir(parents=True, exist_ok=True)
    archive = out / "results.tar.gz"
    for tail in (LOG_TAIL_BYTES, LOG_TAIL_BYTES // 8, LOG_TAIL_BYTES // 64):
        _write_archive(work, archive, tail)
        if archive.stat().st_size < MAX_FILE_BYTES:
            break
    markdown, data = summary(work)
    (out / "summary.md").write_text(markdown)
    (out / "summary.json").write_text(json.dumps(data, indent=2))
    if (work / "state.json").is_file():
        shutil.copyfile(work / "state.json", out / "state.json")
    return [out / name for name in RESULT_FILES if (out / name).is_file()]


def _write_archive(work: Path, archive: Path, tail: int) -> None:
    tmp = archive.with_suffix(".tmp")
    with tarfile.open(tmp, "w:gz") as tar:
        if (work / "state.json").is_file():
            tar.add(work / "state.json", "state.json")
        for path in sorted((work / "raw").rglob("*")) if (work / "raw").is_dir() else []:
            if path.is_file():
                _add_tail(tar, path, path.relative_to(work).as_posix(), tail)
    tmp.replace(archive)


def _add_tail(tar: tarfile.TarFile, path: Path, name: str, tail: int) -> None:
    """Add ``path`` as ``name``, only its last ``tail`` bytes when it is longer (a log's end says why)."""
    import io

    size = path.stat().st_size
    with path.open("rb") as f:
        if size > tail:
            f.seek(size - tail)
        data = f.read()
    info = tarfile.TarInfo(name)
    info.size, info.mtime = len(data), int(path.stat().st_mtime)
    tar.addfile(info, io.BytesIO(data))


# ------------------------------------------------------------------------------------------------------
# the commands
def step_commands(name: str, py: str, raw: Path, scratch: Path) -> list[tuple[str, list[str]]]:
    """(log name, argv) of a step's commands, run in order in the repository root; the step fails at
    the first that fails. Raw results go under ``raw`` (its folder), models and checkpoints under
    ``scratch``."""
    bench = [py, "benchmarks/bench_gpu.py", "--generation", "compiled"]
    if name == "tests":
        return [
            (
                "pytest",
                [py, "-m", "pytest", "-m", "gpu", "tests/gpu", "-q", "-rs", "-p", "no:cacheprovider",
                 "-p", "no:logging", "--timeout", "100", "-k", GPU_TESTS,
                 "--junitxml", str(raw / "junit.xml")],
            )
        ]  # fmt: skip
    if name == "bench-0.5b-vs-trl":
        return [("bench", [*bench, "--sizes", "0.5b", "--updates", "6", "--json", str(raw / "bench.json")])]
    if name == "decode":
        return [
            (
                "decode",
                [py, "benchmarks/bench_decode.py", "--preset", "0.5b", "--json", str(raw / "decode.json")],
            )
        ]
    if name in ("bench-1.5b-ours-layers", "bench-0.5b-ours-layers"):
        size, updates = ("1.5b", "5") if name.startswith("bench-1.5b") else ("0.5b", "6")
        argv = [*bench, "--sizes", size, "--only", "ours", "--torch-compile", "--updates", updates]
        return [("bench", [*argv, "--json", str(raw / "bench.json")])]
    if name == "zero":
        return zero_commands(py, raw, scratch)
    raise ValueError(f"unknown step {name!r}")


def zero_commands(py: str, raw: Path, scratch: Path) -> list[tuple[str, list[str]]]:
    """The tiny rloo.demo model and toy prompts, then per ZeRO stage: 2 updates, resumed to 4."""
    setup = (
        "import sys; from rloo.demo.tiny import build_tiny_setup; from rloo.demo.toy import write_toy_dataset; "
        "build_tiny_setup(sys.argv[1], arch='qwen2'); write_toy_dataset(sys.argv[2])"
    )
    commands = [("zero-setup", [py, "-c", setup, str(scratch / "tiny"), str(scratch / "toy")])]
    for stage in ZERO_STAGES:
        launch = [
            py, "-m", "accelerate.commands.launch",
            "--config_file", f"configs/accelerate/deepspeed_zero{stage}.yaml", "--num_processes", "1",
            "-m", "rloo.cli", "train",
            "--model_name_or_path", str(scratch / "tiny" / "policy"),
            "--reward_funcs", "rloo.demo.toy:letter_reward",
            "--dataset_name", str(scratch / "toy"), "--output_dir", str(scratch / f"zero{stage}"),
            "--per_device_train_batch_size", "16", "--rloo_k", "4", "--response_length", "16",
            "--learning_rate", "1e-5", "--bf16", "--save_steps", "1", "--num_sample_generations", "0",
            "--disable_tqdm",
        ]  # fmt: skip
        commands.append((f"zero{stage}-first", [*launch, "--max_steps", "2"]))
        commands.append((f"zero{stage}-resume", [*launch, "--max_steps", "4"]))  # from update 2's checkpoint
    return commands


def zero_check(raw: Path, scratch: Path) -> str:
    """ "" when both ZeRO runs trained 4 updates and completed, else what is missing; the metrics are
    copied to raw/ either way."""
    problems = []
    for stage in ZERO_STAGES:
        run = scratch / f"zero{stage}"
        metrics = run / "metrics.jsonl"
        updates = 0
        if metrics.is_file():
            shutil.copyfile(metrics, raw / f"zero{stage}-metrics.jsonl")
            updates = sum(1 for line in metrics.read_text().splitlines() if line.strip())
        if updates != 4 or not (run / "training_complete.json").is_file():
            problems.append(f"zero{stage}: {updates} updates, expected 4 and training_complete.json")
    return "; ".join(problems)


# ------------------------------------------------------------------------------------------------------
# running
@dataclass
class Call:
    """One call of the driver: where things go and when it must stop."""

    work: Path
    out: Path
    py: str
    deadline: float  # time.monotonic() by which every step has ended
    env: dict[str, str]
    state: dict[str, Any]
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def raw(self) -> Path:
        return self.work / "raw"

    def left(self) -> float:
        return self.deadline - time.monotonic()


def run_command(argv: list[str], log: Path, seconds: float, env: dict[str, str]) -> int:
    """Run ``argv`` from the repository root for at most ``seconds``; stdout to LOG.out, stderr to
    LOG.err; 124 when it ran out of time (killed with its process group)."""
    with log.with_suffix(".out").open("wb") as out, log.with_suffix(".err").open("wb") as err:
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=out, stderr=err, start_new_session=True)
        try:
            return proc.wait(timeout=max(seconds, 1))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 15)  # the step's own group: accelerate's and pytest's children too
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait()
            return 124


def run_step(call: Call, step: Step, budget: float) -> tuple[str, str]:
    """Run a step's commands within ``budget`` seconds: (status, note)."""
    raw = call.raw / step.name
    shutil.rmtree(raw, ignore_errors=True)  # a rerun replaces what an unfinished call left
    raw.mkdir(parents=True)
    scratch = call.work / "scratch" / step.name
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    end = time.monotonic() + budget
    for log, argv in step_commands(step.name, call.py, raw, scratch):
        rc = run_command(argv, raw / log, end - time.monotonic(), call.env)
        if rc == 5 and step.name == "tests":
            return "ok", "no GPU test collected (no CUDA)"
        if rc == 124:
            return "timeout", f"{log} ran out of its {budget:.0f} s"
        if rc != 0:
            return f"failed (exit {rc})", f"{log} failed"
    note = zero_check(raw, scratch) if step.name == "zero" else ""
    return ("failed" if note else "ok"), note


def finish_step(call: Call, step: Step, status: str, seconds: float, note: str) -> None:
    with call.lock:  # the background step finishes beside a foreground one
        record_step(call.state, step.name, status, seconds, note)
        save_state(call.work, call.state)
        pack(call.work, call.out, summarize)
    print(f"gpu_window: {step.name}: {status} in {seconds:.0f} s {note}".rstrip(), flush=True)


def timed_step(call: Call, step: Step, budget: float) -> None:
    start = time.monotonic()
    try:
        status, note = run_step(call, step, budget)
    except OSError as e:  # a command that cannot start (a missing interpreter): the step failed, not the call
        status, note = "failed", f"{type(e).__name__}: {e}"
    finish_step(call, step, status, time.monotonic() - start, note)


def run_call(call: Call) -> int:
    """Every unfinished step of the plan, the background one beside the others; packed after each."""
    done = finished(call.state)
    background: list[threading.Thread] = []
    for step in STEPS:
        if step.name in done:
            continue
        if step.timed and not step.background:
            for thread in background:  # no figure is measured beside another job on the GPU
                thread.join(max(call.left() - PACK_S, 1))
        room = call.left() - (0 if step.background else PACK_S)
        if room < step.minimum:
            record_step(
                call.state, step.name, "skipped", 0.0, f"{max(room, 0):.0f} s left, needs {step.minimum}"
            )
            continue
        print(f"gpu_window: {step.name} (budget {min(step.budget, room):.0f} s)", flush=True)
        if step.background:
            thread = threading.Thread(
                target=timed_step, args=(call, step, min(step.budget, room)), daemon=True
            )
            thread.start()
            background.append(thread)
        else:
            timed_step(call, step, min(step.budget, room))
    for thread in background:  # it ends by its own budget, inside the call's deadline
        thread.join(max(call.left(), 1))
    with call.lock:
        save_state(call.work, call.state)
        pack(call.work, call.out, summarize)
    statuses = [call.state["steps"].get(step.name, {}).get("status") for step in STEPS]
    return 0 if all(status == "ok" for status in statuses) else 1


# ------------------------------------------------------------------------------------------------------
# the node: wheels, environment
ENV_REPORT = """
import datetime, importlib, os, platform, sys
import torch
print("date:", datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))
print("python:", platform.python_version())
for name in ("torch", "transformers", "accelerate", "peft", "trl", "datasets", "deepspeed", "pytest_timeout"):
    try:
        print(f"{name}: {importlib.import_module(name).__version__}")
    except Exception as e:
        print(f"{name}: not available ({type(e).__name__})")
print("cuda:", torch.version.cuda, "available:", torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"gpu: {p.name}, {p.total_memory / 2**30:.1f} GiB, {p.multi_processor_count} SMs")
"""


def node_env(site: Path) -> dict[str, str]:
    """The steps' environment: this checkout's src/ first, then the carried wheels; offline; DeepSpeed
    told the accelerator (its detection can pick the CPU one on a node without its CUDA ops built)."""
    path = os.pathsep.join(p for p in (str(REPO / "src"), str(site), os.environ.get("PYTHONPATH", "")) if p)
    return {
        **os.environ,
        "PYTHONPATH": path,
        "PYTHONUNBUFFERED": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "DS_ACCELERATOR": "cuda",
    }


def install_wheels(py: str, wheels: Path, site: Path) -> str:
    """pip install --no-index --no-deps every wheel in ``wheels`` into ``site``: "" or why it failed."""
    shutil.rmtree(site, ignore_errors=True)
    site.mkdir(parents=True)
    found = sorted(str(w) for w in wheels.glob("*.whl"))
    if not found:
        return ""
    argv = [py, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir"]
    proc = subprocess.run([*argv, "--target", str(site), *found], capture_output=True, text=True, check=False)
    return "" if proc.returncode == 0 else (proc.stderr.strip().splitlines() or ["pip failed"])[-1]


def environment_report(call: Call, wheels: Path) -> bool:
    """Write raw/environment.txt (wheels carried, versions, GPU); False when the python has no torch."""
    call.raw.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(
        [call.py, "-c", ENV_REPORT], env=call.env, capture_output=True, text=True, check=False
    )
    carried = ", ".join(sorted(w.name for w in wheels.glob("*.whl"))) or "none"
    text = f"wheels carried: {carried}\n{proc.stdout}{proc.stderr[-2000:] if proc.returncode else ''}"
    (call.raw / "environment.txt").write_text(text)
    return proc.returncode == 0


# ------------------------------------------------------------------------------------------------------
# the summary
def summarize(work: Path) -> tuple[str, dict[str, Any]]:
    """summary.md and summary.json of what WORK holds (gpu_report.py's tables)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import gpu_report

    data = gpu_report.collect(work)
    return gpu_report.render(data), data


# ------------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu-check/window-out")),
                   help="Where the <= 8 result files go (default: $OUT).")  # fmt: skip
    p.add_argument("--work", type=Path, default=REPO / "gpu-check" / "window",
                   help="State, raw results and scratch; carry it back for the second call.")  # fmt: skip
    p.add_argument("--wheels", type=Path, default=REPO / "gpu-wheels", help="make gpu-wheels' folder.")
    p.add_argument("--budget", type=int, default=CALL_BUDGET_S, help="Seconds this call may take.")
    p.add_argument("--python", default=sys.executable, help="The interpreter with the node's CUDA torch.")
    p.add_argument("--fresh", action="store_true", help="Forget a previous call's state: rerun every step.")
    p.add_argument("--dry-run", action="store_true", help="Print both calls' plans; run nothing.")
    args = p.parse_args(argv)
    if args.budget <= WHEELS_S + PACK_S:
        p.error(f"--budget must be above {WHEELS_S + PACK_S} s (the wheels and the pack), not {args.budget}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        return dry_run(args.budget)
    start = time.monotonic()
    work = args.work.resolve()
    if args.fresh:
        shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    state = load_state(work)
    state["calls"] = state.get("calls", 0) + 1
    site = work / "site"
    if not args.wheels.is_dir() or not any(args.wheels.glob("*.whl")):
        print(
            f"gpu_window: no wheels in {args.wheels}: build them here with 'make gpu-wheels' and carry the "
            "folder (TRL, DeepSpeed and pytest-timeout are not on the node)",
            file=sys.stderr,
        )
        return 2
    why = install_wheels(args.python, args.wheels, site)
    if why:
        print(f"gpu_window: installing the wheels in {args.wheels} failed: {why}", file=sys.stderr)
        return 2
    call = Call(work, args.out.resolve(), args.python, start + args.budget, node_env(site), state)
    if not environment_report(call, args.wheels):
        print(
            f"gpu_window: {args.python} cannot import torch: pass --python with the node's CUDA torch",
            file=sys.stderr,
        )
        return 2
    if "available: True" not in (call.raw / "environment.txt").read_text():
        # every step would "pass" by skipping itself: nothing measured, and a second call would skip them
        print(
            f"gpu_window: {args.python} sees no CUDA GPU: nothing measured (raw/environment.txt)",
            file=sys.stderr,
        )
        return 75
    save_state(work, state)
    rc = run_call(call)
    print(f"gpu_window: call {state['calls']}, {time.monotonic() - start:.0f} s, results in {call.out}")
    print((call.out / "summary.md").read_text())
    return rc


if __name__ == "__main__":
    sys.exit(main())
