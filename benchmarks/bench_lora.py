#!/usr/bin/env python
"""LoRA against full fine-tuning in this project's trainer, at equal settings: trainable and total
parameters, peak memory of the process, episodes/s and reward.

Both runs train the same random-init model (built locally, nothing downloaded) at one of
bench_vs_trl.py's shapes, each in a fresh process (peak memory is per process: on CPU the resident set
size, on a GPU ``torch.cuda.max_memory_allocated``). Full fine-tuning holds the policy, its gradients,
AdamW's two moments and a reference copy; LoRA holds the weights once plus the adapters' share.

    python benchmarks/bench_lora.py                      # neox50k shape, 6 updates
    python benchmarks/bench_lora.py --updates 10 --lora-r 8
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_vs_trl

MODES = ("full", "lora")


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    from rloo.training import lora
    from rloo.training.trainer import RLOOTrainer

    torch.set_num_threads(spec["threads"])
    peft = spec["mode"] == "lora"
    extra = {"use_peft": True, "lora_r": spec["lora_r"], "lora_alpha": 2.0 * spec["lora_r"]} if peft else {}
    cfg = bench_vs_trl.rloo_config(spec, **extra)
    trainer = RLOOTrainer(cfg)
    trainable, total = lora.parameter_counts(trainer.policy)
    t0 = time.perf_counter()
    result = trainer.train()
    seconds = time.perf_counter() - t0
    if torch.cuda.is_available():
        peak = torch.cuda.max_memory_allocated() / 2**30
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    rewards = [h["objective/scores"] for h in result.history]
    return {
        "trainable": trainable,
        "total": total,
        "peak_gib": peak,
        "eps": result.episodes / seconds,
        "reward_last": sum(rewards[-3:]) / len(rewards[-3:]),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="neox50k", choices=sorted(bench_vs_trl.SHAPES))
    p.add_argument("--updates", type=int, default=6)
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--_worker", help=argparse.SUPPRESS)
    p.add_argument("--_spec", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--_out", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args._worker:
        args._out.write_text(json.dumps(worker(json.loads(args._spec.read_text()))))
        return 0
    shape = bench_vs_trl.SHAPES[args.shape]
    ns = argparse.Namespace(
        arch=shape["arch"],
        hidden=shape["hidden"],
        layers=shape["layers"],
        vocab=shape["vocab"],
        prompts=shape["prompts"],
        prompt_words=shape["prompt_words"],
        seed=args.seed,
    )
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="bench_lora_") as tmp:
        root = Path(tmp)
        inputs = bench_vs_trl.build_inputs(ns, root)
        spec = {
            **inputs,
            "prompts": shape["prompts"],
            "k": shape["k"],
            "length": shape["length"],
            "micro_batch": shape["prompts"] * shape["k"],
            "updates": args.updates,
            "seed": args.seed,
            "lr": shape["lr"],
            "beta": 0.05,
            "threads": args.threads,
            "lora_r": args.lora_r,
        }
        for mode in MODES:
            print(f"[{mode}] ...", file=sys.stderr, flush=True)
            results[mode], _ = bench_vs_trl.launch_worker(
                __file__, mode, mode, {**spec, "mode": mode}, root / mode
            )
    full, lo = results["full"], results["lora"]
    print(
        f"shape {args.shape}: {shape['doc']}; {args.updates} updates, LoRA r={args.lora_r}, {args.threads} thread(s)"
    )
    print("| | full fine-tuning | LoRA | LoRA / full |")
    print("|---|---:|---:|---:|")
    print(
        f"| trainable parameters | {full['trainable']:,} | {lo['trainable']:,} | {lo['trainable'] / full['trainable']:.2%} |"
    )
    print(f"| total parameters held | {full['total']:,} (+ a reference copy) | {lo['total']:,} | |")
    print(
        f"| peak memory (GiB) | {full['peak_gib']:.2f} | {lo['peak_gib']:.2f} | {lo['peak_gib'] / full['peak_gib']:.2f}x |"
    )
    print(f"| episodes/s | {full['eps']:.1f} | {lo['eps']:.1f} | {lo['eps'] / full['eps']:.2f}x |")
    print(f"| reward, last 3 updates | {full['reward_last']:.3f} | {lo['reward_last']:.3f} | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
