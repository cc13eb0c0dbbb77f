#!/usr/bin/env python
"""Decode A/B on one GPU: the built-in generator's decode paths at a bench_gpu.py preset, side by side.

One random-init model of the preset (built in memory, nothing downloaded), one set of prompts (16 prompts
of ~460 random tokens from the vocabulary's first 512 rows, left-padded; k=4; 53 new tokens; seeds from
``rloo.generation.row_seeds``), and per variant a ``TransformersGenerator`` over them:

- ``fp32-autocast``: the fp32 policy under bf16 autocast, static cache, compiled decode step (model forward
  only: ``whole_step=False``) -- the path ``--cache_implementation static --compile_generation`` ran
  before the trainer sampled from a bf16 copy. It stands for that path only approximately: its static
  cache is the new one (bf16, bucketed, kept across calls), not the old per-call one;
- ``bf16-copy``: the same over ``rloo.generation.rollout_copy(model, torch.bfloat16)``, without autocast
  (as the trainer runs its copy: ``TransformersGenerator.from_settings``), forward-only compiled step;
- ``whole-step``: the bf16 copy with ``whole_step=True`` (sampling, token write and mask update in the same
  compiled graph as the forward) -- what the trainer runs by default;
- ``dynamic``: the fp32 policy under bf16 autocast, growing cache, nothing compiled (the old baseline).

Per variant: warm-up calls (compilation, CUDA-graph capture), then timed calls between
``torch.cuda.synchronize()``: ms per token step (call time / new tokens), prefill ms (``rloo.forward.
prefill`` timed inside the call), decode ms per step ((call - prefill) / (steps - 1) model steps), tokens/s,
the fraction of the decode bound reached (bytes a step must read / bandwidth, over the measured decode
step; "as read": the weights as the variant holds them and its KV cache as allocated, "ideal": bf16
weights, each prompt's KV once per group and each row's response KV so far; see
bench_gpu.shared_prefix_decode_bytes), torch._dynamo's counters per variant (graphs compiled and
inductor's cudagraph_skips: a whole step that silently fell back from CUDA graphs shows a skip), peak memory (the fp32 model
included: it stays resident), and, with ``greedy=True``, the fraction of tokens equal to
``fp32-autocast``'s (fp32-under-autocast and bf16 weights may differ a little). ``whole-step`` against
``bf16-copy`` (the same weights, two different compiled graphs) is checked: in bf16 their greedy tokens
need not agree exactly (a near-tie between two logits can flip with the graphs' different fusion and
accumulation order, and a flipped token changes the rest of its row; the GPU test of the same property
runs in fp32), so the agreement fraction is reported, and only agreement below MIN_AGREEMENT (90%) --
a real bug, not a near-tie -- fails the run (exit 3).

    python benchmarks/bench_decode.py                              # 0.5b, every variant
    python benchmarks/bench_decode.py --variants fp32-autocast,whole-step --json decode.json
    python benchmarks/bench_decode.py --device cpu --tiny --no-compile   # smoke run on CPU

Without a CUDA GPU (and without ``--device cpu``) it prints "no GPU: skipped" and exits 0. Exit status: 0,
1 when a variant failed to run (the others still run), 3 when whole-step and bf16-copy agree on fewer than
90% of their greedy tokens.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_gpu

GIB = 1024**3


@dataclass(frozen=True)
class Variant:
    copy: bool  # decode from a bf16 rollout copy
    cache: str  # "static" or "dynamic"
    compile: bool  # compile the decode step
    whole_step: bool  # sampling, token write and mask update in the compiled graph


VARIANTS: dict[str, Variant] = {
    "fp32-autocast": Variant(copy=False, cache="static", compile=True, whole_step=False),
    "bf16-copy": Variant(copy=True, cache="static", compile=True, whole_step=False),
    "whole-step": Variant(copy=True, cache="static", compile=True, whole_step=True),
    "dynamic": Variant(copy=False, cache="dynamic", compile=False, whole_step=False),
}
# pairs that decode with the same weights: their greedy tokens should agree, up to bf16 near-ties
MUST_MATCH = (("whole-step", "bf16-copy"),)
# below this fraction of equal greedy tokens a pair's disagreement is a bug, not near-ties: exit 3
MIN_AGREEMENT = 0.9

# the rollout shape of bench_gpu's presets (TL;DR: ~460-token prompts after the tiny tokenizer) and a
# CPU-sized one for the smoke test
SHAPES = {
    "preset": {"prompts": 16, "k": 4, "width": 460, "steps": 53, "warmup": 2, "repeats": 3},
    "tiny": {"prompts": 2, "k": 2, "width": 12, "steps": 2, "warmup": 1, "repeats": 1},
}
TINY = bench_gpu.Preset("qwen2", 64, 2, 4, prompts=2, k=2, length=2, micro_batch=4)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Decode A/B of the built-in generator's paths at a bench_gpu.py preset: one table. "
        "Exit 3 when whole-step and bf16-copy (the same bf16 weights) agree on fewer than "
        f"{MIN_AGREEMENT:.0%} of their greedy tokens (below that a bug, not bf16 near-ties).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--preset", default="0.5b", choices=[*bench_gpu.PRESETS, "tiny"])
    p.add_argument(
        "--tiny", action="store_true", help="= --preset tiny: a 64 x 2 model, 2 prompts x 2, 2 steps."
    )
    p.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run.")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"Comma-separated: {', '.join(VARIANTS)}.")
    p.add_argument("--prompts", type=int, help="Prompts per call (default 16; tiny 2).")
    p.add_argument("--k", type=int, help="Completions per prompt (default 4; tiny 2).")
    p.add_argument("--width", type=int, help="Longest prompt, tokens (default 460; tiny 12).")
    p.add_argument("--steps", type=int, help="New tokens per completion (default 53; tiny 2).")
    p.add_argument("--batch-size", type=int, default=64, help="The generator's completions per batch.")
    p.add_argument(
        "--warmup", type=int, help="Untimed calls first (compilation, capture; default 2; tiny 1)."
    )
    p.add_argument("--repeats", type=int, help="Timed calls (default 3; tiny 1); the median is reported.")
    p.add_argument("--no-compile", action="store_true", help="Compile nothing (CPU smoke runs).")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--peak-bandwidth", type=float, help="Override the memory bandwidth (TB/s).")
    p.add_argument("--json", type=Path, help="Also write every figure as JSON here.")
    args = p.parse_args(argv)
    if args.tiny:
        args.preset = "tiny"
    shape = SHAPES["tiny" if args.preset == "tiny" else "preset"]
    for key, value in shape.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown or not args.variants:
        p.error(f"--variants: unknown {unknown or 'empty'}; choose from {', '.join(VARIANTS)}")
    if (
        min(args.prompts, args.k, args.width, args.steps, args.batch_size, args.repeats) < 1
        or args.warmup < 0
    ):
        p.error("--prompts, --k, --width, --steps, --batch-size and --repeats must be >= 1, --warmup >= 0")
    return args


# ------------------------------------------------------------------------------------------------------
# inputs
def preset_of(args: argparse.Namespace) -> bench_gpu.Preset:
    return TINY if args.preset == "tiny" else bench_gpu.PRESETS[args.preset]


def build_model(preset: bench_gpu.Preset, device: str, seed: int) -> Any:
    """The preset's random-init model in fp32 on ``device``, as the trainer holds its policy."""
    import torch
    from transformers import AutoModelForCausalLM

    config = bench_gpu.preset_config(preset)
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.to(device).eval()  # a no-op where the device context already placed it


def build_prompts(
    prompts: int, width: int, vocab: int, pad_id: int, device: str, seed: int
) -> tuple[Any, Any]:
    """``prompts`` left-padded prompts (ids, mask) of random tokens from the vocabulary's first 512 rows
    (what the tiny tokenizer reaches), the longest ``width`` tokens, the others up to an eighth shorter."""
    import torch

    from rloo.generation import left_pad

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(max(1, width - width // 8), width + 1, (prompts,), generator=g)
    lengths[0] = width
    high = min(512, vocab)
    seqs = [torch.randint(3, high, (int(n),), generator=g).tolist() for n in lengths]
    return left_pad(seqs, pad_id, torch.device(device))


# ------------------------------------------------------------------------------------------------------
# timing
def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


@contextlib.contextmanager
def timed_prefill(device: str, record: list[float]) -> Iterator[None]:
    """Time every ``rloo.forward.prefill`` call (the generator's prompt prefill) into ``record``."""
    import rloo.forward
    import rloo.generation

    original = rloo.forward.prefill

    def timed(*a: Any, **kw: Any) -> Any:
        _sync(device)
        t0 = time.perf_counter()
        out = original(*a, **kw)
        _sync(device)
        record.append(time.perf_counter() - t0)
        return out

    patched = [m for m in (rloo.forward, rloo.generation) if getattr(m, "prefill", None) is original]
    for m in patched:
        m.prefill = timed  # type: ignore[attr-defined]
    try:
        yield
    finally:
        for m in patched:
            m.prefill = original  # type: ignore[attr-defined]


def make_generator(model: Any, variant: Variant, args: argparse.Namespace, autocast: Any) -> Any:
    from rloo.generation import TransformersGenerator

    return TransformersGenerator(
        model,
        batch_size=args.batch_size,
        # none over a bf16 copy, as TransformersGenerator.from_settings gives the trainer's copy: its
        # weights are in the compute dtype already
        autocast=None if variant.copy else autocast,
        cache_implementation=variant.cache,
        compile_decode=variant.compile and not args.no_compile,
        whole_step=variant.whole_step,
    )


def kv_layout(gen: Any, variant: Variant, inputs: dict[str, Any], steps: int) -> tuple[float, float]:
    """(positions read per decode step, bytes moved per cached K/V element) as this generator holds its
    cache: a static cache's allocated length and dtype from its kept buffers; a dynamic cache's live length
    (padded prompt + half the response) and the dtypes a one-prompt prefill gives its keys and values, each
    counted with its cast to the compute dtype when it differs (bench_gpu.element_read_bytes)."""
    import torch

    from rloo.forward import prefill

    width = inputs["ids"].size(1)
    ctx = gen.autocast or contextlib.nullcontext
    with torch.inference_mode(), ctx():  # the dtype attention computes in: autocast's, else the weights'
        device_type = inputs["ids"].device.type
        on = torch.is_autocast_enabled(device_type)
        compute = torch.get_autocast_dtype(device_type) if on else next(gen.model.parameters()).dtype
    size = torch.empty((), dtype=compute).element_size()
    if variant.cache == "static":
        layout = bench_gpu.static_kv_layout(gen)
        if layout is not None:
            return float(layout[0]), bench_gpu.element_read_bytes(layout[1], size)
    with torch.inference_mode():
        out, _ = prefill(gen.model, inputs["ids"][:1], inputs["mask"][:1], ctx)
    layer = out.past_key_values.layers[0]
    per_element = (
        bench_gpu.element_read_bytes(layer.keys.element_size(), size)
        + bench_gpu.element_read_bytes(layer.values.element_size(), size)
    ) / 2
    context = bench_gpu.decode_context(variant.cache, width, steps, bench_gpu.static_cache_bucket())
    return float(context), float(per_element)


def run_variant(
    name: str,
    model: Any,
    inputs: dict[str, Any],
    args: argparse.Namespace,
    autocast: Callable[[], Any],
) -> dict[str, Any]:
    """Warm up, time and run greedy once; the raw measurements of one variant."""
    import torch

    from rloo.generation import SamplingParams, rollout_copy

    variant, device = VARIANTS[name], args.device
    copy = rollout_copy(model, torch.bfloat16) if variant.copy else None
    if variant.compile and not args.no_compile:
        torch._dynamo.reset()  # each variant compiles afresh: no guards left over from another's model
    gen = make_generator(copy if copy is not None else model, variant, args, autocast)
    counted = bench_gpu.dynamo_counters()  # this variant's own compilations: the change from here
    ids, mask, seeds, pad = inputs["ids"], inputs["mask"], inputs["seeds"], inputs["pad"]
    sampled = SamplingParams(max_new_tokens=args.steps, temperature=1.0, pad_token_id=pad)
    greedy = SamplingParams(max_new_tokens=args.steps, pad_token_id=pad, greedy=True)
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(args.warmup):
        gen.generate(ids, mask, args.k, sampled, seeds)
    _sync(device)
    warmup_s = time.perf_counter() - t0
    calls, prefills = [], []
    for _ in range(args.repeats):
        record: list[float] = []
        with timed_prefill(device, record):
            _sync(device)
            t0 = time.perf_counter()
            out = gen.generate(ids, mask, args.k, sampled, seeds)
            _sync(device)
            calls.append(time.perf_counter() - t0)
        prefills.append(sum(record) if record else float("nan"))
    greedy_tokens = gen.generate(ids, mask, args.k, greedy, seeds).tokens
    peak = torch.cuda.max_memory_allocated() if device.startswith("cuda") else 0
    dynamo = {key: value - counted[key] for key, value in bench_gpu.dynamo_counters().items()}
    weights = bench_gpu.decode_weights(gen)
    kv = kv_layout(gen, variant, inputs, args.steps)
    del gen, copy
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return {
        "weights": weights,
        "cache": variant.cache,
        "kv_positions": kv[0],  # cache positions a decode step reads (mean over the steps)
        "kv_element_bytes": kv[1],  # bytes a step moves per cached element (casts included)
        "compiled": variant.compile and not args.no_compile,
        "whole_step": variant.whole_step,
        "warmup_s": warmup_s,
        "call_s": calls,
        "prefill_s": prefills,
        "peak_memory_bytes": peak,
        # graphs compiled and CUDA-graph fallbacks of this variant: a whole step that did not replay shows
        "dynamo": dynamo,
        "sampled_tokens": out.tokens.cpu(),
        "greedy_tokens": greedy_tokens.cpu(),
    }


# ------------------------------------------------------------------------------------------------------
# figures
def variant_figures(
    raw: dict[str, Any],
    *,
    args: argparse.Namespace,
    preset: bench_gpu.Preset,
    matmul_params: int,
    mean_prompt: float,
    bandwidth: float,
) -> dict[str, float]:
    """ms per step, tokens/s and the fractions of the decode bound of one variant's median call."""
    per_chunk = max(1, args.batch_size // args.k)  # prompts per generator batch
    chunks = math.ceil(args.prompts / per_chunk)
    rows = min(args.prompts, per_chunk) * args.k
    call = statistics.median(raw["call_s"])
    prefill = statistics.median(raw["prefill_s"])
    decode_steps = chunks * (args.steps - 1)  # the first token comes from the prefill's logits
    decode = (call - prefill) / decode_steps if decode_steps and prefill == prefill else float("nan")
    kv = {
        "matmul_params": matmul_params,
        "layers": preset.layers,
        "kv_heads": preset.num_kv_heads,
        "head_dim": preset.head_dim,
        "batch": rows,
    }
    read = bench_gpu.decode_step_bytes(
        weights=raw["weights"], context=raw["kv_positions"], kv_dtype_bytes=raw["kv_element_bytes"], **kv
    )
    # ideal: bf16 weights, each prompt's KV once per group (prefix sharing), each row's response KV so far
    ideal = bench_gpu.shared_prefix_decode_bytes(
        weight_bytes=bench_gpu.WEIGHT_READ_BYTES["bf16"] * matmul_params,
        kv_bytes_per_token=bench_gpu.kv_bytes_per_token(preset.layers, preset.num_kv_heads, preset.head_dim),
        prompts=rows // args.k,
        prompt=mean_prompt,
        k=args.k,
        length=args.steps,
    )
    return {
        "ms_per_token_step": 1e3 * call / (chunks * args.steps),
        "prefill_ms": 1e3 * prefill,
        "decode_ms_per_step": 1e3 * decode,
        "tokens_per_s": args.prompts * args.k * args.steps / call,
        "bytes_per_step_as_read": read,
        "fraction_of_bound_as_read": read / bandwidth / decode,
        "fraction_of_bound_ideal": ideal / bandwidth / decode,
        "peak_memory_gib": raw["peak_memory_bytes"] / GIB,
        "warmup_s": raw["warmup_s"],
        "cudagraph_skips": float(raw.get("dynamo", {}).get("cudagraph_skips", float("nan"))),
        "unique_graphs": float(raw.get("dynamo", {}).get("unique_graphs", float("nan"))),
    }


def equal_fraction(a: Any, b: Any) -> float:
    return float((a == b).float().mean()) if a.shape == b.shape else 0.0


def agreement_ok(greedy_equal: float) -> bool:
    """Whether a same-weights pair's greedy agreement is near-ties at most (bf16 between two compiled
    graphs need not be exact), not a bug."""
    return greedy_equal >= MIN_AGREEMENT


COLUMNS = (
    ("ms_per_token_step", "ms/token step", "{:.2f}"),
    ("prefill_ms", "prefill ms", "{:.1f}"),
    ("decode_ms_per_step", "decode ms/step", "{:.2f}"),
    ("tokens_per_s", "tokens/s", "{:,.0f}"),
    ("bytes_per_step_as_read", "GB read/step", "{:.2f}"),
    ("fraction_of_bound_as_read", "of bound, as read", "{:.0%}"),
    ("fraction_of_bound_ideal", "of bound, ideal", "{:.0%}"),
    ("peak_memory_gib", "peak GiB", "{:.1f}"),
    ("warmup_s", "warm-up s", "{:.1f}"),
    ("unique_graphs", "graphs", "{:.0f}"),
    ("cudagraph_skips", "CUDA-graph skips", "{:.0f}"),
)


def render(report: dict[str, Any]) -> str:
    ref = report.get("reference", "fp32-autocast")
    head = ["variant", "weights", "cache", *[label for _, label, _ in COLUMNS], f"greedy = {ref}"]
    lines = ["| " + " | ".join(head) + " |", "|---|---|---|" + "---:|" * (len(COLUMNS) + 1)]
    for name, v in report["variants"].items():
        if "error" in v:
            lines.append(f"| {name} | {v['error']} |")
            continue
        figs = dict(v["figures"])
        figs["bytes_per_step_as_read"] /= 1e9
        values = [figs.get(key, math.nan) for key, _, _ in COLUMNS]  # a key newer than the file: n/a
        cells = ["n/a" if v != v else fmt.format(v) for v, (_, _, fmt) in zip(values, COLUMNS, strict=True)]
        eq = v.get("greedy_equal_to_reference")
        lines.append(
            "| "
            + " | ".join([name, v["weights"], v["cache"], *cells, "n/a" if eq is None else f"{eq:.1%}"])
            + " |"
        )
    for check in report["checks"]:
        lines.append("")
        lines.append(check["line"])
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("no GPU: skipped")
        return 0
    from rloo.generation import row_seeds

    preset = preset_of(args)
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    peak = bench_gpu.gpu_peak(name)
    bandwidth = args.peak_bandwidth * 1e12 if args.peak_bandwidth else (peak[2] if peak else float("nan"))
    model = build_model(preset, args.device, args.seed)
    _, matmul_params = bench_gpu.model_param_counts(model.config)
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    ids, mask = build_prompts(args.prompts, args.width, model.config.vocab_size, pad, args.device, args.seed)
    seeds = row_seeds(args.seed, 0, torch.arange(args.prompts), args.k)
    inputs = {"ids": ids, "mask": mask, "seeds": seeds, "pad": pad}
    width, mean_prompt = ids.size(1), float(mask.sum()) / args.prompts
    device_type = "cuda" if args.device.startswith("cuda") else "cpu"

    def autocast() -> Any:
        return torch.autocast(device_type, dtype=torch.bfloat16)

    bw = f"{bandwidth / 1e12:.2f} TB/s" if bandwidth == bandwidth else "bandwidth unknown: no bound"
    print(
        f"device: {name} ({bw}); preset {args.preset}: {preset.arch} {preset.hidden} x "
        f"{preset.layers}, vocab {model.config.vocab_size}, {matmul_params:,} matmul params; "
        f"{args.prompts} prompts (width {width}, mean {mean_prompt:.0f}) x k={args.k}, {args.steps} new "
        f"tokens, batch {args.batch_size}; {args.warmup} warm-up + {args.repeats} timed calls",
        flush=True,
    )
    report: dict[str, Any] = {
        "device": name,
        "bandwidth": bandwidth,
        "preset": args.preset,
        "shape": {
            "prompts": args.prompts,
            "k": args.k,
            "width": width,
            "mean_prompt": mean_prompt,
            "steps": args.steps,
            "batch_size": args.batch_size,
            "matmul_params": matmul_params,
            "compiled": not args.no_compile,
        },
        "variants": {},
        "checks": [],
    }
    tokens: dict[str, dict[str, Any]] = {}
    failed = False
    for vname in args.variants:
        print(f"[{vname}] ...", file=sys.stderr, flush=True)
        try:
            raw = run_variant(vname, model, inputs, args, autocast)
        except Exception as e:  # one variant's failure (a compile error, OOM) leaves the others to run
            traceback.print_exc()
            failed = True
            report["variants"][vname] = {"error": f"failed: {type(e).__name__}: {str(e)[:120]}"}
            continue
        tokens[vname] = {"sampled": raw.pop("sampled_tokens"), "greedy": raw.pop("greedy_tokens")}
        figs = variant_figures(
            raw,
            args=args,
            preset=preset,
            matmul_params=matmul_params,
            mean_prompt=mean_prompt,
            bandwidth=bandwidth,
        )
        report["variants"][vname] = {**raw, "figures": figs}
        print(f"    {figs['ms_per_token_step']:.2f} ms/token step", file=sys.stderr, flush=True)
        if args.json:  # after every variant: a run cut short keeps what it measured
            args.json.write_text(json.dumps(report, indent=2))

    reference = "fp32-autocast" if "fp32-autocast" in tokens else next(iter(tokens), None)
    for vname, t in tokens.items():
        assert reference is not None  # tokens is not empty here
        report["variants"][vname]["greedy_equal_to_reference"] = equal_fraction(
            t["greedy"], tokens[reference]["greedy"]
        )
    mismatch = False
    for a, b in MUST_MATCH:
        if a in tokens and b in tokens:
            greedy_eq = equal_fraction(tokens[a]["greedy"], tokens[b]["greedy"])
            sampled_eq = equal_fraction(tokens[a]["sampled"], tokens[b]["sampled"])
            ok = agreement_ok(greedy_eq)
            mismatch |= not ok
            if greedy_eq == 1.0:
                verdict = "ok"
            elif ok:
                verdict = f"ok (>= {MIN_AGREEMENT:.0%}: bf16 near-ties between the two graphs)"
            else:
                verdict = f"MISMATCH: below {MIN_AGREEMENT:.0%} of greedy tokens equal, more than near-ties"
            line = (
                f"{a} vs {b} (same weights): greedy {greedy_eq:.1%} equal, sampled {sampled_eq:.1%} equal -- "
                + verdict
            )
            report["checks"].append(
                {
                    "pair": [a, b],
                    "greedy": greedy_eq,
                    "sampled": sampled_eq,
                    "min_agreement": MIN_AGREEMENT,
                    "ok": ok,
                    "line": line,
                }
            )
    if reference:
        report["reference"] = reference
    print(render(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    if mismatch:
        return 3
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
