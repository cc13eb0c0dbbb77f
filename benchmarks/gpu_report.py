#!/usr/bin/env python
"""The GPU window's results as the markdown of benchmarks/RESULTS.md, on any machine (no torch needed).

    python benchmarks/gpu_report.py RESULTS_DIR [--output FILE]

RESULTS_DIR holds what a gpu_window.py call returned (results.tar.gz, or its unpacked state.json and
raw/). The report names the device, gives a row per step (status, seconds, which call, a headline
figure), then bench_gpu.py's tables (ours vs TRL at 0.5B with the settings that differed, ours with
compiled layers at 1.5B and 0.5B and the ratio of the latter over ours without them), bench_decode.py's
table, the GPU tests' outcome and the ZeRO runs' updates. gpu_window.py writes the same as summary.md.
Exit status: 0, or 2 (one line) when RESULTS_DIR holds neither results.tar.gz nor state.json.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_window import STEP_NAMES  # beside this file

# the window's steps, in its order; the benchmark steps each leave a bench.json
BENCH_STEPS = tuple(name for name in STEP_NAMES if name.startswith("bench-"))


def _load_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _last_line(path: Path, pattern: str = "") -> str:
    """The last non-empty line of a file (matching ``pattern`` when given), cut to 160 characters."""
    if not path.is_file():
        return ""
    lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
    if pattern:
        lines = [line for line in lines if re.search(pattern, line)]
    return lines[-1][:160] if lines else ""


def device_name(root: Path, benches: dict[str, Any]) -> str:
    """The GPU as the environment report or a benchmark named it."""
    gpu = _last_line(root / "raw" / "environment.txt", r"^gpu: ")
    if gpu:
        return gpu.removeprefix("gpu: ")
    if _last_line(root / "raw" / "environment.txt", r"available: False"):
        return "no CUDA GPU"
    for data in benches.values():
        if data.get("gpu"):
            return str(data["gpu"])
    return "unknown device (no environment report)"


def zero_updates(raw: Path, stage: int) -> list[Any]:
    metrics = raw / "zero" / f"zero{stage}-metrics.jsonl"
    if not metrics.is_file():
        return []
    return [json.loads(line).get("episode") for line in metrics.read_text().splitlines() if line.strip()]


def collect_from(root: Path) -> dict[str, Any]:
    """Everything the report shows, read from an unpacked results folder (state.json, raw/)."""
    raw = root / "raw"
    state = _load_json(root / "state.json") or {"steps": {}}
    benches = {name: data for name in BENCH_STEPS if (data := _load_json(raw / name / "bench.json"))}
    return {
        "device": device_name(root, benches),
        "environment": (raw / "environment.txt").read_text() if (raw / "environment.txt").is_file() else "",
        "calls": state.get("calls", 0),
        "steps": state.get("steps", {}),
        "bench": benches,
        "decode": _load_json(raw / "decode" / "decode.json"),
        "tests": _last_line(raw / "tests" / "pytest.out", r"\d+ (passed|failed|skipped|error|deselected)"),
        "zero": {str(stage): zero_updates(raw, stage) for stage in (2, 3)},
        "stderr": {name: _last_line(raw / name / f"{_main_log(name)}.err") for name in STEP_NAMES},
    }


def _main_log(step: str) -> str:
    return {"tests": "pytest", "decode": "decode", "zero": "zero3-resume"}.get(step, "bench")


def collect(path: Path) -> dict[str, Any]:
    """:func:`collect_from` a results folder, unpacking its results.tar.gz first when it is packed."""
    archive = path / "results.tar.gz"
    # a call's OUT holds the archive and a copy of state.json: the archive has the raw results
    if (path / "raw").is_dir() or ((path / "state.json").is_file() and not archive.is_file()):
        return collect_from(path)
    if not archive.is_file():
        raise FileNotFoundError(f"{path} holds neither results.tar.gz nor state.json")
    with tempfile.TemporaryDirectory() as tmp, tarfile.open(archive) as tar:
        tar.extractall(tmp, filter="data")
        return collect_from(Path(tmp))


# ------------------------------------------------------------------------------------------------------
def _pct(value: Any) -> str:
    return "n/a" if not isinstance(value, (int, float)) or value != value else f"{value:.0%}"


def steady(data: dict[str, Any] | None, trainer: str = "ours") -> float:
    """Steady episodes/s of a trainer in a bench step's figures (its first size), NaN when absent."""
    for runs in (data or {}).get("figures", {}).values():
        value = runs.get(trainer, {}).get("steady_episodes_per_s")
        if isinstance(value, (int, float)):
            return float(value)
    return math.nan


def run_headline(size: str, trainer: str, f: dict[str, Any]) -> str:
    """One run's figures in a line: steady episodes/s, both MFUs, the decode bound, CUDA-graph skips."""
    text = (
        f"{size} {trainer}: {f.get('steady_episodes_per_s', math.nan):.1f} ep/s steady, MFU "
        f"{_pct(f.get('training_mfu_needed'))} needed / {_pct(f.get('training_mfu_executed'))} executed, "
        f"gen {_pct(f.get('generation_fraction_of_bandwidth_bound'))} of bound"
    )
    skips = f.get("cudagraph_skips")
    if isinstance(skips, (int, float)) and skips == skips:  # ours only: TRL compiles nothing
        text += f", {skips:.0f} CUDA-graph skips"
    return text


def bench_headline(data: dict[str, Any]) -> str:
    parts = []
    for size, runs in data.get("figures", {}).items():
        parts += [run_headline(size, trainer, f) for trainer, f in runs.items()]
        if {"ours", "trl"} <= set(runs):
            parts.append(f"ours/TRL {steady(data) / steady(data, 'trl'):.2f}x steady")
    return "; ".join(parts)


def decode_headline(data: dict[str, Any]) -> str:
    cells = [
        f"{name} {v['figures']['decode_ms_per_step']:.2f} ms"
        for name, v in data.get("variants", {}).items()
        if "figures" in v
    ]
    checks = [("greedy ok" if c["ok"] else "greedy MISMATCH") for c in data.get("checks", [])]
    return "decode/step: " + ", ".join(cells) + (f"; {', '.join(checks)}" if checks else "")


def headline(name: str, data: dict[str, Any]) -> str:
    """One figure a step is remembered by; its stderr's last line when it has none."""
    text = ""
    if name in data["bench"]:
        text = bench_headline(data["bench"][name])
        if name == "bench-0.5b-ours-layers":
            ratio = steady(data["bench"][name]) / steady(data["bench"].get("bench-0.5b-vs-trl"))
            if ratio == ratio:
                text += f"; compiled layers / without: {ratio:.2f}x steady"
    elif name == "decode" and data.get("decode"):
        text = decode_headline(data["decode"])
    elif name == "tests":
        text = data.get("tests", "")
    elif name == "zero":
        text = ", ".join(f"ZeRO-{s}: {len(eps)} updates" for s, eps in data["zero"].items() if eps)
    status = data["steps"].get(name, {}).get("status", "")
    if not text and status not in ("ok", "skipped", ""):
        text = f"stderr: {data['stderr'].get(name, '')}"
    return text


def render(data: dict[str, Any]) -> str:
    """The markdown: the device, a row per step, then each benchmark's own table."""
    lines = [f"### GPU window on {data['device']} ({data['calls']} call(s))", ""]
    lines += ["| step | status | seconds | call | headline |", "|---|---|---:|---:|---|"]
    for name in STEP_NAMES:
        record = data["steps"].get(name)
        if record is None:
            lines.append(f"| {name} | not run | | | |")
            continue
        cell = "; ".join(x for x in (record.get("note", ""), headline(name, data)) if x).replace("|", "\\|")
        lines.append(f"| {name} | {record['status']} | {record['seconds']:.0f} | {record['call']} | {cell} |")
    import bench_gpu

    for name, bench in data["bench"].items():
        sizes = list(bench.get("figures", {}))
        lines += ["", f"#### {name} ({bench.get('gpu', data['device'])})", ""]
        lines.append(bench_gpu.render_table(bench["figures"], sizes, bench.get("raw")))
    if data.get("decode") and data["decode"].get("variants"):
        import bench_decode

        lines += ["", f"#### decode A/B ({data['decode'].get('device', data['device'])})", ""]
        lines.append(bench_decode.render(data["decode"]))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="The GPU window's results as markdown.")
    p.add_argument("results", type=Path, help="A folder with results.tar.gz (or its unpacked contents).")
    p.add_argument("--output", type=Path, help="Write the markdown here too.")
    args = p.parse_args(argv)
    try:
        data = collect(args.results)
    except (FileNotFoundError, tarfile.TarError) as e:
        print(f"gpu_report: {e}", file=sys.stderr)
        return 2
    text = render(data)
    if args.output:
        args.output.write_text(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
