"""benchmarks/bench_gpu.py: skips cleanly without a GPU; its arithmetic and its workers are right.

The benchmark itself needs a CUDA GPU. Here its workers run on CPU with a tiny model (the same code path,
CUDA calls skipped) so that a metric key or a TRL method it relies on going away is caught.
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.fixtures.scripts import load_script

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_gpu.py"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_script(SCRIPT)


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


# Qwen2.5's config.json: hidden, layers, query heads, key/value heads, MLP width; and the published
# parameter counts (0.49B and 1.54B on their model cards)
QWEN25 = {
    "0.5b": ((896, 24, 14, 2, 4864), 0.494e9),
    "1.5b": ((1536, 28, 12, 2, 8960), 1.54e9),
}


@pytest.mark.parametrize("name", sorted(QWEN25))
def test_presets_are_the_qwen25_shapes_and_sizes(bench: ModuleType, name: str) -> None:
    shape, published = QWEN25[name]
    preset = bench.PRESETS[name]
    assert (preset.hidden, preset.layers, preset.heads, preset.num_kv_heads, preset.mlp_size) == shape
    config = bench.preset_config(preset)
    assert (config.num_key_value_heads, config.intermediate_size, config.tie_word_embeddings) == (
        shape[3],
        shape[4],
        True,
    )
    total, matmul = bench.preset_param_counts(preset)  # meta device: nothing allocated
    assert total == pytest.approx(published, rel=0.005)
    assert matmul == total  # Qwen2 ties its embeddings: the one matrix is also the LM head's matmul
    assert bench.qwen2_param_counts(preset) == (total, matmul)  # the hand count is the model's
    # KV bytes a token: K and V, every layer, 2 key/value heads of 64 / 128, bf16
    head_dim = preset.hidden // preset.heads
    assert head_dim in (64, 128)
    assert bench.kv_bytes_per_token(preset.layers, preset.num_kv_heads, preset.head_dim) == (
        2 * preset.layers * 2 * head_dim * 2
    )
    # TL;DR: 53-token completions, k=4, 64+ completions per update, full vocabulary
    assert (preset.length, preset.k, preset.vocab) == (53, 4, 151_936)
    assert preset.prompts * preset.k >= 64


def test_the_model_builder_takes_kv_heads_and_mlp_width(tmp_path: Path) -> None:
    from rloo.demo.tiny import build_tokenizer, causal_lm_config

    build_tokenizer(tmp_path)
    config = causal_lm_config(
        tmp_path, arch="qwen2", hidden_size=64, num_heads=4, num_key_value_heads=2, intermediate_size=96
    )
    assert (config.num_key_value_heads, config.intermediate_size) == (2, 96)
    default = causal_lm_config(tmp_path, arch="llama", hidden_size=64, num_heads=4)
    assert (default.num_key_value_heads, default.intermediate_size) == (4, 256)
    with pytest.raises(ValueError, match="multiple of num_key_value_heads"):
        causal_lm_config(tmp_path, arch="qwen2", hidden_size=64, num_heads=4, num_key_value_heads=3)


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
    # prefix sharing: 2 prompts of 100 tokens read once each, 2 x 4 rows of 10 response tokens (5 on
    # average over the steps): 2e9 + (200 + 40) x 1e6 bytes a step
    step = bench.shared_prefix_decode_bytes(
        weight_bytes=2e9, kv_bytes_per_token=1e6, prompts=2, prompt=100, k=4, length=10
    )
    assert step == pytest.approx(2.24e9)


def test_needed_flops_count_each_prompt_once_per_group(bench: ModuleType) -> None:
    # 1 group of k=2, prompt 5 tokens, 3 response tokens; body 10 params, hidden 2, 1 layer, vocab 7.
    # Positions: the prompt but its last token once (4), then each row's last prompt token and its
    # responses but the last (3 each): 4 + 6 = 10. Keys: 4 x 5 / 2 = 10 for the prefix, each row
    # 3 x 4 (the prefix) + 1 + 2 + 3 = 18: 10 + 36 = 46. Logits: 2 x 3 = 6; none dropped.
    # Forward: 2 x 10 x 10 + 4 x 1 x 2 x 46 + 2 x 2 x 7 x 6 = 200 + 368 + 168 = 736; x3 with the backward
    kw = {"body_params": 10, "hidden": 2, "layers": 1, "vocab": 7}
    assert bench.training_flops_needed(batch=2, k=2, prompt=5, length=3, **kw) == pytest.approx(3 * 736)
    # the same work for any trainer: TRL's rows execute more than is needed, ours (sharing) about it
    shape = {"batch": 64, "k": 4, "length": 53, "body_params": 10**8, "hidden": 896, "layers": 24}
    needed = bench.training_flops_needed(prompt=460, vocab=151_936, **shape)
    trl = bench.training_flops_executed("trl", micro_batch=32, width=460, vocab=151_936, **shape)
    assert trl > 2 * needed


def test_steady_state_is_the_median_update_after_the_second(bench: ModuleType) -> None:
    assert bench.median_after_second([30.0, 9.0, 2.0, 4.0, 3.0]) == 3.0  # median of 2, 4, 3
    assert math.isnan(bench.median_after_second([30.0, 9.0]))
    result = _result(update_wall_s=[30.0, 9.0, 2.0, 4.0, 3.0])
    assert bench.steady_episodes_per_s(result, 64) == pytest.approx(64 / 3.0)
    # a result file from before the wall-clock list: its summed steady time
    assert bench.steady_episodes_per_s(_result(), 64) == pytest.approx(32 / 5.0)


def test_micro_batch_knob_reaches_ours_config(bench: ModuleType) -> None:
    assert bench.parse_args(["--micro-batch", "16"]).micro_batch == 16
    assert bench.parse_args(["--micro-batch", "auto"]).micro_batch == "auto"
    assert bench.parse_args([]).micro_batch is None
    with pytest.raises(SystemExit):
        bench.parse_args(["--micro-batch", "0"])
    overrides = bench.ours_overrides({"generation": "compiled", "micro_batch_size": "auto"})
    assert overrides["micro_batch_size"] == "auto"
    assert (overrides["cache_implementation"], overrides["compile_generation"]) == ("static", True)
    assert "micro_batch_size" not in bench.ours_overrides({"generation": "dynamic"})
    # executed FLOPs follow the run's own micro-batch: micro-batches of 6 rows split groups of 4, whose
    # prompts then run twice (once in each), more FLOPs in the same time than whole groups of 64
    preset = bench.Preset("qwen2", 64, 2, 4, prompts=16, k=4, length=4, micro_batch=64, vocab=1000)
    peak = ("test GPU", 1e12, 1e12)
    whole = bench.figures(_result(), preset, 500_000, peak)["training_mfu_executed"]
    split = bench.figures(_result(micro_batch=6), preset, 500_000, peak)["training_mfu_executed"]
    assert split > whole
    # "auto" is resolved inside the trainer: counted as the preset's
    auto = bench.figures(_result(micro_batch="auto"), preset, 500_000, peak)["training_mfu_executed"]
    assert auto == whole


def test_table_names_trls_version_and_the_settings_that_differ(bench: ModuleType) -> None:
    figs = {key: 1.0 for key, _, _ in bench.ROWS}
    settings = {"micro-batch": "32", "reference weights": "float32", "decode": "dynamic cache"}
    raw = {
        "0.5b": {
            "ours": {"settings": {**settings, "decode": "static cache, compiled step"}},
            "trl": {"trl_version": "1.16.0", "settings": settings},
        }
    }
    table = bench.render_table({"0.5b": {"ours": figs, "trl": figs}}, ["0.5b"], raw)
    assert "| 0.5B TRL 1.16.0, use_vllm=False |" in table
    differ = [line for line in table.splitlines() if "settings differ" in line]
    assert len(differ) == 1 and "decode: ours static cache, compiled step, TRL dynamic cache" in differ[0]
    assert "nominal" not in table  # the nominal MFU is in the JSON only
    assert "FLOPs needed" in table and "cudagraph_skips" in table


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
    # what the executed FLOPs and the bytes-read bound need: who ran, the padded width, how it decoded
    assert result["trainer"] == trainer
    assert result["prompt_width"] >= result["prompt_tokens_per_completion"]
    assert result["decode_weights"] in bench.WEIGHT_READ_BYTES
    assert result["decode_cache"] in ("static", "dynamic")
    figs = bench.figures(result, preset, 100_000, ("test GPU", 1e15, 1e12))
    if trainer == "ours":  # how its forwards ran: prompts shared by cost, on-policy (no old forward)
        assert result["torch_compile"] is False and result["gradient_checkpointing"] is False
        assert result["attn_implementation"] in ("sdpa", "eager")  # a 4D mask: packed rows
        assert result["old_logprobs_forward"] is False and result["logprob_chunk"] == 4
        assert math.isfinite(figs["logprobs_mfu_executed"]) and figs["logprobs_mfu_executed"] > 0
    assert len(result["update_wall_s"]) == 3  # wall clock per update, for the steady median
    if trainer == "ours":  # nothing compiled on this path: no graphs, no CUDA-graph fallbacks
        assert result["dynamo"] == {"unique_graphs": 0, "cudagraph_skips": 0, "graph_breaks": 0}
    else:
        assert result["trl_version"] == importlib.metadata.version("trl")
    assert result["settings"]["micro-batch"] == "2"
    for key, _, _ in bench.ROWS:
        if key not in ("peak_memory_gib", "dynamo_unique_graphs", "cudagraph_skips"):  # 0 or absent on CPU
            assert math.isfinite(figs[key]) and figs[key] > 0, key
    table = bench.render_table({"tiny": {trainer: figs}}, ["tiny"])
    assert table.count("\n") == len(bench.ROWS) + 1  # header, rule, one row per figure


# ------------------------------------------------------------------------------------------------------
# executed FLOPs and the decode bound on bytes actually read (issue: "honest figures")


# the micro-batches the layout tests run: (rows, k, padded prompt width, response tokens)
_LAYOUT_CASES = [
    (32, 4, 460, 53),  # the 0.5B preset's micro-batch: shared
    (8, 4, 460, 53),  # the 1.5B preset's: shared
    (4, 4, 2, 53),  # a 2-token prompt: not shared
    (4, 2, 5, 3),  # the hand-sized shape below: shared
    (2, 1, 9, 9),  # one completion a prompt: nothing to share
    (6, 4, 20, 5),  # a micro-batch splitting a group (4 + 2 completions): shared, 4 slots a row
    (2, 4, 20, 5),  # fewer completions than k: one row of 2 slots
]


def _completions(rows: int, k: int, width: int, length: int) -> Any:
    """Inputs of a micro-batch as LogProbs.forward reads them: ceil(rows / k) prompts, rows completions
    in groups of k (the last one short when rows is not a multiple of k)."""
    from types import SimpleNamespace

    import torch

    prompt_ids = torch.ones((math.ceil(rows / k), width), dtype=torch.long)
    return SimpleNamespace(
        prompt_ids=prompt_ids,
        prompt_mask=torch.ones_like(prompt_ids),
        rows=torch.arange(rows) // k,
        responses=torch.ones((rows, length), dtype=torch.long),
    )


@pytest.mark.parametrize(("rows", "k", "width", "length"), _LAYOUT_CASES)
def test_layout_matches_what_logprobs_runs(
    bench: ModuleType, monkeypatch: pytest.MonkeyPatch, rows: int, k: int, width: int, length: int
) -> None:
    # LogProbs.forward's and response_logits' own choice, seen by which path they take: the KV cache
    # starts with a prefill, packed rows reach packed_logits (with what pack_rows built), plain rows call
    # the model directly
    import contextlib
    from types import SimpleNamespace

    import torch

    import rloo.forward as fwd
    import rloo.training.completion_logprobs as clp

    class Took(Exception):
        def __init__(self, mode: str, packed: Any = None) -> None:
            super().__init__(mode)
            self.mode, self.packed = mode, packed

    def kv_cache(*a: Any, **kw: Any) -> Any:
        raise Took("kv_cache")

    def packed(_model: Any, rows_: Any, _ctx: Any) -> Any:
        raise Took("packed", rows_)

    class Model:
        def __init__(self, attn: str | None) -> None:
            self.config = SimpleNamespace(_attn_implementation=attn)

        def __call__(self, **kw: Any) -> Any:
            raise Took("plain")

    monkeypatch.setattr(fwd, "prefill", kv_cache)
    monkeypatch.setattr(fwd, "packed_logits", packed)
    ro = _completions(rows, k, width, length)
    accelerator = SimpleNamespace(autocast=contextlib.nullcontext)
    for attn in (None, "flash_attention_2", "sdpa", "eager"):
        for compiled in (False, True):
            for checkpointing in (False, True):
                model = Model(attn)
                cache_free = compiled or checkpointing  # as the trainer builds LogProbs
                logprobs = clp.LogProbs(
                    accelerator,
                    model,
                    temperature=1.0,
                    cache_free=cache_free,
                    compiled_layers=compiled,
                    rloo_k=k,
                    chunk_size=rows,
                )
                with pytest.raises(Took) as took:
                    logprobs.forward(model, ro, torch.arange(rows))
                flags = {
                    "block_mask": attn in ("sdpa", "eager"),
                    "compiled": compiled,
                    "cache_free": cache_free,
                }
                layout = bench.forward_layout(rows, k, width, length, **flags)
                case = (attn, compiled, checkpointing)
                assert took.value.mode == layout.mode, case
                if layout.mode == "packed":
                    built = took.value.packed
                    assert tuple(built.input_ids.shape) == bench.packed_shape(rows, k, width, length, layout)
                    # the count's positions are the packed input's, its keys every entry of its 4D mask
                    count = bench.forward_count(rows, k, width, length, layout)
                    assert count.positions == built.input_ids.numel(), case
                    assert count.keys == built.allowed.numel(), case
                    assert count.logits == built.columns.numel() == rows * length, case


@pytest.mark.parametrize(("rows", "k", "width", "length"), _LAYOUT_CASES)
def test_packed_shape_is_what_pack_rows_builds(
    bench: ModuleType, rows: int, k: int, width: int, length: int
) -> None:
    import rloo.forward as fwd
    from rloo.training.completion_logprobs import COMPILED_WIDTH_MULTIPLE

    ro = _completions(rows, k, width, length)
    for share in (False, True):
        for multiple in (1, COMPILED_WIDTH_MULTIPLE):
            built = fwd.pack_rows(
                ro.prompt_ids, ro.prompt_mask, ro.rows, ro.responses, share=share, width_multiple=multiple
            )
            layout = bench.Layout("packed", share=share, width_multiple=multiple)
            assert tuple(built.input_ids.shape) == bench.packed_shape(rows, k, width, length, layout)


def test_share_decision_by_hand(bench: ModuleType) -> None:
    # 0.5B preset: micro-batch 32 = 8 prompts of ~460 tokens, 53-token responses:
    # 8 x 460 + 32 x 53 = 5,376 positions shared against 0.75 x 32 x 513 = 12,312: shared
    assert bench.shares_prefix(32, 4, 460, 53)
    # a 2-token prompt: 1 x 2 + 4 x 53 = 214 >= 0.75 x 4 x 55 = 165: plain rows
    assert not bench.shares_prefix(4, 4, 2, 53)
    # one completion per micro-batch: nothing to share
    assert not bench.shares_prefix(1, 4, 460, 53)


def test_layout_by_hand(bench: ModuleType) -> None:
    packed = bench.Layout("packed", share=True)
    # 4 rows, 2 prompts of width 5, 3 response tokens: sharing pays (2 x 5 + 4 x 3 = 22 < 0.75 x 4 x 8 = 24)
    assert bench.forward_layout(4, 2, 5, 3) == packed
    assert (
        bench.forward_layout(4, 2, 5, 3, cache_free=True) == packed
    )  # checkpointing: packed rows take no cache
    assert bench.forward_layout(4, 2, 5, 3, compiled=True) == bench.Layout(
        "packed", share=True, width_multiple=64
    )
    assert bench.forward_layout(4, 2, 5, 3, block_mask=False) == bench.Layout("kv_cache")
    assert bench.forward_layout(4, 2, 5, 3, block_mask=False, cache_free=True) == bench.Layout("plain")
    # a 2-token prompt, sharing does not pay: plain rows, packed one per completion only when compiled
    assert bench.forward_layout(4, 4, 2, 53) == bench.Layout("plain")
    assert bench.forward_layout(4, 4, 2, 53, compiled=True) == bench.Layout("packed", width_multiple=64)
    assert bench.forward_layout(4, 4, 2, 53, block_mask=False, compiled=True) == bench.Layout("plain")
    with pytest.raises(ValueError, match="unknown layout"):
        bench.Layout("whole")


def test_forward_count_by_hand(bench: ModuleType) -> None:
    # 4 rows, 2 prompts of width 5, 3 response tokens
    shared = bench.forward_count(4, 2, 5, 3, bench.Layout("kv_cache"))
    # prefixes: 2 x 4 positions, keys 1+2+3+4 = 10 each; rows: 4 x 3 positions attending to 5, 6, 7 keys
    assert shared == bench.ForwardCount(positions=20, keys=2 * 10 + 4 * 18, logits=12, dropped_logits=2)
    plain = bench.forward_count(4, 2, 5, 3, bench.Layout("plain"))
    # 4 rows of 8 positions, keys 1+..+8 = 36 each, logits at the last 4 positions, the final one dropped
    assert plain == bench.ForwardCount(positions=32, keys=4 * 36, logits=12, dropped_logits=4)
    # packed, a row per prompt: the prompt (5) then 2 responses but their last token (2 each): 2 rows of 9
    # columns, each the whole 9 x 9 score square; logits at exactly the 4 x 3 needed positions
    packed = bench.forward_count(4, 2, 5, 3, bench.Layout("packed", share=True))
    assert packed == bench.ForwardCount(positions=18, keys=2 * 81, logits=12, dropped_logits=0)
    # the same rows padded to 64 columns (compiled layers): 2 x 64 positions, 2 x 64^2 keys
    wide = bench.forward_count(4, 2, 5, 3, bench.Layout("packed", share=True, width_multiple=64))
    assert wide == bench.ForwardCount(positions=128, keys=2 * 4096, logits=12, dropped_logits=0)
    # one row per completion: 5 + 2 = 7 columns, padded to 64 when compiled
    single = bench.forward_count(4, 2, 5, 3, bench.Layout("packed"))
    assert single == bench.ForwardCount(positions=28, keys=4 * 49, logits=12, dropped_logits=0)
    single = bench.forward_count(4, 2, 5, 3, bench.Layout("packed", width_multiple=64))
    assert single == bench.ForwardCount(positions=256, keys=4 * 4096, logits=12, dropped_logits=0)


# the hand-sized model of the tests below: body 10 matmul parameters, hidden 2, 1 layer, vocab 3
_HAND = {"body_params": 10, "hidden": 2, "layers": 1, "vocab": 3}


def test_pass_and_training_flops_by_hand(bench: ModuleType) -> None:
    shape = _HAND
    plain = bench.forward_count(4, 2, 5, 3, bench.Layout("plain"))
    # used: 2 x 10 x 32 + 4 x 1 x 2 x 144 + 2 x 2 x 3 x 12 = 640 + 1,152 + 144 = 1,936; dropped 2 x 2 x 3 x 4 = 48
    assert bench.pass_flops(plain, **shape, backward=False) == 1936 + 48
    assert bench.pass_flops(plain, **shape, backward=True) == 3 * 1936 + 48
    # packed: 2 x 10 x 18 + 4 x 1 x 2 x 162 + 2 x 2 x 3 x 12 = 360 + 1,296 + 144 = 1,800, none dropped
    packed = bench.forward_count(4, 2, 5, 3, bench.Layout("packed", share=True))
    assert bench.pass_flops(packed, **shape, backward=True) == 3 * 1800
    # checkpointing recomputes the layers (360 + 1,296) in the backward, not the output layer (144)
    assert bench.pass_flops(packed, **shape, backward=True, recompute=True) == 4 * 1656 + 3 * 144 == 7056
    assert bench.pass_flops(packed, **shape, backward=False, recompute=True) == 1800
    kw = {"batch": 8, "micro_batch": 4, "k": 2, "width": 5, "length": 3, **shape}
    assert bench.training_flops_executed("ours", **kw) == 2 * 3 * 1800 == 10_800  # two micro-batches
    assert bench.training_flops_executed("trl", **kw) == 2 * (3 * 1936 + 48) == 11_712
    # a ragged last micro-batch of 2 rows (1 prompt): 1 x 5 + 2 x 3 = 11 < 0.75 x 2 x 8 = 12, shared:
    # one row of 9 columns: 2 x 10 x 9 + 4 x 2 x 81 + 2 x 2 x 3 x 6 = 180 + 648 + 72 = 900
    ragged = bench.training_flops_executed("ours", **{**kw, "batch": 6})
    assert ragged == 3 * 1800 + 3 * 900 == 8100


def test_options_and_logprob_flops_by_hand(bench: ModuleType) -> None:
    # the shape of the test above: a packed pass is 1,800 (1,656 of it the layers'), a plain one 1,936 + 48
    kw = {"batch": 8, "micro_batch": 4, "k": 2, "width": 5, "length": 3, **_HAND}
    # gradient checkpointing: the same packed rows, the layers' forward again: 2 x 7,056
    assert bench.training_flops_executed("ours", **kw, gradient_checkpointing=True) == 2 * 7056 == 14_112
    # --torch_compile: rows of 64 columns: 2 x 10 x 128 + 4 x 2 x 8,192 = 2,560 + 65,536 = 68,096 for the
    # layers, 144 for the logits: 2 micro-batches x 3 x 68,240 = 409,440; with checkpointing too, x4 layers
    assert bench.training_flops_executed("ours", **kw, torch_compile=True) == 2 * 3 * 68_240 == 409_440
    both = bench.training_flops_executed("ours", **kw, torch_compile=True, gradient_checkpointing=True)
    assert both == 2 * (4 * 68_096 + 3 * 144) == 545_632
    # TRL: plain rows, whatever ours' options
    assert (
        bench.training_flops_executed("trl", **kw, torch_compile=True, gradient_checkpointing=True) == 11_712
    )
    # attention without a 4D mask: the KV cache, 2 x (3 x 1,280 + 24) (1,280: 2 x 10 x 20 + 4 x 2 x 92 +
    # 144; 2 dropped logits, 24); checkpointing takes no cache: plain rows, 4 x 1,792 + 3 x 144 + 48
    no_mask = {**kw, "block_mask": False}
    assert bench.training_flops_executed("ours", **no_mask) == 2 * (3 * 1280 + 24) == 7728
    assert bench.training_flops_executed("ours", **no_mask, gradient_checkpointing=True) == 2 * 7648 == 15_296
    # no-grad log-prob forwards (x1), chunks of 4 rows: the reference, packed by cost, 2 x 1,800
    lp = {k: v for k, v in kw.items() if k != "micro_batch"}
    assert bench.logprob_flops_executed(**lp, chunk=4, old_logprobs=False) == 2 * 1800 == 3600
    assert bench.logprob_flops_executed(**lp, chunk=4, old_logprobs=False, torch_compile=True) == 3600
    # off-policy: the policy's old log-probs too, as its training forward lays them out: 3,600 packed by
    # cost (checkpointing recomputes nothing without a backward), 2 x 68,240 in 64-column rows compiled
    assert bench.logprob_flops_executed(**lp, chunk=4, old_logprobs=True) == 3600 + 3600
    assert bench.logprob_flops_executed(**lp, chunk=4, gradient_checkpointing=True) == 3600 + 3600
    assert bench.logprob_flops_executed(**lp, chunk=4, torch_compile=True) == 3600 + 136_480
    # without the mask: the reference through the KV cache, 2 x 1,304; the checkpointed policy plain rows,
    # 2 x (1,936 + 48)
    assert bench.logprob_flops_executed(**lp, chunk=4, block_mask=False) == 2608 + 2608
    assert (
        bench.logprob_flops_executed(**lp, chunk=4, block_mask=False, gradient_checkpointing=True)
        == 2608 + 3968
    )
    # one chunk of 8 rows (4 prompts): 4 x 5 + 8 x 3 = 44 < 0.75 x 8 x 8 = 48, packed: 4 rows of 9 columns,
    # 2 x 10 x 36 + 4 x 2 x 324 + 2 x 2 x 3 x 24 = 720 + 2,592 + 288 = 3,600
    assert bench.logprob_flops_executed(**lp, chunk=8, old_logprobs=False) == 3600


def test_figures_count_the_options_and_the_attention_of_the_run(bench: ModuleType) -> None:
    # the preset of the test above at the hand-sized model: body 10 (16 matmul parameters less 2 x 3 for
    # the output layer), hidden 2, 1 layer, vocab 3
    preset = bench.Preset("qwen2", 2, 1, 1, prompts=4, k=2, length=3, micro_batch=4, vocab=3)
    matmul, peak = 10 + 2 * 3, ("test GPU", 1000.0, 1e12)
    # one rollout of 8 rows at width 5, optimisation 2 s, log-probs 1 s
    base = _result(
        prompt_width=5.0,
        phase_seconds={"generation": 1.0, "logprobs": 1.0, "scoring": 0.5, "optimization": 2.0},
        logprob_chunk=8,
    )
    figs = bench.figures(base, preset, matmul, peak)
    assert figs["training_mfu_executed"] == pytest.approx(10_800 / 2.0 / 1000)  # packed micro-batches
    assert figs["logprobs_mfu_executed"] == pytest.approx(3600 / 1.0 / 1000)  # the reference, packed
    off = bench.figures({**base, "old_logprobs_forward": True}, preset, matmul, peak)
    assert off["logprobs_mfu_executed"] == pytest.approx(2 * 3600 / 1000)
    # (training FLOPs, off-policy log-prob FLOPs) by option: see the test above
    by_option = {
        "torch_compile": (409_440, 3600 + 136_480),
        "gradient_checkpointing": (14_112, 3600 + 3600),
    }
    for option, (training, logprobs) in by_option.items():
        run = bench.figures({**base, option: True}, preset, matmul, peak)
        assert run["training_mfu_executed"] == pytest.approx(training / 2.0 / 1000), option
        assert run["logprobs_mfu_executed"] == pytest.approx(3600 / 1000), option  # reference: by cost
        run = bench.figures({**base, option: True, "old_logprobs_forward": True}, preset, matmul, peak)
        assert run["logprobs_mfu_executed"] == pytest.approx(logprobs / 1000), option
    # a run whose attention takes no 4D mask: the KV cache; checkpointed, plain rows
    flash = {**base, "attn_implementation": "flash_attention_2"}
    assert bench.figures(flash, preset, matmul, peak)["training_mfu_executed"] == pytest.approx(
        7728 / 2.0 / 1000
    )
    flash_gc = bench.figures({**flash, "gradient_checkpointing": True}, preset, matmul, peak)
    assert flash_gc["training_mfu_executed"] == pytest.approx(15_296 / 2.0 / 1000)
    # TRL: its reference forward is timed with the scoring, no log-prob MFU
    assert math.isnan(bench.figures(_result(trainer="trl"), preset, matmul, peak)["logprobs_mfu_executed"])


_NEEDED = ("length", "body_params", "hidden", "layers", "vocab")


def test_executed_flops_at_the_05b_shape(bench: ModuleType) -> None:
    # 0.5B preset, ~460-token prompts: TRL runs ~2.7x ours' FLOPs (each prompt 4 times instead of once),
    # and the nominal 6 N per token overstates even TRL's (the output layer runs at 54 of 513 positions)
    preset = bench.PRESETS["0.5b"]
    h, v, layers = preset.hidden, preset.vocab, preset.layers
    kv = preset.num_kv_heads * preset.head_dim  # 2 key/value heads of 64
    # q and o, k and v (grouped), q/k/v biases, gate/up/down, 2 norms a layer; the final norm
    body = layers * (2 * h * h + 2 * h * kv + h + 2 * kv + 3 * h * preset.mlp_size + 2 * h) + h
    kw = {
        "batch": 64,
        "micro_batch": preset.micro_batch,
        "k": preset.k,
        "width": 460,
        "length": 53,
        "body_params": body,
        "hidden": h,
        "layers": layers,
        "vocab": v,
    }
    assert body == bench.preset_param_counts(preset)[1] - h * v  # the hand count is the model's
    ours, trl = bench.training_flops_executed("ours", **kw), bench.training_flops_executed("trl", **kw)
    nominal = 6 * (body + h * v) * 64 * (460 + 53)
    # a micro-batch of 32: ours 8 packed rows of 460 + 4 x 52 = 668 columns (5,344 positions, 8 x 668^2 =
    # 3.6M keys), TRL 32 rows of 513 (16,416 positions, 32 x 513 x 514 / 2 = 4.2M keys); the same logits
    assert 2.6 < trl / ours < 2.9
    assert 3.4 < nominal / ours < 3.7  # ours' nominal MFU would read ~3.5x its executed one
    assert 0.76 < trl / nominal < 0.79  # TRL's too, by the output layer left out at prompt positions
    needed = bench.training_flops_needed(batch=64, k=4, prompt=460, **{n: kw[n] for n in _NEEDED})
    # ours runs a little more than is needed: the masked attention computes each row's whole square
    # (3.6M keys against the causal 1.7M of the needed count), a few % of the FLOPs at hidden 896
    assert 1.02 < ours / needed < 1.05
    # compiled layers: rows of 704 columns (668 rounded up to 64): ~5% more; checkpointing: the layers'
    # forward again, ~4/3 of all but the output layer's FLOPs
    assert 1.04 < bench.training_flops_executed("ours", **kw, torch_compile=True) / ours < 1.07
    assert 1.28 < bench.training_flops_executed("ours", **kw, gradient_checkpointing=True) / ours < 4 / 3


def test_decode_bytes_by_hand(bench: ModuleType) -> None:
    # 1e9 weights; KV: 2 x 10 layers x 5 heads x 100 dims x 2 bytes = 20 kB a token, 10 rows x 1000 tokens
    kw = {"matmul_params": 10**9, "layers": 10, "kv_heads": 5, "head_dim": 100, "batch": 10, "context": 1000}
    assert bench.kv_bytes_per_token(10, 5, 100) == 20_000
    assert bench.decode_step_bytes(weights="bf16", **kw) == pytest.approx(2e9 + 2e8)
    # fp32 under autocast: read 4 bytes, write the bf16 cast (2), read it (2)
    assert bench.decode_step_bytes(weights="fp32-autocast", **kw) == pytest.approx(8e9 + 2e8)
    assert bench.decode_step_bytes(weights="fp32", **kw) == pytest.approx(4e9 + 2e8)
    # KV: a bf16 cache read as stored; fp32 keys cast to bf16 at every step: 4 + 2 + 2
    assert bench.element_read_bytes(2.0) == 2.0
    assert bench.element_read_bytes(4.0) == 8.0 == bench.WEIGHT_READ_BYTES["fp32-autocast"]
    assert bench.decode_step_bytes(weights="bf16", kv_dtype_bytes=5.0, **kw) == pytest.approx(2e9 + 5e8)
    assert bench.kv_read_bytes("fp32-autocast", "dynamic") == 5.0  # fp32 keys (8), bf16 values (2)
    assert bench.kv_read_bytes("fp32-autocast", "static") == 2.0  # allocated in the compute dtype
    assert bench.kv_read_bytes("bf16", "dynamic") == 2.0
    assert bench.kv_read_bytes("fp32", "static") == 4.0
    # a static cache is read whole (rounded up to its bucket); a dynamic one up to the current token
    assert bench.decode_context("static", 100, 50) == 150
    assert bench.decode_context("static", 100, 50, bucket=64) == 192
    assert bench.decode_context("dynamic", 100, 50) == 125
    with pytest.raises(ValueError):
        bench.decode_context("paged", 100, 50)


def test_static_kv_layout_is_read_from_the_generators_buffers(bench: ModuleType) -> None:
    from types import SimpleNamespace

    import torch

    kv = torch.zeros((2, 1, 192, 4), dtype=torch.bfloat16)
    layer = SimpleNamespace(keys=kv, values=kv)
    buffers = SimpleNamespace(cache=SimpleNamespace(layers=[layer]))
    gen = SimpleNamespace(_buffers={("shape",): buffers})

    assert bench.static_kv_layout(gen) == (192, 2.0)
    assert bench.static_kv_layout(object()) is None  # a dynamic-cache generator keeps no buffers


def test_decode_weights_of_a_generator(bench: ModuleType) -> None:
    import torch

    class Gen:
        def __init__(self, model: Any, autocast: Any = None) -> None:
            self.model, self.autocast = model, autocast

    fp32 = torch.nn.Linear(2, 2)
    assert bench.decode_weights(Gen(fp32)) == "fp32"
    assert bench.decode_weights(Gen(fp32, autocast=object())) == "fp32-autocast"
    copy = Gen(fp32, autocast=object())
    copy.rollout = torch.nn.Linear(2, 2).to(torch.bfloat16)  # a rollout copy held beside the policy
    assert bench.decode_weights(copy) == "bf16"


def _result(**over: Any) -> dict[str, Any]:
    base = {
        "trainer": "ours",
        "seconds": 10.0,
        "episodes": 64,
        "phase_seconds": {"generation": 1.0, "logprobs": 0.5, "scoring": 0.5, "optimization": 2.0},
        "generated_tokens": 64 * 4.0,
        "train_tokens": 64 * (10 + 4.0),
        "prompt_tokens_per_completion": 10.0,
        "prompt_width": 12.0,
        "decode_weights": "fp32-autocast",
        "decode_cache": "static",
        "rollouts": 1,
        "steady_seconds": 5.0,
        "steady_episodes": 32,
        "peak_memory_bytes": 0,
    }
    return {**base, **over}


def test_figures_use_the_executed_flops_and_bytes_read(bench: ModuleType) -> None:
    preset = bench.Preset("qwen2", 64, 2, 4, prompts=16, k=4, length=4, micro_batch=32, vocab=1000)
    matmul, peak = 500_000, ("test GPU", 1e12, 1e12)
    figs = bench.figures(_result(), preset, matmul, peak)
    flops = bench.training_flops_executed(
        "ours",
        batch=64,
        micro_batch=32,
        k=4,
        width=12,
        length=4,
        body_params=matmul - 64 * 1000,
        hidden=64,
        layers=2,
        vocab=1000,
    )
    assert figs["training_mfu_executed"] == pytest.approx(flops / 2.0 / 1e12)
    assert figs["training_mfu_nominal"] == pytest.approx(6 * matmul * 64 * 14 / 2.0 / 1e12)
    needed = bench.training_flops_needed(
        batch=64, k=4, prompt=10, length=4, body_params=matmul - 64 * 1000, hidden=64, layers=2, vocab=1000
    )
    assert figs["training_mfu_needed"] == pytest.approx(needed / 2.0 / 1e12)
    kv = {"layers": 2, "kv_heads": 4, "head_dim": 16, "batch": 64}
    # static cache not measured: width 12 + 4 slots, rounded up to the generator's bucket, bf16
    context = bench.decode_context("static", 12, 4, bench.static_cache_bucket())
    read = bench.decode_step_bytes(matmul_params=matmul, weights="fp32-autocast", context=context, **kv)
    # ideal: bf16 weights, 16 prompts of 10 tokens once, 64 rows x 4 / 2 response tokens; 512 B a token
    ideal = 2 * matmul + (16 * 10 + 64 * 2) * 512
    assert figs["generation_fraction_of_read_bound"] == pytest.approx(256 / (64 * 1e12 / read))
    assert figs["generation_fraction_of_bandwidth_bound"] == pytest.approx(256 / (64 * 1e12 / ideal))
    # the static cache as measured: 128 positions of fp32 (an fp32 model without autocast, say)
    measured = bench.figures(_result(kv_cache_layout=[128, 4.0]), preset, matmul, peak)
    read = bench.decode_step_bytes(
        matmul_params=matmul, weights="fp32-autocast", context=128, kv_dtype_bytes=8.0, **kv
    )
    assert measured["generation_fraction_of_read_bound"] == pytest.approx(256 / (64 * 1e12 / read))
    # a dynamic cache of an fp32 model under autocast: live context, fp32 keys and bf16 values
    dynamic = bench.figures(_result(decode_cache="dynamic"), preset, matmul, peak)
    read = bench.decode_step_bytes(
        matmul_params=matmul, weights="fp32-autocast", context=12 + 2, kv_dtype_bytes=5.0, **kv
    )
    assert dynamic["generation_fraction_of_read_bound"] == pytest.approx(256 / (64 * 1e12 / read))
    # TRL's rows (the same tokens) execute more: a lower executed MFU at the same time
    trl = bench.figures(_result(trainer="trl"), preset, matmul, peak)
    assert trl["training_mfu_executed"] > figs["training_mfu_executed"]
    assert trl["training_mfu_nominal"] == figs["training_mfu_nominal"]
    assert trl["training_mfu_needed"] == figs["training_mfu_needed"]  # the same work needed
    # a result file from before these fields: TRL recognised by its phases, mean prompt length as width
    old = _result(phase_seconds={"generation": 1.0, "logprobs+scoring": 1.0, "optimization": 2.0})
    for key in ("trainer", "prompt_width", "decode_weights", "decode_cache"):
        del old[key]
    legacy = bench.figures(old, preset, matmul, peak)
    assert math.isfinite(legacy["training_mfu_executed"])
    assert legacy["training_mfu_executed"] < trl["training_mfu_executed"]  # width 10 < 12
