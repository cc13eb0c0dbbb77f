#!/usr/bin/env python
"""GPU benchmark: this project's RLOO trainer against TRL's ``RLOOTrainer`` at ~0.5B and ~1.5B parameters.

For each model size, both trainers train the same random-init Qwen2-shaped model with its full vocabulary
(built locally, nothing is downloaded) on the same toy task at the TL;DR shape (~512-token prompts,
53-token completions, k=4, 64 completions per update) in bf16 autocast, each in a fresh subprocess, and
one table reports side by side: episodes/s, tokens/s per phase (generation, log-probs + scoring,
optimisation), training MFU, generation throughput as a fraction of the memory-bandwidth bound of
decoding, and peak GPU memory.

Two MFUs, over the optimisation phase's time and the GPU's peak dense bf16 FLOP/s:

- needed (the headline): the FLOPs the update needs, the same numerator for every trainer -- each group's
  prompt once (unpadded), every completion's response positions attending to it, logits at the response
  positions only (``training_flops_needed``). A trainer that recomputes prompts reads lower here.
  (The old "nominal" 6 * N * (prompt + completion tokens of every completion) stays in the JSON only.)
- executed: the FLOPs each trainer runs. Per forward pass over a micro-batch,
  ``2 * N_body * positions + 4 * layers * hidden * keys + 2 * hidden * V * logit positions``, where
  N_body is the matmul parameters but the output layer (hidden x V), ``positions`` the token positions
  through the layers (padding included: it is computed), ``keys`` the sum over those positions of the
  keys each computes a score with (QK^T and AV), and the output layer runs only where logits are kept;
  training = 3x that (backward = 2x forward) for every term whose output is used, 1x for logits computed
  and dropped, and 4x the layers' terms under gradient checkpointing (their forward runs again in the
  backward; the output layer is not checkpointed). A micro-batch holds b completions of U = b / K prompts
  of padded width W and T response tokens; ``forward_layout`` follows ``rloo.forward.response_logits``
  as ``LogProbs.forward`` calls it. TRL, and ours when sharing does not pay (U*W + b*T >= SHARE_THRESHOLD
  * b * (W + T)) and nothing is compiled: b plain rows of W + T positions, causal keys, T + 1 logits kept
  (one dropped). Ours when sharing pays, with attention that takes a 4D mask (sdpa, eager: the bench's
  models): packed rows, one per prompt group, the prompt then the K responses but their last token, S =
  W + K (T - 1) columns; the masked attention kernel computes the whole S x S square (U * S^2 keys) and
  the output layer exactly the b * T needed logits. Under ``torch_compile`` (compiled policy layers) the
  policy's rows are always packed (one per completion, W + T - 1 columns, when sharing does not pay) and
  padded on the left to a multiple of 64 columns. Attention that takes no mask shares through a KV cache
  instead (U prefixes of W - 1 positions, one dropped logit each, then b rows of T positions attending to
  W - 1 + t keys), plain rows for a policy under either option. The reference model (never compiled)
  follows the same rules by cost. The no-grad log-prob forwards (``logprob_flops_executed``: the
  reference's, and the policy's "old" ones when off-policy) give a JSON-only ``logprobs_mfu_executed`` for
  ours over its log-probs phase.

Decoding bounds: tokens/s <= batch * bandwidth / bytes per decode step, with KV bytes a token =
2 * layers * kv_heads * head_dim * KV bytes. "ideal": bf16 weights (2 bytes a parameter), each prompt's KV
read once per group (as a prefix-sharing decoder can) and each row's own response KV so far: weights +
(P * L + P * K * T / 2) KV tokens (``shared_prefix_decode_bytes``). "as read": the weights as the run
holds them -- fp32 weights under bf16 autocast are read as fp32 (4), written as a bf16 copy (2) and read
again (2) at every step, 8 bytes a parameter; a bf16 rollout copy 2 -- and the KV cache as allocated: a
static cache is read whole (padded prompt + every response slot, rounded up to the generator's bucket;
length and dtype read from its buffers) at every step, a dynamic one up to the current token (an fp32
model's keys under autocast are fp32, cast at every step: 8 bytes, its values bf16: 2).

Steady episodes/s: one update's batch over the median wall-clock time of the updates after the second,
taken the same way for both trainers (from one update's start to the next's, metric writes included).
The JSON and the table also give torch._dynamo's counters after ours' run (unique graphs, inductor's
cudagraph_skips: a compiled decode that silently fell back from CUDA graphs shows there) and the
settings the two runs did not share. The baseline is TRL (version read at run time), use_vllm=False.

Targets (not asserted): ours >= 2x TRL's episodes/s; training >= 40% MFU (needed FLOPs) at 1.5B;
generation >= 50% of the bandwidth bound.

    python benchmarks/bench_gpu.py                  # both sizes, both trainers (needs trl: make bench)
    python benchmarks/bench_gpu.py --sizes 0.5b --only ours --generation compiled
    python benchmarks/bench_gpu.py --dry-run        # the plan and the GPU's peak figures, nothing trained

Without a CUDA GPU it prints "no GPU: skipped" and exits 0. See benchmarks/README.md ("GPU benchmark").
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import shutil
import statistics
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
    kv_heads: int | None = None  # key/value heads; None: as many as heads (rloo.demo.tiny's models)
    intermediate: int | None = None  # MLP width; None: 4 x hidden (rloo.demo.tiny's models)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads or self.heads

    @property
    def mlp_size(self) -> int:
        return self.intermediate or 4 * self.hidden


# Qwen2.5-0.5B and -1.5B's own shapes (their config.json: grouped-query attention with 2 key/value heads,
# their MLP widths, tied embeddings, the 151,936-row vocabulary; 494M and 1.54B parameters) at the TL;DR
# shape: ~512-token prompts (320 words), 53-token completions, 16 prompts x k=4 = 64 completions per update.
QWEN2_VOCAB = 151_936
_TLDR: dict[str, Any] = {"prompts": 16, "k": 4, "length": 53, "vocab": QWEN2_VOCAB, "prompt_words": 320}
PRESETS: dict[str, Preset] = {
    "0.5b": Preset("qwen2", 896, 24, 14, kv_heads=2, intermediate=4864, micro_batch=32, **_TLDR),
    "1.5b": Preset("qwen2", 1536, 28, 12, kv_heads=2, intermediate=8960, micro_batch=8, **_TLDR),
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


def qwen2_param_counts(preset: Preset) -> tuple[int, int]:
    """(total, matmul) parameters of a Qwen2 preset by hand: per layer q and o (hidden^2 each), k and v
    (hidden x kv_heads x head_dim each: grouped-query attention), biases on q, k and v, gate/up/down
    (hidden x intermediate each), two RMSNorm weights; a final norm; one embedding tied to the LM head
    (so every parameter but the norms' and biases' multiplies, and the count is the same)."""
    h, kv = preset.hidden, preset.num_kv_heads * preset.head_dim
    attention = 2 * h * h + 2 * h * kv + (h + 2 * kv)
    per_layer = attention + 3 * h * preset.mlp_size + 2 * h
    total = (preset.vocab or 0) * h + preset.layers * per_layer + h
    return total, total


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


def training_flops_needed(
    *, batch: int, k: int, prompt: float, length: int, body_params: int, hidden: int, layers: int, vocab: int
) -> float:
    """FLOPs one rollout's optimisation (forward + backward, one epoch) needs, whatever a trainer runs:
    each group's prompt (``prompt`` tokens, unpadded) once, every completion's ``length`` positions
    attending to it, logits at the response positions only, nothing computed and dropped. The same
    numerator for every trainer, so their MFUs on it compare their speed at the same work."""
    # the KV-cache layout's positions and causal keys: each prompt once, no padding, no masked score
    count = forward_count(batch, k, max(2, round(prompt)), length, Layout("kv_cache"))
    needed = ForwardCount(count.positions, count.keys, count.logits, dropped_logits=0.0)
    return pass_flops(
        needed, body_params=body_params, hidden=hidden, layers=layers, vocab=vocab, backward=True
    )


def shared_prefix_decode_bytes(
    *, weight_bytes: float, kv_bytes_per_token: float, prompts: int, prompt: float, k: int, length: int
) -> float:
    """Bytes a decode step of ``prompts`` x ``k`` rows must read when the ``k`` completions of a prompt
    share its KV cache (what a prefix-sharing decoder reaches): every weight once, each prompt's
    ``prompt`` tokens of KV once per group, and each row's own response KV up to the current token
    (``length / 2`` on average over the steps)."""
    kv_tokens = prompts * prompt + prompts * k * length / 2  # (P * L) + (P * K * T / 2)
    return weight_bytes + kv_tokens * kv_bytes_per_token


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


def element_read_bytes(storage_bytes: float, compute_bytes: float = 2.0) -> float:
    """Bytes a decode step moves per stored element (a weight, a cached key or value): its storage, plus,
    when that is not the compute dtype, the cast written and read again. Autocast's weight casts are not
    kept across steps (each step enters its own autocast context), nor are attention's casts of a cache."""
    return storage_bytes if storage_bytes == compute_bytes else storage_bytes + 2 * compute_bytes


# Per weight, by how the generating model holds its weights: fp32 under bf16 autocast reads the fp32 weight,
# writes its bf16 cast and reads that (8 bytes); a bf16 copy is read once (2); fp32 without autocast 4.
WEIGHT_READ_BYTES = {"bf16": 2.0, "fp32": 4.0, "fp32-autocast": element_read_bytes(4.0, 2.0)}


def kv_read_bytes(weights: str, cache: str) -> float:
    """Bytes read per cached K/V element (the mean of keys and values) when it is not measured: a static
    cache is allocated in the compute dtype (bf16); a dynamic one of an fp32 model under bf16 autocast holds
    fp32 keys (the rotary embedding promotes them; attention casts them at every step) and bf16 values;
    a bf16 model's cache is bf16, an fp32 model's without autocast fp32."""
    if weights == "fp32":
        return 4.0
    if weights == "fp32-autocast" and cache == "dynamic":
        return (element_read_bytes(4.0) + element_read_bytes(2.0)) / 2
    return 2.0


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype_bytes: float = 2.0) -> float:
    """KV-cache bytes one token holds: K and V, every layer, every key/value head."""
    return 2.0 * layers * kv_heads * head_dim * dtype_bytes


def decode_context(cache: str, prompt_width: float, length: int, bucket: int = 1) -> float:
    """Cache positions a decode step reads, averaged over the steps: a static cache is preallocated to the
    padded prompt width + every response slot (rounded up to ``bucket``) and read whole at every step; a
    dynamic one holds the prompt and the tokens so far (W + t at step t = 1..T-1: W + T/2 on average)."""
    if cache == "static":
        return math.ceil((prompt_width + length) / bucket) * bucket
    if cache == "dynamic":
        return prompt_width + length / 2
    raise ValueError(f"unknown cache {cache!r}: static or dynamic")


def static_kv_layout(generator: Any) -> tuple[int, float] | None:
    """(positions allocated, bytes per element) of the static KV cache a ``TransformersGenerator`` last
    decoded into, read from its kept buffers; None when it has none (a dynamic cache, another version)."""
    try:
        layer = list(generator._buffers.values())[-1].cache.layers[0]
        return int(layer.keys.size(2)), (layer.keys.element_size() + layer.values.element_size()) / 2
    except (AttributeError, IndexError, TypeError):
        return None


def static_cache_bucket() -> int:
    """The generator's rounding of static cache lengths (1 where this checkout does not round)."""
    import rloo.generation

    return int(getattr(rloo.generation, "CACHE_BUCKET", 1))


def decode_step_bytes(
    *,
    matmul_params: int,
    weights: str,
    layers: int,
    kv_heads: int,
    head_dim: int,
    batch: int,
    context: float,
    kv_dtype_bytes: float = 2.0,
) -> float:
    """Bytes one decode step reads: every matmul weight in the form the run holds it
    (``WEIGHT_READ_BYTES[weights]`` a parameter), plus ``2 * layers * kv_heads * head_dim * context *
    kv_dtype_bytes * batch`` of KV cache (``context``: see :func:`decode_context`)."""
    weight_bytes = WEIGHT_READ_BYTES[weights] * matmul_params
    return weight_bytes + batch * context * kv_bytes_per_token(layers, kv_heads, head_dim, kv_dtype_bytes)


def shares_prefix(rows: int, k: int, width: int, length: int) -> bool:
    """``rloo.forward.response_logits``' own choice for a micro-batch of ``rows`` completions in whole
    groups of ``k`` (ceil(rows / k) prompts) of padded prompt width ``width`` and ``length`` response
    tokens: share the prompts when that leaves fewer than SHARE_THRESHOLD of a plain forward's tokens."""
    from rloo.forward import SHARE_THRESHOLD

    if width < 2:
        return False
    prompts = math.ceil(rows / k)
    return prompts * width + rows * length < SHARE_THRESHOLD * rows * (width + length)


# How ``rloo.forward.response_logits`` lays a forward out: plain ``[prompt; response]`` rows, the prompts
# once into a KV cache (attention that takes no 4D mask), or packed rows under a 4D block mask.
LAYOUTS = ("plain", "kv_cache", "packed")


@dataclass(frozen=True)
class Layout:
    """How one forward over a micro-batch runs (``rloo.forward.response_logits`` with the arguments
    ``LogProbs.forward`` gives it)."""

    mode: str  # one of LAYOUTS
    share: bool = False  # packed: one row per prompt group (else one per completion)
    width_multiple: int = 1  # packed: rows left-padded to a multiple of this many columns

    def __post_init__(self) -> None:
        if self.mode not in LAYOUTS:
            raise ValueError(f"unknown layout {self.mode!r}: one of {', '.join(LAYOUTS)}")


def forward_layout(
    rows: int,
    k: int,
    width: int,
    length: int,
    *,
    block_mask: bool = True,
    compiled: bool = False,
    cache_free: bool = False,
) -> Layout:
    """The layout ``LogProbs.forward`` gets from ``rloo.forward.response_logits`` for a micro-batch (see
    :func:`shares_prefix` for the arguments) of a model whose attention takes a 4D mask (``block_mask``:
    sdpa, eager) or not, with compiled decoder layers (``compiled``: the policy under --torch_compile),
    run without a KV cache (``cache_free``: the policy under --torch_compile or gradient checkpointing).

    With the mask: packed rows when sharing pays, and under compiled layers always (one row per completion
    when sharing does not pay), padded to COMPILED_WIDTH_MULTIPLE columns so that the layers' graphs meet
    few widths; plain rows otherwise. Without it: the KV cache when sharing pays, unless cache-free (a
    compiled layer runs a cache call eager, checkpointing takes no cache), plain rows otherwise."""
    from rloo.training.completion_logprobs import COMPILED_WIDTH_MULTIPLE

    share = shares_prefix(rows, k, width, length)
    if not block_mask:
        return Layout("kv_cache" if share and not (cache_free or compiled) else "plain")
    if share or compiled:
        return Layout("packed", share=share, width_multiple=COMPILED_WIDTH_MULTIPLE if compiled else 1)
    return Layout("plain")


def packed_shape(rows: int, k: int, width: int, length: int, layout: Layout) -> tuple[int, int]:
    """(rows, columns) of the packed input ``rloo.forward.pack_rows`` builds: a row per prompt group
    (ceil(rows / k), each holding min(rows, k) responses) when sharing, else per completion; a row is the
    left-padded prompt (``width``) then each response but its last token (``length - 1``) back to back,
    padded on the left to a multiple of ``layout.width_multiple``."""
    packed_rows, slots = (math.ceil(rows / k), min(rows, k)) if layout.share else (rows, 1)
    used = width + slots * (length - 1)
    return packed_rows, -(-used // layout.width_multiple) * layout.width_multiple


@dataclass(frozen=True)
class ForwardCount:
    """What one forward pass over a micro-batch computes."""

    positions: float  # token positions through the transformer layers
    keys: float  # summed over those positions: the keys each computes a score with
    logits: float  # output-layer positions whose logits are used (and get a gradient in training)
    dropped_logits: float  # output-layer positions computed and never used


def forward_count(rows: int, k: int, width: int, length: int, layout: Layout) -> ForwardCount:
    """Positions, attention keys and logit positions of one forward over ``rows`` completions (whole groups
    of ``k``) with prompts padded to ``width`` and ``length`` response tokens, as ``rloo.forward.
    response_logits`` runs it in ``layout``:

    - plain (TRL's forwards, and ours' when nothing is shared or compiled): every row whole, W + T
      positions, keys counted causally (a left-padded batch hands SDPA an explicit mask, under which it
      may compute the whole square: not counted, so plain rows' figure is a lower bound), the last T + 1
      logits, the final one dropped;
    - kv_cache: the ceil(rows / k) prompts but their last token once into a KV cache, one logit each
      (dropped), then every row's last prompt token and response but its last token: T positions attending
      to the cache and causally among themselves, T logits;
    - packed: :func:`packed_shape`'s R rows of S columns, padding included (it runs through the layers).
      An arbitrary 4D mask sends SDPA to its memory-efficient or math kernel, which computes the whole
      S x S score square, masked or not: R * S^2 keys. The output layer sees exactly the b * T needed
      positions (``packed_logits`` gathers them before it): nothing dropped.
    """
    w, t = float(width), float(length)
    if layout.mode == "packed":
        packed_rows, columns = packed_shape(rows, k, width, length, layout)
        return ForwardCount(
            positions=float(packed_rows * columns),
            keys=float(packed_rows * columns * columns),
            logits=rows * t,
            dropped_logits=0.0,
        )
    if layout.mode == "kv_cache":
        prompts = math.ceil(rows / k)
        prefix = w - 1
        return ForwardCount(
            positions=prompts * prefix + rows * t,
            keys=prompts * prefix * (prefix + 1) / 2 + rows * (t * prefix + t * (t + 1) / 2),
            logits=rows * t,
            dropped_logits=float(prompts),
        )
    s = w + t
    return ForwardCount(
        positions=rows * s, keys=rows * s * (s + 1) / 2, logits=rows * t, dropped_logits=float(rows)
    )


def pass_flops(
    count: ForwardCount,
    *,
    body_params: int,
    hidden: int,
    layers: int,
    vocab: int,
    backward: bool,
    recompute: bool = False,
) -> float:
    """FLOPs of one pass: 2 * N_body per position, 4 * layers * hidden per attended key (QK^T and AV; the
    attention width heads x head_dim is the hidden size here), 2 * hidden * V per logit position; x3 with
    the backward (it costs twice the forward), except the dropped logits (no gradient reaches them).
    ``recompute`` (activation checkpointing) runs the decoder layers' forward again in the backward: x4
    for the positions and keys; the output layer sits outside the checkpointed layers, still x3."""
    layer_flops = 2.0 * body_params * count.positions + 4.0 * layers * hidden * count.keys
    logit_flops = 2.0 * hidden * vocab * count.logits
    dropped = 2.0 * hidden * vocab * count.dropped_logits
    if not backward:
        return layer_flops + logit_flops + dropped
    return (4.0 if recompute else 3.0) * layer_flops + 3.0 * logit_flops + dropped


def _passes_flops(
    by_cost: bool,
    *,
    batch: int,
    chunk: int,
    k: int,
    width: int,
    length: int,
    backward: bool,
    block_mask: bool = True,
    compiled: bool = False,
    cache_free: bool = False,
    recompute: bool = False,
    **shape: int,
) -> float:
    """FLOPs of forwards over ``batch`` completions in chunks of ``chunk`` rows, each laid out as
    :func:`forward_layout` says when ``by_cost`` (ours), plain rows otherwise (TRL)."""
    total = 0.0
    for start in range(0, batch, chunk):
        rows = min(chunk, batch - start)
        flags = {"block_mask": block_mask, "compiled": compiled, "cache_free": cache_free}
        layout = forward_layout(rows, k, width, length, **flags) if by_cost else Layout("plain")
        count = forward_count(rows, k, width, length, layout)
        total += pass_flops(count, **shape, backward=backward, recompute=recompute)
    return total


def training_flops_executed(
    trainer: str,
    *,
    batch: int,
    micro_batch: int,
    k: int,
    width: int,
    length: int,
    body_params: int,
    hidden: int,
    layers: int,
    vocab: int,
    torch_compile: bool = False,
    gradient_checkpointing: bool = False,
    block_mask: bool = True,
) -> float:
    """FLOPs one rollout's optimisation (one epoch, forward + backward) executes. Ours lays out each
    micro-batch as :func:`forward_layout` says (``torch_compile``: compiled layers, packed rows of 64-column
    multiples); under ``gradient_checkpointing`` the layout is the same (packed rows take no cache) but the
    decoder layers' forward runs again in the backward. TRL runs every row with its prompt (the bench turns
    its checkpointing off, as ours')."""
    shape = {"body_params": body_params, "hidden": hidden, "layers": layers, "vocab": vocab}
    ours = trainer == "ours"
    return _passes_flops(
        ours,
        batch=batch,
        chunk=micro_batch,
        k=k,
        width=width,
        length=length,
        backward=True,
        block_mask=block_mask,
        compiled=ours and torch_compile,
        cache_free=ours and (torch_compile or gradient_checkpointing),
        recompute=ours and gradient_checkpointing,
        **shape,
    )


def logprob_flops_executed(
    *,
    batch: int,
    chunk: int,
    k: int,
    width: int,
    length: int,
    body_params: int,
    hidden: int,
    layers: int,
    vocab: int,
    torch_compile: bool = False,
    gradient_checkpointing: bool = False,
    old_logprobs: bool = True,
    block_mask: bool = True,
) -> float:
    """FLOPs of ours' no-grad log-prob forwards over one rollout (``LogProbs.batched``, chunks of ``chunk``
    rows): the reference model's (never compiled: laid out by cost), plus, when ``old_logprobs`` (off
    policy: on-policy runs take them from the generator), the policy's, laid out as its training forward
    (``torch_compile``: packed rows of 64-column multiples). No backward, so checkpointing recomputes
    nothing here; like compiled layers it only keeps a policy whose attention takes no mask off the KV
    cache."""
    shape: dict[str, Any] = {"body_params": body_params, "hidden": hidden, "layers": layers, "vocab": vocab}
    kw: dict[str, Any] = {"batch": batch, "chunk": chunk, "k": k, "width": width, "length": length}
    kw.update(backward=False, block_mask=block_mask)
    total = _passes_flops(True, **kw, **shape)  # the reference
    if old_logprobs:
        cache_free = torch_compile or gradient_checkpointing
        total += _passes_flops(True, **kw, compiled=torch_compile, cache_free=cache_free, **shape)
    return total


# ------------------------------------------------------------------------------------------------------
# command line
def micro_batch_arg(text: str) -> int | str:
    """--micro-batch: a positive int or "auto"."""
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"a positive whole number or 'auto', not {text!r}")
    return value


def ours_overrides(spec: dict[str, Any]) -> dict[str, Any]:
    """RLOOConfig fields the spec sets for ours beyond bench_vs_trl.rloo_config's (the decode path,
    compiled layers, the trainer's own micro-batch when --micro-batch asked for one)."""
    generation = spec.get("generation", "dynamic")
    overrides: dict[str, Any] = {
        "bf16": True,
        "cache_implementation": "dynamic" if generation == "dynamic" else "static",
        "compile_generation": generation == "compiled",
        "torch_compile": bool(spec.get("torch_compile", False)),
    }
    if spec.get("micro_batch_size") is not None:
        overrides["micro_batch_size"] = spec["micro_batch_size"]
    return overrides


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="rloo vs TRL's RLOOTrainer on one GPU at ~0.5B and ~1.5B parameters: one table.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--sizes", default="0.5b,1.5b", help=f"Comma-separated presets: {', '.join(PRESETS)}.")
    p.add_argument(
        "--updates",
        type=int,
        default=8,
        help="RLOO updates per run (steady figures: the median update after the second).",
    )
    p.add_argument(
        "--micro-batch",
        type=micro_batch_arg,
        help="Ours only: the trainer's --micro_batch_size (an int, or 'auto': chosen from free GPU memory); "
        "default: the preset's micro-batch, as TRL's.",
    )
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
    p.add_argument(
        "--torch-compile",
        action="store_true",
        help="Ours with --torch_compile: each decoder layer compiled for the training forward and backward.",
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
    if args.updates < 3:
        p.error("--updates must be >= 3 (steady figures are the median over the updates after the second)")
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


def decode_weights(generator: Any) -> str:
    """How a generator holds the weights it decodes with (a key of WEIGHT_READ_BYTES): "bf16" when any
    model it holds is in bf16 (a rollout copy), else fp32 read under autocast when it has an autocast,
    else plain fp32."""
    import torch

    models = [v for v in vars(generator).values() if isinstance(v, torch.nn.Module)]
    dtypes = {p.dtype for m in models for p in m.parameters() if p.is_floating_point()}
    if torch.bfloat16 in dtypes:
        return "bf16"
    return "fp32-autocast" if getattr(generator, "autocast", None) is not None else "fp32"


def _mean_after_first(values: list[float]) -> float:
    """The steady mean (the first, warm-up value left out when there are others); NaN when empty."""
    steady = values[1:] or values
    return sum(steady) / len(steady) if steady else float("nan")


def dynamo_counters() -> dict[str, Any]:
    """torch._dynamo's counters after a run: how many distinct graphs it compiled, how often inductor
    fell back from CUDA graphs (a silent fallback to launching every kernel), and the graph breaks."""
    from torch._dynamo.utils import counters

    return {
        "unique_graphs": int(counters["stats"]["unique_graphs"]),
        "cudagraph_skips": int(counters["inductor"]["cudagraph_skips"]),
        "graph_breaks": int(sum(counters["graph_break"].values())),
    }


def module_dtype(module: Any) -> str:
    """The dtype of a model's first floating-point parameter ("none" for no model)."""
    if module is None:
        return "none"
    for param in module.parameters():
        if param.is_floating_point():
            return str(param.dtype).removeprefix("torch.")
    return "none"


def record_update_ends(trainer: Any, ends: list[float]) -> None:
    """Append the wall-clock time at the end of each update, after its metrics are written (``_report``),
    so that ours is timed as TRL is: from one update's start to the next's."""
    report = trainer._report

    def timed_report(*a: Any, **kw: Any) -> Any:
        out = report(*a, **kw)
        _sync()
        ends.append(time.perf_counter())
        return out

    trainer._report = timed_report


def worker_ours(spec: dict[str, Any]) -> dict[str, Any]:
    from rloo.forward import model_config
    from rloo.training.trainer import RLOOTrainer

    batch = spec["prompts"] * spec["k"]
    overrides = ours_overrides(spec)
    cfg = bench_vs_trl.rloo_config(spec, **overrides)
    trainer = RLOOTrainer(cfg)
    k = trainer.cfg.rloo_k
    # the padded prompt width of every rollout: what the forwards and the KV cache actually hold
    widths: list[float] = []
    generate = trainer.generator.generate

    def recording_generate(prompt_ids: Any, *a: Any, **kw: Any) -> Any:
        widths.append(float(prompt_ids.size(1)))
        return generate(prompt_ids, *a, **kw)

    trainer.generator.generate = recording_generate  # type: ignore[method-assign]
    ends: list[float] = []
    record_update_ends(trainer, ends)
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
        "trainer": "ours",
        "seconds": seconds,
        "episodes": result.episodes,
        "phase_seconds": {
            p: sum(h.get(f"time/{p}_s", 0.0) for h in steady)
            for p in ("generation", "logprobs", "scoring", "optimization")
        },
        "generated_tokens": gen_tokens,
        "train_tokens": train_tokens,
        "prompt_tokens_per_completion": prompt_tokens / max(1, batch * len(steady)),
        "prompt_width": _mean_after_first(widths),
        "decode_weights": decode_weights(trainer.generator),
        "decode_cache": getattr(trainer.generator, "cache_implementation", "dynamic"),
        # the static cache as allocated (None: dynamic, or not readable): positions, bytes per element
        "kv_cache_layout": static_kv_layout(trainer.generator),
        "rollouts": len(steady),
        # wall clock per update, metric writes included (the steady figure: the median after the second)
        "update_wall_s": [b - a for a, b in zip([t0, *ends], ends, strict=False)],
        "steady_seconds": sum(h["time/update_s"] for h in steady),
        "steady_episodes": batch * len(steady),
        "peak_memory_bytes": _peak_memory(),
        "dynamo": dynamo_counters(),
        "micro_batch": trainer.micro.size,  # as the trainer resolved it ('auto': from free memory)
        "micro_batch_chosen_by": trainer.micro.chosen_by,
        "settings": {
            "policy weights": module_dtype(trainer.policy),
            "reference weights": module_dtype(trainer.ref_policy),
            "autocast": "bf16",
            "micro-batch": str(trainer.micro.size),
            "decode": f"{overrides['cache_implementation']} cache"
            + (", compiled step" if overrides["compile_generation"] else ""),
            "gradient checkpointing": str(bool(trainer.cfg.gradient_checkpointing)),
        },
        # what decides how the forwards run (see LogProbs.forward and forward_layout): compiled layers
        # (packed rows of 64-column multiples), checkpointing (the layers' forward again in the backward),
        # the attention (a 4D mask: packed rows; none: a KV cache); the no-grad log-prob forwards' chunk;
        # whether the policy's "old" log-prob forward runs (off-policy; on-policy they come from the
        # generator)
        "torch_compile": bool(trainer.cfg.torch_compile),
        "gradient_checkpointing": bool(trainer.cfg.gradient_checkpointing),
        "attn_implementation": getattr(model_config(trainer.policy), "_attn_implementation", None),
        "logprob_chunk": max(k, trainer.cfg.local_rollout_forward_batch_size // k * k),
        "old_logprobs_forward": not trainer.updater.on_policy,
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
        use_vllm=False,  # transformers' generate: the baseline the table names
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
    widths: list[float] = []
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
        widths.append(float(max(map(len, prompt_ids))))  # generate() left-pads them to the longest
        return out

    def timed_rollout(inputs: Any) -> Any:
        _sync()
        t0 = time.perf_counter()
        out = roll_orig(inputs)
        _sync()
        rollouts.append((t0, time.perf_counter()))
        return out

    trainer._generate = timed_generate  # type: ignore[method-assign]
    trainer._generate_and_score_completions = timed_rollout  # type: ignore[method-assign]
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
        "trainer": "trl",
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
        "prompt_width": _mean_after_first(widths),
        # transformers' generate on the fp32 model, whose forward accelerate wraps in bf16 autocast
        # (unwrap_model keeps that wrapper), with a growing (dynamic) cache
        "decode_weights": "fp32-autocast" if args.bf16 else "fp32",
        "decode_cache": "dynamic",
        "rollouts": len(steady_gen),
        # wall clock per update: from one rollout's start to the next's (the last: to the end of training)
        "update_wall_s": [b - a for a, b in zip(starts, [*starts[1:], t1], strict=True)],
        "steady_seconds": t1 - starts[1] if len(starts) > 1 else float("nan"),
        "steady_episodes": (updates - 1) * batch,
        "peak_memory_bytes": _peak_memory(),
        "trl_version": importlib.metadata.version("trl"),
        "micro_batch": spec["micro_batch"],
        "settings": {
            "policy weights": module_dtype(trainer.model),
            "reference weights": module_dtype(getattr(trainer, "ref_model", None)),
            "autocast": "bf16" if args.bf16 else "none",
            "micro-batch": str(spec["micro_batch"]),
            "decode": "dynamic cache",  # transformers' generate
            "gradient checkpointing": str(bool(args.gradient_checkpointing)),
        },
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
    policy = root / (
        f"policy-{preset.arch}-{preset.hidden}x{preset.layers}-kv{preset.num_kv_heads}-i{preset.mlp_size}"
        f"-v{preset.vocab or 0}"
    )
    if not (policy / "config.json").is_file():
        build_causal_lm(
            policy,
            tok_dir,
            arch=preset.arch,
            hidden_size=preset.hidden,
            num_layers=preset.layers,
            num_heads=preset.heads,
            num_key_value_heads=preset.num_kv_heads,
            intermediate_size=preset.mlp_size,
            seed=args.seed,
            vocab_size=preset.vocab,
            max_position_embeddings=2048,
        )
    words = preset.prompt_words if args.prompt_words is None else args.prompt_words
    data = root / f"data-{words}"
    if not data.is_dir():
        write_toy_dataset(data, num_train=1024, seed=args.seed, context_words=words)
    return {"policy": str(policy), "dataset": str(data)}


def preset_config(preset: Preset) -> Any:
    """The transformers config of a preset's model (built against the tiny tokenizer's special ids)."""
    from rloo.demo.tiny import build_tokenizer, causal_lm_config

    with tempfile.TemporaryDirectory() as tmp:
        build_tokenizer(Path(tmp))
        return causal_lm_config(
            tmp,
            arch=preset.arch,
            hidden_size=preset.hidden,
            num_layers=preset.layers,
            num_heads=preset.heads,
            num_key_value_heads=preset.num_kv_heads,
            intermediate_size=preset.mlp_size,
            vocab_size=preset.vocab,
            max_position_embeddings=2048,
        )


def preset_param_counts(preset: Preset) -> tuple[int, int]:
    """(total, matmul) parameters of a preset's model, from its config alone (nothing is built)."""
    return model_param_counts(preset_config(preset))


def run_one(trainer: str, spec: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    return bench_vs_trl.launch_worker(__file__, trainer, LABELS[trainer], spec, run_dir)[0]


def median_after_second(seconds: list[float]) -> float:
    """The median of per-update wall-clock times over the updates after the second (the first two carry
    compilation, CUDA-graph capture and allocator warm-up); NaN with fewer than three updates."""
    steady = seconds[2:]
    return statistics.median(steady) if steady else float("nan")


def steady_episodes_per_s(result: dict[str, Any], batch: int) -> float:
    """Episodes/s in the steady state: one update's batch over the median per-update wall-clock time
    (``update_wall_s``, taken the same way for every trainer); result files from before it: their
    summed steady time."""
    walls = result.get("update_wall_s")
    if walls:
        return batch / median_after_second(walls)
    if result.get("steady_seconds"):
        return float(result["steady_episodes"] / result["steady_seconds"])
    return float("nan")


def figures(
    result: dict[str, Any], preset: Preset, matmul_params: int, peak: tuple[str, float, float]
) -> dict[str, float]:
    """The table's figures for one run."""
    from rloo.demo.tiny import VOCAB_SIZE
    from rloo.forward import BLOCK_MASK_ATTENTION

    _, flops, bandwidth = peak
    phases = result["phase_seconds"]
    batch = preset.prompts * preset.k
    gen_s = phases.get("generation", 0.0)
    gen_tps = result["generated_tokens"] / gen_s if gen_s else float("nan")
    hidden, layers, vocab = preset.hidden, preset.layers, preset.vocab or VOCAB_SIZE
    prompt_tokens = result["prompt_tokens_per_completion"]
    # older result files have no padded width: the mean prompt length stands in (a lower bound)
    width = result.get("prompt_width", prompt_tokens)
    if width != width:  # NaN: no rollout recorded one
        width = prompt_tokens
    trainer = result.get("trainer", "trl" if "logprobs+scoring" in phases else "ours")
    dims = (layers, preset.num_kv_heads, preset.head_dim)
    # the least a decode step must read: bf16 weights, each prompt's KV once per group (prefix sharing),
    # each row's own response KV so far
    ideal_bytes = shared_prefix_decode_bytes(
        weight_bytes=WEIGHT_READ_BYTES["bf16"] * matmul_params,
        kv_bytes_per_token=kv_bytes_per_token(*dims),
        prompts=preset.prompts,
        prompt=prompt_tokens,
        k=preset.k,
        length=preset.length,
    )
    ideal = batch * bandwidth / ideal_bytes
    # what it reads as run: the weights as the generator holds them, the cache as allocated
    weights, cache = result.get("decode_weights", "fp32-autocast"), result.get("decode_cache", "dynamic")
    layout = result.get("kv_cache_layout")
    if layout:  # measured: the static cache's allocated positions and its bytes per element
        context, kv_bytes = float(layout[0]), element_read_bytes(float(layout[1]))
    else:
        context = decode_context(cache, width, preset.length, static_cache_bucket())
        kv_bytes = kv_read_bytes(weights, cache)
    as_read = decode_bandwidth_bound(
        weight_bytes=WEIGHT_READ_BYTES[weights] * matmul_params,
        kv_bytes_per_token=kv_bytes_per_token(*dims, kv_bytes),
        batch=batch,
        mean_context=context,
        bandwidth=bandwidth,
    )
    opt_s = phases.get("optimization", 0.0)
    shape = {
        "k": preset.k,
        "width": round(width),
        "length": preset.length,
        "body_params": max(matmul_params - hidden * vocab, 0),
        "hidden": hidden,
        "layers": layers,
        "vocab": vocab,
    }
    # what lays out ours' forwards (see forward_layout); result files from before: neither option, and
    # the bench's models' attention (sdpa) where the run did not record it
    options = {
        "torch_compile": bool(result.get("torch_compile")),
        "gradient_checkpointing": bool(result.get("gradient_checkpointing")),
        "block_mask": result.get("attn_implementation", "sdpa") in BLOCK_MASK_ATTENTION,
    }
    # the run's own micro-batch when it set a number; "auto" (resolved inside the trainer) counts as the
    # preset's, which the FLOPs depend on only through which micro-batches share their prompts
    micro_batch = result.get("micro_batch")
    if not isinstance(micro_batch, int) or isinstance(micro_batch, bool):
        micro_batch = preset.micro_batch
    executed = result["rollouts"] * training_flops_executed(
        trainer, batch=batch, micro_batch=micro_batch, **options, **shape
    )
    needed_shape = {key: shape[key] for key in ("k", "length", "body_params", "hidden", "layers", "vocab")}
    needed = result["rollouts"] * training_flops_needed(batch=batch, prompt=prompt_tokens, **needed_shape)
    logprobs_s = phases.get("logprobs", 0.0)
    logprobs_mfu = float("nan")  # TRL times its reference forward together with the scoring
    if trainer == "ours" and logprobs_s > 0 and flops > 0:
        logprob_flops = result["rollouts"] * logprob_flops_executed(
            batch=batch,
            chunk=result.get("logprob_chunk", batch),
            old_logprobs=result.get("old_logprobs_forward", False),
            **options,
            **shape,
        )
        logprobs_mfu = logprob_flops / logprobs_s / flops
    # ours times the two separately, TRL's rollout holds both
    scoring_s = phases.get("logprobs+scoring", phases.get("logprobs", 0.0) + phases.get("scoring", 0.0))
    return {
        "episodes_per_s": result["episodes"] / result["seconds"],
        "steady_episodes_per_s": steady_episodes_per_s(result, batch),
        "generation_tokens_per_s": gen_tps,
        "generation_fraction_of_bandwidth_bound": gen_tps / ideal,
        "generation_fraction_of_read_bound": gen_tps / as_read,
        # the reference forward reads every prompt + completion token once per rollout
        "logprobs_scoring_tokens_per_s": result["train_tokens"] / scoring_s if scoring_s else float("nan"),
        "training_tokens_per_s": result["train_tokens"] / opt_s if opt_s else float("nan"),
        # JSON only: 6 N per token, each prompt counted once per completion (what TRL's rows would cost)
        "training_mfu_nominal": training_mfu(matmul_params, result["train_tokens"], opt_s, flops),
        "training_mfu_needed": needed / opt_s / flops if opt_s > 0 and flops > 0 else float("nan"),
        "training_mfu_executed": executed / opt_s / flops if opt_s > 0 and flops > 0 else float("nan"),
        # JSON only (not a table row): the no-grad log-prob forwards over ours' log-probs phase
        "logprobs_mfu_executed": logprobs_mfu,
        "peak_memory_gib": result["peak_memory_bytes"] / GIB,
        # whether the compiled decode replayed as CUDA graphs (absent: TRL, or a run before the counters)
        "dynamo_unique_graphs": float(result.get("dynamo", {}).get("unique_graphs", float("nan"))),
        "cudagraph_skips": float(result.get("dynamo", {}).get("cudagraph_skips", float("nan"))),
    }


ROWS = (
    ("episodes_per_s", "episodes/s", "{:.1f}"),
    ("steady_episodes_per_s", "episodes/s, steady (median update after the 2nd, wall clock)", "{:.1f}"),
    ("generation_tokens_per_s", "generation tokens/s", "{:,.0f}"),
    (
        "generation_fraction_of_bandwidth_bound",
        "generation / bound, ideal (bf16 weights, prompt KV once per group)",
        "{:.0%}",
    ),
    (
        "generation_fraction_of_read_bound",
        "generation / bound, bytes as read (weights as held, KV as allocated)",
        "{:.0%}",
    ),
    ("logprobs_scoring_tokens_per_s", "log-probs + scoring tokens/s", "{:,.0f}"),
    ("training_tokens_per_s", "training tokens/s", "{:,.0f}"),
    ("training_mfu_needed", "training MFU, FLOPs needed (each prompt once per group)", "{:.0%}"),
    ("training_mfu_executed", "training MFU, FLOPs executed", "{:.0%}"),
    ("peak_memory_gib", "peak memory (GiB)", "{:.1f}"),
    ("dynamo_unique_graphs", "compiled graphs (torch._dynamo unique_graphs)", "{:.0f}"),
    ("cudagraph_skips", "CUDA-graph fallbacks (inductor cudagraph_skips; 0 = replayed)", "{:.0f}"),
)
TARGETS = {
    "episodes_per_s": ">= 2x TRL",
    "generation_fraction_of_bandwidth_bound": ">= 50%",
    "training_mfu_needed": ">= 40% at 1.5B",
}


FOOTNOTE = (
    "MFU needed: the FLOPs the update needs, the same for every trainer: 3 x (2 N_body per position + 4 "
    "layers hidden per attended key + 2 hidden V per response logit) with each prompt once per group. "
    "Executed: the FLOPs run, 3 x (2 N_body per position + 4 layers hidden per attended key + 2 hidden V per "
    "kept logit), the layers' terms 4 x under gradient checkpointing: ours runs packed rows (each prompt once "
    "per group in a micro-batch when rloo.forward shares it; always under --torch-compile, 64-column "
    "multiples), the masked attention over each row's whole square; TRL every row with its prompt, causal; "
    "logits only at response positions in both. Bounds: batch x bandwidth / (weight bytes + "
    "KV bytes) per decode step; ideal = bf16 weights + each prompt's KV once per group + each row's response "
    "KV so far, as read = fp32-under-autocast weights 8 B a "
    "parameter (bf16 copy 2 B) + a static cache read whole."
)


# why a setting may differ between the two trainers' runs (the table names every one that does)
SETTING_REASONS = {
    "decode": "the decode path is part of what is compared: TRL 1.x's generate has no static cache",
    "micro-batch": "--micro-batch gave ours the trainer's own --micro_batch_size",
    "gradient checkpointing": "TRL's default is on; bench_vs_trl.trl_config turns it off as ours",
}


def trainer_label(trainer: str, raw: dict[str, Any] | None = None) -> str:
    """A column's name: "rloo", or TRL with the version that ran and its generation backend."""
    if trainer != "trl":
        return LABELS[trainer]
    version = (raw or {}).get("trl_version", "?")
    return f"TRL {version}, use_vllm=False"


def settings_differences(ours: dict[str, Any], trl: dict[str, Any]) -> list[str]:
    """One line per setting the two runs did not share, with why ("" when they match)."""
    a, b = ours.get("settings", {}), trl.get("settings", {})
    lines = []
    for key in sorted(set(a) | set(b)):
        if a.get(key) != b.get(key):
            why = SETTING_REASONS.get(key, "not matched: see bench_gpu.py")
            lines.append(f"{key}: ours {a.get(key, '?')}, TRL {b.get(key, '?')} ({why})")
    return lines


def render_table(
    results: dict[str, dict[str, dict[str, float]]],
    sizes: list[str],
    raw: dict[str, dict[str, Any]] | None = None,
) -> str:
    """One markdown table: a row per figure, a column per (size, trainer), then the target; below it the
    ours / TRL ratios and the settings the two runs did not share."""
    raw = raw or {}
    cols = [(s, t) for s in sizes for t in TRAINERS if t in results.get(s, {})]
    labels = [trainer_label(t, raw.get(s, {}).get(t)) for s, t in cols]
    head = ["figure", *[f"{s.upper()} {label}" for (s, _), label in zip(cols, labels, strict=True)], "target"]
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
    for s in sizes:
        runs = raw.get(s, {})
        if {"ours", "trl"} <= set(runs):
            for line in settings_differences(runs["ours"], runs["trl"]):
                lines.append(f"- {s.upper()} settings differ: {line}")
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
            f"  {s}: {pr.arch} hidden {pr.hidden} x {pr.layers} layers, {pr.heads} heads "
            f"({pr.num_kv_heads} key/value), MLP {pr.mlp_size}, {counts[s][0] / 1e6:.0f}M params; "
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
                "torch_compile": args.torch_compile,
                "micro_batch_size": args.micro_batch,
                "seed": args.seed,
                "lr": args.lr,
                "beta": args.beta,
            }
            for t in trainers:
                print(f"[{s}] {trainer_label(t)} ...", file=sys.stderr, flush=True)
                r = run_one(t, spec, root / "runs" / f"{s}-{t}")
                raw.setdefault(s, {})[t] = r
                results.setdefault(s, {})[t] = figures(r, pr, counts[s][1], peak)
                print(f"    {results[s][t]['episodes_per_s']:.1f} episodes/s", file=sys.stderr)
                if args.json:  # after every run, so that a run cut short still leaves what it measured
                    _write_json(args.json, name, peak, raw, results)
    finally:
        if args.workdir is None:
            shutil.rmtree(root, ignore_errors=True)
    print(render_table(results, args.sizes, raw))
    print()
    print(FOOTNOTE)
    if args.json:
        _write_json(args.json, name, peak, raw, results)
    return 0


def _write_json(path: Path, gpu: str, peak: Any, raw: dict[str, Any], results: dict[str, Any]) -> None:
    path.write_text(json.dumps({"gpu": gpu, "peak": peak, "raw": raw, "figures": results}, indent=2))


if __name__ == "__main__":
    sys.exit(main())
