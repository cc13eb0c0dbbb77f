#!/usr/bin/env python
"""Where each phase of an RLOO update spends its time on the GPU: a torch.profiler trace, summarised.

Trains ``--updates`` updates of a bench_gpu.py preset under torch.profiler and, for every update but the
first (warm-up), reports per phase (generation, logprobs, scoring, optimization): wall time, the time the
GPU was busy running kernels inside that phase (the rest is the host: Python, launches, syncs), kernel
launches, and the kernels that took the most GPU time, grouped into families (matmul, attention,
elementwise/copies, softmax/reductions, optimizer, other).

    python benchmarks/profile_gpu.py --size 0.5b --generation compiled --out profile.md

Without a CUDA GPU it prints "no GPU: skipped" and exits 0.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_gpu
import bench_vs_trl

PHASES = ("generation", "logprobs", "scoring", "optimization")
FAMILIES = (
    ("matmul", re.compile(r"gemm|matmul|cutlass|sm90_xmma|nvjet|cublas|splitk", re.I)),
    ("attention", re.compile(r"flash|fmha|attention|sdpa|efficient_attention", re.I)),
    ("optimizer", re.compile(r"adam|multi_tensor|foreach", re.I)),
    ("softmax/reduce", re.compile(r"softmax|reduce|norm|logsumexp|sum_|max_|argmax|cumsum|sort|topk", re.I)),
    (
        "elementwise/copy",
        re.compile(r"elementwise|copy|cat|index|gather|scatter|fill|triton|where|vectorized", re.I),
    ),
)


def family(kernel: str) -> str:
    for name, pattern in FAMILIES:
        if pattern.search(kernel):
            return name
    return "other"


def busy_time(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of (start, end) intervals: GPU time with at least one kernel running."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def summarise(trace: dict[str, Any], skip_first: int = 1) -> dict[str, dict[str, Any]]:
    """Per phase, over every occurrence but the first ``skip_first``: wall, GPU busy, launches, families."""
    events = trace["traceEvents"]
    ranges: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for e in events:
        if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith("phase/"):
            ranges[e["name"][6:]].append((e["ts"], e["ts"] + e["dur"]))
    kernels = [
        (e["ts"], e["ts"] + e.get("dur", 0), e["name"])
        for e in events
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "ts" in e
    ]
    out: dict[str, dict[str, Any]] = {}
    for phase in PHASES:
        spans = sorted(ranges.get(phase, []))[skip_first:]
        if not spans:
            continue
        inside = [k for k in kernels if any(s <= k[0] < e for s, e in spans)]
        fam: dict[str, float] = defaultdict(float)
        top: dict[str, float] = defaultdict(float)
        for s, e, name in inside:
            fam[family(name)] += e - s
            top[name] += e - s
        wall = sum(e - s for s, e in spans)
        busy = busy_time([(s, e) for s, e, _ in inside])
        out[phase] = {
            "occurrences": len(spans),
            "wall_ms": wall / 1e3,
            "gpu_busy_ms": busy / 1e3,
            "gpu_busy_fraction": busy / wall if wall else float("nan"),
            "kernels": len(inside),
            "families_ms": {k: v / 1e3 for k, v in sorted(fam.items(), key=lambda kv: -kv[1])},
            "top_kernels_ms": {k[:90]: v / 1e3 for k, v in sorted(top.items(), key=lambda kv: -kv[1])[:8]},
        }
    return out


def render(summary: dict[str, dict[str, Any]], title: str) -> str:
    lines = [
        f"### {title}",
        "",
        "| phase | wall ms/update | GPU busy | kernels/update | GPU time by family (ms/update) |",
    ]
    lines.append("|---|---|---|---|---|")
    for phase, s in summary.items():
        n = s["occurrences"]
        fams = ", ".join(f"{k} {v / n:.1f}" for k, v in s["families_ms"].items())
        lines.append(
            f"| {phase} | {s['wall_ms'] / n:.1f} | {s['gpu_busy_fraction']:.0%} | {s['kernels'] / n:.0f} | {fams} |"
        )
    for phase, s in summary.items():
        n = s["occurrences"]
        lines += ["", f"top kernels, {phase} (ms/update):"]
        lines += [f"- {v / n:.2f} {k}" for k, v in s["top_kernels_ms"].items()]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="0.5b", choices=sorted(bench_gpu.PRESETS))
    p.add_argument("--updates", type=int, default=3, help="The first is warm-up and left out.")
    p.add_argument("--generation", choices=("dynamic", "static", "compiled"), default="dynamic")
    p.add_argument("--out", type=Path, help="Also write the markdown summary here.")
    p.add_argument("--json", type=Path, help="Also write the summary as JSON here.")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("no GPU: skipped")
        return 0
    from torch.profiler import ProfilerActivity, profile

    from rloo.training.trainer import RLOOTrainer

    preset = bench_gpu.PRESETS[args.size]
    ns = argparse.Namespace(seed=0, prompt_words=None)
    with tempfile.TemporaryDirectory(prefix="profile_gpu_") as tmp:
        root = Path(tmp)
        spec = {
            **bench_gpu.build_inputs(preset, root, ns),
            "prompts": preset.prompts,
            "k": preset.k,
            "length": preset.length,
            "micro_batch": preset.micro_batch,
            "updates": args.updates,
            "seed": 0,
            "lr": 1e-6,
            "beta": 0.05,
            "output_dir": str(root / "out"),
        }
        cfg = bench_vs_trl.rloo_config(
            spec,
            bf16=True,
            cache_implementation="dynamic" if args.generation == "dynamic" else "static",
            compile_generation=args.generation == "compiled",
        )
        trainer = RLOOTrainer(cfg)
        t0 = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            trainer.train()
        seconds = time.perf_counter() - t0
        trace_path = root / "trace.json"
        prof.export_chrome_trace(str(trace_path))
        trace = json.loads(trace_path.read_text())
    summary = summarise(trace)
    title = f"{args.size}, {args.generation} decode, {args.updates} updates ({seconds:.1f} s profiled)"
    text = render(summary, title)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
