#!/usr/bin/env python
"""GPU benchmark: this project's RLOO trainer against TRL's ``RLOOTrainer`` at ~0.5B and ~1.5B parameters.

For each model size, both trainers train the same random-init Qwen2-shaped model with its full vocabulary
(built locally, nothing is downloaded) on the same toy task at the TL;DR shape (~512-token prompts,
53-token completions, k=4, 64 completions per update) in bf16 autocast, each in a fresh subprocess, and
one table reports side by side: episodes/s, tokens/s per phase (generation, log-probs + scoring,
optimisation), training MFU (6 * N * training tokens / optimisation time / peak bf16 FLOP/s), generation
throughput as a fraction of the memory-bandwidth bound of decoding, and peak GPU memory.

Targets (not asserted): ours >= 2x TRL's episodes/s; training >= 40% MFU at 1.5B; generation >= 50% of the
bandwidth bound.

    python benchmarks/bench_gpu.py                  # both sizes, both trainers (needs trl: make bench)
    python benchmarks/bench_gpu.py --sizes 0.5b --only ours --generation compiled
    python benchmarks/bench_gpu.py --dry-run        # the plan and the GPU's peak figures, nothing trained

Without a CUDA GPU it prints "no GPU: skipped" and exits 0. See benchmarks/README.md ("GPU benchmark").
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_vs_trl

TRAINERS = ("ours", "trl")
LABELS = {"ours": "rloo", "trl": "TRL"}
GIB = 1024**3


# ------------------------------------------------------------------------------------------------------
# model sizes and workloads
@dataclass(frozen=True)
class Preset:
    """A model size and the rollout shape it is benchmarked with."""

    arch: str
    hidden: int
    layers: int
    heads: int  # head dim 64 / 128, as real models of these sizes (flash attention needs <= 256)
    prompts: int  # per update
    k: int
    length: int  # completion tokens, forced exactly in both trainers
    micro_batch: int  # completions per forward/backward
    vocab: int | None = None  # None: rloo.demo.tiny's 512 tokens; else rows no token reaches, as real models
    prompt_words: int = 0  # 'POST: ...' words before each prompt; the tiny tokenizer gives ~1.6 tokens a word


# Qwen2-shaped (tied embeddings, Qwen2's 151,936-row vocabulary) at the TL;DR shape: ~512-token prompts
# (320 words), 53-token completions, 16 prompts x k=4 = 64 completions per update. A layer holds
# 16 * hidden^2 weights (attention 4 h^2, MLP 3 x 4 h^2): 24 x 896 -> ~0.44B, 32 x 1536 -> ~1.44B.
QWEN2_VOCAB = 151_936
PRESETS: dict[str, Preset] = {
    "0.5b": Preset(
        "qwen2", 896, 24, 14, prompts=16, k=4, length=53, micro_batch=32, vocab=QWEN2_VOCAB, prompt_words=320
    ),
    "1.5b": Preset(
        "qwen2", 1536, 32, 12, prompts=16, k=4, length=53, micro_batch=8, vocab=QWEN2_VOCAB, prompt_words=320
    ),
}

# (substring of torch.cuda.get_device_name(), label, dense bf16 FLOP/s, HBM bytes/s) from NVIDIA's data
# sheets (tensor-core dense figures, not the 2:4-sparse ones). First match wins: specific names first.
GPU_SPECS: tuple[tuple[tuple[str, ...], str, float, float], ...] = (
    (("H200", "NVL"), "H200 NVL", 835e12, 4.8e12),
    (("H200",), "H200 SXM", 989e12, 4.8e12),
    (("H100", "NVL"), "H100 NVL", 835e12, 3.9e12),
    (("H100", "PCIE"), "H100 PCIe", 756e12, 2.0e12),
    (("H100",), "H100 SXM", 989e12, 3.35e12),
    (("A100", "80GB", "PCIE"), "A100 80GB PCIe", 312e12, 1.935e12),
    (("A100", "80GB"), "A100 80GB SXM", 312e12, 2.039e12),
    (("A100",), "A100 40GB", 312e12, 1.555e12),
)


def gpu_peak(device_name: str) -> tuple[str, float, float] | None:
    """(label, peak dense bf16 FLOP/s, memory bytes/s) for a CUDA device name, or None if unknown."""
    name = device_name.upper()
    for needles, label, flops, bandwidth in GPU_SPECS:
        if all(n in name for n in needles):
            return label, flops, bandwidth
    return None


def llama_param_counts(hidden: int, layers: int, vocab: int) -> tuple[int, int]:
    """(total parameters, parameters that do matmul FLOPs: all but the input embedding) of rloo.demo.tiny's Llama.

    Per layer: q, k, v, o (hidden^2 each, as many key/value heads as heads), gate/up/down
    (hidden x 4*hidden each), two RMSNorm weights; then a final norm and an untied LM head.
    """
    per_layer = 4 * hidden * hidden + 3 * hidden * 4 * hidden + 2 * hidden
    embed = vocab * hidden
    total = embed + layers * per_layer + hidden + vocab * hidden
    return total, total - embed


def model_param_counts(config: Any) -> tuple[int, int]:
    """(total parameters, matmul parameters) of a model config, counted on the meta device. The input
    embedding is a lookup, not a matmul, unless it is tied to the LM head (Qwen2), which multiplies."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in model.parameters())  # a tied matrix is counted once
    if getattr(config, "tie_word_embeddings", False):
        return total, total
    return total, total - model.get_input_embeddings().weight.numel()


def training_mfu(matmul_params: int, train_tokens: float, seconds: float, peak_flops: float) -> float:
    """Model FLOPs utilisation of the optimisation phase: 6 * N * tokens (forward + backward) / time / peak."""
    if seconds <= 0 or peak_flops <= 0:
        return float("nan")
    return 6.0 * matmul_params * train_tokens / seconds / peak_flops


def decode_bandwidth_bound(
    *,
    weight_bytes: float,
    kv_bytes_per_token: float,
    batch: int,
    mean_context: float,
    bandwidth: float,
) -> float:
    """Upper bound on decoding tokens/s when memory bandwidth is the limit.

    Each decode step must read every weight once (shared by the batch) and each sequence's KV cache up to
    its current length; it produces ``batch`` tokens. ``mean_context`` is the average context over the
    steps (prompt + half the completion).
    """
    step_bytes = weight_bytes + batch * mean_context * kv_bytes_per_token
    return batch * bandwidth / step_bytes


# ------------------------------------------------------------------------------------------------------
# command line
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="rloo vs TRL's RLOOTrainer on one GPU at ~0.5B and ~1.5B parameters: one table.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--sizes", default="0.5b,1.5b", help=f"Comma-separated presets: {', '.join(PRESETS)}.")
    p.add_argument("--updates", type=int, default=8, help="RLOO updates per run (the first is warm-up).")
    p.add_argument(
        "--prompt-words",
        type=int,
        help="'POST: ...' words before each prompt (0: ~6-token prompts; default: the preset's, TL;DR-like).",
    )
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--beta", type=float, default=0.05, help="KL coefficient.")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", choices=TRAINERS, help="Run one trainer only.")
    p.add_argument(
        "--generation",
        choices=("dynamic", "static", "compiled"),
        default="dynamic",
        help="Our decode path: growing KV cache, static cache, or static cache with a compiled step (CUDA graphs).",
    )
    p.add_argument("--peak-tflops", type=float, help="Override the GPU's dense bf16 peak (TFLOP/s).")
    p.add_argument("--peak-bandwidth", type=float, help="Override the GPU's memory bandwidth (TB/s).")
    p.add_argument("--workdir", type=Path, help="Keep models, data and run logs here (default: temp dir).")
    p.add_argument("--json", type=Path, help="Also write all figures as JSON to this file.")
    p.add_argument("--dry-run", action="store_true", help="Print the plan and peak figures; train nothing.")
    p.add_argument("--_worker", choices=TRAINERS, help=argparse.SUPPRESS)
    p.add_argument("--_spec", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--_out", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.sizes = [s.strip().lower() for s in args.sizes.split(",") if s.strip()]
    unknown = [s for s in args.sizes if s not in PRESETS]
    if unknown or not args.sizes:
        p.error(f"--sizes: unknown {unknown or 'empty'}; choose from {', '.join(PRESETS)}")
    if args.updates < 2:
        p.error("--updates must be >= 2 (the first update is warm-up and left out of per-phase figures)")
    return args


# ------------------------------------------------------------------------------------------------------
# workers: one trainer, one size, in a fresh process
# The workers also run on CPU (the test suite smoke-tests them with a tiny model): CUDA calls are skipped there.
def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _reset_peak_memory() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def _peak_memory() -> int:
    import torch

    return torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0


def worker_ours(spec: dict[str, Any]) -> dict[str, Any]:
    from rloo.training.trainer import RLOOTrainer

    batch = spec["prompts"] * spec["k"]
    generation = spec.get("generation", "dynamic")
    cfg = bench_vs_trl.rloo_config(
        spec,
        bf16=True,
        cache_implementation="dynamic" if generation == "dynamic" else "static",
        compile_generation=generation == "compiled",
    )
    trainer = RLOOTrainer(cfg)
    _reset_peak_memory()
    _sync()
    t0 = time.perf_counter()
    result = trainer.train()
    _sync()
    seconds = time.perf_counter() - t0
    steady = result.history[1:]  # the first update carries CUDA/kernel warm-up

    def tokens(rate: str, phase: str) -> float:
        # a count, rebuilt from rate x time: round away the float error of that product
        return float(round(sum(h[rate] * h[f"time/{phase}_s"] for h in steady)))

    gen_tokens = tokens("throughput/generated_tokens_per_s", "generation")
    train_tokens = tokens("throughput/train_tokens_per_s", "optimization")
    num_tokens = [h["num_tokens"] for h in result.history]
    per_update_tokens = [b - a for a, b in zip([0.0, *num_tokens], num_tokens, strict=False)][1:]
    prompt_tokens = sum(per_update_tokens) - gen_tokens  # prompt tokens x k, summed over steady updates
    return {
        "seconds": seconds,
        "episodes": result.episodes,
        "phase_seconds": {
            p: sum(h.get(f"time/{p}_s", 0.0) for h in steady)
            for p in ("generation", "logprobs", "scoring", "optimization")
        },
        "generated_tokens": gen_tokens,
        "train_tokens": train_tokens,
        "prompt_tokens_per_completion": prompt_tokens / max(1, batch * len(steady)),
        "rollouts": len(steady),
        # steady state: the updates after the first, whose time carries compilation and CUDA warm-up
        "steady_seconds": sum(h["time/update_s"] for h in steady),
        "steady_episodes": batch * len(steady),
        "peak_memory_bytes": _peak_memory(),
    }


def worker_trl(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    from trl import RLOOTrainer

    from rloo.demo.toy import letter_reward

    batch = spec["prompts"] * spec["k"]
    train_ds, tok = bench_vs_trl.trl_inputs(spec)
    args = bench_vs_trl.trl_config(
        spec,
        # the same precision as ours: fp32 weights (as saved), bf16 autocast
        model_init_kwargs={"dtype": torch.float32},
        bf16=True,
        use_cpu=not torch.cuda.is_available(),  # the CPU smoke test only
    )
    trainer = RLOOTrainer(
        model=spec["policy"],
        reward_funcs=letter_reward,
        args=args,
        train_dataset=train_ds,
        processing_class=tok,
    )
    # Phase timings from TRL's own methods: _generate (sampling) inside _generate_and_score_completions
    # (sampling + reference log-probs + rewards); optimisation is the time between rollouts.
    rollouts: list[tuple[float, float]] = []
    generations: list[tuple[float, int, int]] = []
    gen_orig, roll_orig = trainer._generate, trainer._generate_and_score_completions

    def timed_generate(prompts: Any) -> Any:
        _sync()
        t0 = time.perf_counter()
        out = gen_orig(prompts)
        _sync()
        prompt_ids, completion_ids = out[0], out[1]
        generations.append(
            (time.perf_counter() - t0, sum(map(len, prompt_ids)), sum(map(len, completion_ids)))
        )
        return out

    def timed_rollout(inputs: Any) -> Any:
        _sync()
        t0 = time.perf_counter()
        out = roll_orig(inputs)
        _sync()
        rollouts.append((t0, time.perf_counter()))
        return out

    trainer._generate = timed_generate
    trainer._generate_and_score_completions = timed_rollout
    _reset_peak_memory()
    _sync()
    t0 = time.perf_counter()
    trainer.train()
    _sync()
    t1 = time.perf_counter()
    updates = int(trainer.state.global_step)
    starts = [s for s, _ in rollouts]
    # optimisation of update i: from the end of its rollout to the start of the next (or the end of training)
    opt = [nxt - end for (_, end), nxt in zip(rollouts, [*starts[1:], t1], strict=True)]
    steady_gen, steady_roll, steady_opt = generations[1:], rollouts[1:], opt[1:]
    gen_seconds = sum(g[0] for g in steady_gen)
    gen_tokens = float(sum(g[2] for g in steady_gen))
    prompt_tokens = float(sum(g[1] for g in steady_gen))
    return {
        "seconds": t1 - t0,
        "episodes": updates * batch,
        "phase_seconds": {
            "generation": gen_seconds,
            "logprobs+scoring": sum(e - s for s, e in steady_roll) - gen_seconds,
            "optimization": sum(steady_opt),
        },
        "generated_tokens": gen_tokens,
        "train_tokens": gen_tokens + prompt_tokens,  # one epoch over each rollout, prompts per completion
        "prompt_tokens_per_completion": prompt_tokens / max(1, len(steady_gen) * batch),
        "rollouts": len(steady_gen),
        # steady state: from the second rollout's start to the end of training
        "steady_seconds": t1 - starts[1] if len(starts) > 1 else float("nan"),
        "steady_episodes": (updates - 1) * batch,
        "peak_memory_bytes": _peak_memory(),
    }


def run_worker(args: argparse.Namespace) -> int:
    spec = json.loads(args._spec.read_text())
    out = worker_ours(spec) if args._worker == "ours" else worker_trl(spec)
    args._out.write_text(json.dumps(out, indent=2))
    return 0


# ------------------------------------------------------------------------------------------------------
# the parent
def build_inputs(preset: Preset, root: Path, args: argparse.Namespace) -> dict[str, Any]:
    from rloo.demo.tiny import build_causal_lm, build_tokenizer
    from rloo.demo.toy import write_toy_dataset

    tok_dir = root / "tokenizer"
    if not tok_dir.is_dir():
        build_tokenizer(tok_dir)
    policy = root / f"policy-{preset.arch}-{preset.hidden}x{preset.layers}-v{preset.vocab or 0}"
    if not (policy / "config.json").is_file():
        build_causal_lm(
            policy,
            tok_dir,
            arch=preset.arch,
            hidden_size=preset.hidden,
            num_layers=preset.layers,
            num_heads=preset.heads,
            seed=args.seed,
            vocab_size=preset.vocab,
            max_position_embeddings=2048,
        )
    words = preset.prompt_words if args.prompt_words is None else args.prompt_words
    data = root / f"data-{words}"
    if not data.is_dir():
        write_toy_dataset(data, num_train=1024, seed=args.seed, context_words=words)
    return {"policy": str(policy), "dataset": str(data)}


def preset_param_counts(preset: Preset) -> tuple[int, int]:
    """(total, matmul) parameters of a preset's model, from its config alone (nothing is built)."""
    from rloo.demo.tiny import build_tokenizer, causal_lm_config

    with tempfile.TemporaryDirectory() as tmp:
        build_tokenizer(Path(tmp))
        config = causal_lm_config(
            tmp,
            arch=preset.arch,
            hidden_size=preset.hidden,
            num_layers=preset.layers,
            num_heads=preset.heads,
            vocab_size=preset.vocab,
            max_position_embeddings=2048,
        )
    return model_param_counts(config)


def run_one(trainer: str, spec: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    return bench_vs_trl.launch_worker(__file__, trainer, LABELS[trainer], spec, run_dir)[0]


def figures(
    result: dict[str, Any], preset: Preset, matmul_params: int, peak: tuple[str, float, float]
) -> dict[str, float]:
    """The table's figures for one run."""
    _, flops, bandwidth = peak
    phases = result["phase_seconds"]
    batch = preset.prompts * preset.k
    gen_s = phases.get("generation", 0.0)
    gen_tps = result["generated_tokens"] / gen_s if gen_s else float("nan")
    hidden, layers = preset.hidden, preset.layers
    bound = decode_bandwidth_bound(
        weight_bytes=2.0 * matmul_params,  # bf16 weights, what a decode step must read at least
        kv_bytes_per_token=2 * layers * hidden * 2.0,  # K and V, every layer, bf16
        batch=batch,
        mean_context=result["prompt_tokens_per_completion"] + preset.length / 2,
        bandwidth=bandwidth,
    )
    opt_s = phases.get("optimization", 0.0)
    # ours times the two separately, TRL's rollout holds both
    scoring_s = phases.get("logprobs+scoring", phases.get("logprobs", 0.0) + phases.get("scoring", 0.0))
    return {
        "episodes_per_s": result["episodes"] / result["seconds"],
        "steady_episodes_per_s": result["steady_episodes"] / result["steady_seconds"]
        if result.get("steady_seconds")
        else float("nan"),
        "generation_tokens_per_s": gen_tps,
        "generation_fraction_of_bandwidth_bound": gen_tps / bound,
        # the reference forward reads every prompt + completion token once per rollout
        "logprobs_scoring_tokens_per_s": result["train_tokens"] / scoring_s if scoring_s else float("nan"),
        "training_tokens_per_s": result["train_tokens"] / opt_s if opt_s else float("nan"),
        "training_mfu": training_mfu(matmul_params, result["train_tokens"], opt_s, flops),
        "peak_memory_gib": result["peak_memory_bytes"] / GIB,
    }


ROWS = (
    ("episodes_per_s", "episodes/s", "{:.1f}"),
    ("steady_episodes_per_s", "episodes/s, steady (warm-up left out)", "{:.1f}"),
    ("generation_tokens_per_s", "generation tokens/s", "{:,.0f}"),
    ("generation_fraction_of_bandwidth_bound", "generation / bandwidth bound", "{:.0%}"),
    ("logprobs_scoring_tokens_per_s", "log-probs + scoring tokens/s", "{:,.0f}"),
    ("training_tokens_per_s", "training tokens/s", "{:,.0f}"),
    ("training_mfu", "training MFU", "{:.0%}"),
    ("peak_memory_gib", "peak memory (GiB)", "{:.1f}"),
)
TARGETS = {
    "episodes_per_s": ">= 2x TRL",
    "generation_fraction_of_bandwidth_bound": ">= 50%",
    "training_mfu": ">= 40% at 1.5B",
}


def render_table(results: dict[str, dict[str, dict[str, float]]], sizes: list[str]) -> str:
    """One markdown table: a row per figure, a column per (size, trainer), then the target."""
    cols = [(s, t) for s in sizes for t in TRAINERS if t in results.get(s, {})]
    head = ["figure", *[f"{s.upper()} {LABELS[t]}" for s, t in cols], "target"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def cell(value: float | None, fmt: str) -> str:
        return "n/a" if value is None or value != value else fmt.format(value)

    for key, label, fmt in ROWS:
        cells = [cell(results[s][t].get(key), fmt) for s, t in cols]
        lines.append("| " + " | ".join([label, *cells, TARGETS.get(key, "")]) + " |")

    def ratios(key: str) -> list[str]:
        return [
            f"{s.upper()} {results[s]['ours'][key] / results[s]['trl'][key]:.2f}x"
            for s in sizes
            if {"ours", "trl"} <= set(results.get(s, {}))
        ]

    whole, steady = ratios("episodes_per_s"), ratios("steady_episodes_per_s")
    if whole:
        lines += [
            "",
            "ours / TRL episodes/s: " + ", ".join(whole) + " (target >= 2x); steady: " + ", ".join(steady),
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args._worker:
        return run_worker(args)
    import torch

    if not torch.cuda.is_available():
        print("no GPU: skipped")
        return 0
    name = torch.cuda.get_device_name()
    peak = gpu_peak(name)
    if args.peak_tflops or args.peak_bandwidth:
        label, flops, bandwidth = peak or (name, float("nan"), float("nan"))
        peak = (
            label,
            args.peak_tflops * 1e12 if args.peak_tflops else flops,
            args.peak_bandwidth * 1e12 if args.peak_bandwidth else bandwidth,
        )
    if peak is None:
        raise SystemExit(f"unknown GPU {name!r}: pass --peak-tflops and --peak-bandwidth")
    counts = {s: preset_param_counts(PRESETS[s]) for s in args.sizes}
    print(f"GPU: {name} ({peak[0]}: {peak[1] / 1e12:.0f} TFLOP/s bf16 dense, {peak[2] / 1e12:.2f} TB/s)")
    for s in args.sizes:
        pr = PRESETS[s]
        print(
            f"  {s}: {pr.arch} hidden {pr.hidden} x {pr.layers} layers, {counts[s][0] / 1e6:.0f}M params; "
            f"{pr.prompts} prompts x k={pr.k}, {pr.length} tokens, micro-batch {pr.micro_batch}, "
            f"{args.updates} updates"
        )
    if args.dry_run:
        return 0
    trainers = (args.only,) if args.only else TRAINERS
    if "trl" in trainers:
        try:
            import trl  # noqa: F401
        except ImportError:
            raise SystemExit("TRL is not installed: pip install -e '.[bench]' (or --only ours).") from None

    root = args.workdir or Path(tempfile.mkdtemp(prefix="bench_gpu_"))
    root.mkdir(parents=True, exist_ok=True)
    raw: dict[str, dict[str, Any]] = {}
    results: dict[str, dict[str, dict[str, float]]] = {}
    try:
        for s in args.sizes:
            pr = PRESETS[s]
            spec = {
                **build_inputs(pr, root, args),
                **{k: v for k, v in asdict(pr).items() if k in ("prompts", "k", "length", "micro_batch")},
                "updates": args.updates,
                "generation": args.generation,
                "seed": args.seed,
                "lr": args.lr,
                "beta": args.beta,
            }
            for t in trainers:
                print(f"[{s}] {LABELS[t]} ...", file=sys.stderr, flush=True)
                r = run_one(t, spec, root / "runs" / f"{s}-{t}")
                raw.setdefault(s, {})[t] = r
                results.setdefault(s, {})[t] = figures(r, pr, counts[s][1], peak)
                print(f"    {results[s][t]['episodes_per_s']:.1f} episodes/s", file=sys.stderr)
                if args.json:  # after every run, so that a run cut short still leaves what it measured
                    _write_json(args.json, name, peak, raw, results)
    finally:
        if args.workdir is None:
            shutil.rmtree(root, ignore_errors=True)
    print(render_table(results, args.sizes))
    if args.json:
        _write_json(args.json, name, peak, raw, results)
    return 0


def _write_json(path: Path, gpu: str, peak: Any, raw: dict[str, Any], results: dict[str, Any]) -> None:
    path.write_text(json.dumps({"gpu": gpu, "peak": peak, "raw": raw, "figures": results}, indent=2))


if __name__ == "__main__":
    sys.exit(main())
