"""benchmarks/bench_async.py without vLLM: its arguments, the figures it derives from a run's metrics, and its
RESULTS.md section (the runs themselves need a vLLM server: ``.venv-vllm/bin/python benchmarks/bench_async.py``)."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.fixtures.scripts import load_script

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_async.py"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_script(SCRIPT)


def test_defaults_are_the_vllm_training_benchmarks_shape(bench: ModuleType) -> None:
    args = bench.parse_args([])
    assert args.shape == "qwen50k" and bench.SHAPES["qwen50k"] == bench.bench_vs_trl.SHAPES["qwen50k"]
    for shape in bench.SHAPES.values():
        assert shape["hidden"] // 4 == 64  # vLLM's CPU attention: head_dim 64 (4 heads)
    assert args.updates > bench.WARMUP + bench.LAST and args.repeats == 1


@pytest.mark.parametrize("argv", [["--updates", "3"], ["--repeats", "0"], ["--shape", "nope"]])
def test_bad_arguments_are_refused(bench: ModuleType, argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        bench.parse_args(argv)


def _metrics(
    out: Path, update_s: list[float], gen_s: float, wait_s: float | None, rewards: list[float]
) -> None:
    out.mkdir(parents=True)
    rows = []
    for i, (t, r) in enumerate(zip(update_s, rewards, strict=True)):
        row: dict[str, Any] = {
            "update": i + 1,
            "episode": 16 * (i + 1),
            "time/update_s": t,
            "time/generation_s": gen_s,
            "time/optimization_s": 1.0,
            "objective/scores": r,
        }
        if wait_s is not None:
            row |= {"time/generation_wait_s": wait_s, "async/staleness": 0.0 if i == 0 else 1.0}
        rows.append(row)
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_figures_from_the_runs_metrics(
    bench: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Episodes over the loop's seconds, steady state after the first 2 updates, the sync run's wait being
    its whole generation; the ratio of the two modes."""
    import subprocess

    monkeypatch.setattr(subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 0, "", ""))
    rewards = [0.1] * 3 + [0.2] * 3 + [0.3] * 5
    _metrics(tmp_path / "s", [8.0, 4.0] + [4.0] * 9, 3.0, None, rewards)
    _metrics(tmp_path / "a", [6.0, 2.0] + [2.0] * 9, 3.0, 0.5, rewards)
    sync = bench.run_one("sync", ["train"], tmp_path / "s")
    ahead = bench.run_one("async", ["train"], tmp_path / "a")
    assert sync["eps"] == pytest.approx(176 / 48) and sync["steady_eps"] == pytest.approx(16 / 4)
    assert sync["wait_s"] == 3.0 and ahead["wait_s"] == 0.5
    assert sync["reward_first"] == pytest.approx(0.1) and sync["reward_last"] == pytest.approx(0.3)
    assert ahead["staleness"] == pytest.approx(10 / 11)
    summary = bench.summarise([sync, ahead])
    assert summary["speedup"] == pytest.approx(48 / 26)  # 8 + 10 x 4 s against 6 + 10 x 2 s
    assert summary["steady_speedup"] == pytest.approx(2.0)
    block = bench.report(summary, bench.parse_args([]), bench.SHAPES["qwen50k"])
    assert "**Async / sync episodes/s: 1.85x** (steady state 2.00x)" in block

    results = tmp_path / "RESULTS.md"
    results.write_text("# Results\n\n## Images: build\n\ntext\n")
    monkeypatch.setattr(bench, "RESULTS_FILE", results)
    bench.write_results(block, "qwen50k")
    bench.write_results(block.replace("1.85x", "3.00x"), "qwen50k")  # replaced in place, not appended
    bench.write_results("the toy task's block", "qwen-toy")  # a second shape: its own block, same heading
    text = results.read_text()
    assert text.count(bench.HEADING) == 1 and text.count(bench.markers("qwen50k")[0]) == 1
    assert "3.00x" in text and "1.85x" not in text and "the toy task's block" in text
    assert text.index(bench.HEADING) < text.index("the toy task's block") < text.index("## Images:")
