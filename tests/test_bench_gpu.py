"""benchmarks/bench_gpu.py: skips cleanly without a GPU; its arithmetic and its workers are right.

The benchmark itself needs a CUDA GPU. Here its workers run on CPU with a tiny model (the same code path,
CUDA calls skipped) so that a metric key or a TRL method it relies on going away is caught.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_gpu.py"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_gpu", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_gpu"] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


def _env() -> dict[str, str]:
    return {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}


@pytest.mark.parametrize("flags", [[], ["--dry-run"], ["--sizes", "1.5b", "--only", "ours"]])
def test_without_a_gpu_it_skips_and_succeeds(flags: list[str]) -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *flags],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "no GPU: skipped"


def test_bad_size_is_a_usage_error() -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--sizes", "7b"],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2
    assert "unknown ['7b']" in proc.stderr


@pytest.mark.parametrize(
    ("name", "label"),
    [
        ("NVIDIA H100 80GB HBM3", "H100 SXM"),
        ("NVIDIA H100 PCIe", "H100 PCIe"),
        ("NVIDIA H100 NVL", "H100 NVL"),
        ("NVIDIA H200", "H200 SXM"),
        ("NVIDIA A100-SXM4-80GB", "A100 80GB SXM"),
        ("NVIDIA A100 80GB PCIe", "A100 80GB PCIe"),
        ("NVIDIA A100-SXM4-40GB", "A100 40GB"),
    ],
)
def test_gpu_peaks_by_device_name(bench: ModuleType, name: str, label: str) -> None:
    found = bench.gpu_peak(name)
    assert found is not None
    assert found[0] == label
    assert found[1] > 1e14  # hundreds of TFLOP/s
    assert 1e12 < found[2] < 1e13  # TB/s


def test_unknown_gpu_has_no_peak(bench: ModuleType) -> None:
    assert bench.gpu_peak("Tesla T4") is None


def test_param_count_matches_the_built_architecture(bench: ModuleType) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, layers, vocab = 64, 3, 512
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=4 * hidden,
        tie_word_embeddings=False,
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    total = sum(p.numel() for p in model.parameters())
    assert bench.llama_param_counts(hidden, layers, vocab) == (total, total - vocab * hidden)
    # the meta-device count agrees with the formula (untied: the input embedding does no matmul)
    assert bench.model_param_counts(config) == (total, total - vocab * hidden)


def test_presets_are_the_sizes_and_shape_they_are_named_after(bench: ModuleType) -> None:
    for name, lo, hi in (("0.5b", 0.4e9, 0.6e9), ("1.5b", 1.3e9, 1.6e9)):
        preset = bench.PRESETS[name]
        total, matmul = bench.preset_param_counts(preset)
        assert lo < total < hi
        assert matmul == total  # Qwen2 ties its embeddings: the one matrix is also the LM head's matmul
        assert preset.hidden // preset.heads in (64, 128)
        # TL;DR: 53-token completions, k=4, 64+ completions per update, full vocabulary
        assert (preset.length, preset.k, preset.vocab) == (53, 4, 151_936)
        assert preset.prompts * preset.k >= 64


def test_mfu_and_bandwidth_bound_by_hand(bench: ModuleType) -> None:
    # 6 * 1e9 params * 1e4 tokens in 1 s on a 1e15 FLOP/s chip = 6%
    assert bench.training_mfu(10**9, 1e4, 1.0, 1e15) == pytest.approx(0.06)
    assert math.isnan(bench.training_mfu(10**9, 1e4, 0.0, 1e15))
    # 2 GB of weights + 8 sequences x 100 tokens x 1 MB of KV each = 2.8 GB per step at 2.8 TB/s:
    # 1000 steps/s x 8 tokens
    bound = bench.decode_bandwidth_bound(
        weight_bytes=2e9, kv_bytes_per_token=1e6, batch=8, mean_context=100, bandwidth=2.8e12
    )
    assert bound == pytest.approx(8000.0)


def _run_worker(trainer: str, spec: dict[str, Any], tmp: Path) -> dict[str, Any]:
    spec_file, out_file = tmp / f"{trainer}-spec.json", tmp / f"{trainer}-out.json"
    spec_file.write_text(json.dumps({**spec, "output_dir": str(tmp / f"{trainer}-output")}))
    proc = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--_worker",
            trainer,
            "--_spec",
            str(spec_file),
            "--_out",
            str(out_file),
        ],
        env={**_env(), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return json.loads(out_file.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("trainer", ["ours", "trl"])
def test_workers_produce_every_figure(
    bench: ModuleType, trainer: str, tiny_setup: Any, toy_dataset: Path, tmp_path: Path
) -> None:
    if trainer == "trl":
        pytest.importorskip("trl")
    preset = bench.Preset("gpt_neox", 64, 2, 4, prompts=2, k=2, length=4, micro_batch=2)
    spec = {
        "policy": str(tiny_setup.policy),
        "dataset": str(toy_dataset),
        "prompts": preset.prompts,
        "k": preset.k,
        "length": preset.length,
        "micro_batch": preset.micro_batch,
        "updates": 3,
        "seed": 0,
        "lr": 1e-4,
        "beta": 0.05,
    }
    result = _run_worker(trainer, spec, tmp_path)
    assert result["episodes"] == 3 * 4
    assert result["rollouts"] == 2  # the warm-up update is left out
    assert result["generated_tokens"] == 2 * 4 * preset.length
    assert result["train_tokens"] > result["generated_tokens"]  # prompts count too
    assert result["prompt_tokens_per_completion"] > 0
    assert result["phase_seconds"]["generation"] > 0
    assert result["phase_seconds"]["optimization"] > 0
    figs = bench.figures(result, preset, 100_000, ("test GPU", 1e15, 1e12))
    for key, _, _ in bench.ROWS:
        if key != "peak_memory_gib":  # 0 on CPU
            assert math.isfinite(figs[key]) and figs[key] > 0, key
    table = bench.render_table({"tiny": {trainer: figs}}, ["tiny"])
    assert table.count("\n") == len(bench.ROWS) + 1  # header, rule, one row per figure
