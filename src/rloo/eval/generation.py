"""Generation backends for evaluation: vLLM offline batch inference, or transformers (CPU or GPU).

Both take the dataset's prompts (text, or chat messages formatted with each model's own chat template) and
return one completion text per prompt with the same sampling settings: greedy by default,
``max_new_tokens`` new tokens at most. Both tokenize the same way (:func:`prompt_token_ids`: no second BOS
after a chat template, over-long prompts keep their end) and decode the same way (:func:`_decode`); vLLM
gets token ids (``{"prompt_token_ids": ids}``), never text, so its own tokenizer settings play no part.
The vLLM engine is a thin shell around pure helpers (:func:`vllm_llm_kwargs`, :func:`vllm_sampling_kwargs`,
:func:`vllm_prompts`) so what it asks of vLLM is tested without a GPU, and against vLLM's real classes
where vLLM is installed.
"""

from __future__ import annotations

import gc
import logging
from pathlib import Path
from typing import Any, Protocol

import torch

from rloo.errors import UserError
from rloo.eval.config import EvalConfig
from rloo.vllm_support import CPU, CUDA, cpu_engine_kwargs, vllm_platform, why_vllm_cannot_run

log = logging.getLogger(__name__)


class GenerationEngine(Protocol):
    name: str

    def generate(
        self, model_path: str, prompts: list[Any], rows: list[dict[str, Any]] | None = None
    ) -> list[str]:
        """One completion per prompt, from the model at ``model_path`` (loaded, used, released); with agents,
        the whole episode, ``rows`` the dataset rows its environments are reset with."""
        ...


def resolve_engine(choice: str, *, vllm_platform: str | None, cuda: bool) -> str:
    """``auto`` picks vLLM when it can run here (its CUDA build and a GPU, or its CPU build), else
    transformers; ``vllm`` where it cannot is a one-line UserError."""
    why = why_vllm_cannot_run(
        vllm_platform, cuda=cuda, flag="--engine vllm", fallback="use --engine transformers"
    )
    if choice == "auto":
        return "transformers" if why else "vllm"
    if choice == "vllm" and why:
        raise UserError(why)
    return choice


def make_engine(cfg: EvalConfig) -> GenerationEngine:
    choice = "transformers" if cfg.agents and cfg.engine == "auto" else cfg.engine  # episodes: see EvalConfig
    name = resolve_engine(choice, vllm_platform=vllm_platform(), cuda=torch.cuda.is_available())
    return VLLMEngine(cfg) if name == "vllm" else TransformersEngine(cfg)


class TransformersEngine:
    """Batched KV-cached generation through :class:`rloo.generation.TransformersGenerator`."""

    name = "transformers"

    def __init__(self, cfg: EvalConfig, device: torch.device | None = None) -> None:
        self.cfg = cfg
        self.device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")

    def generate(
        self, model_path: str, prompts: list[Any], rows: list[dict[str, Any]] | None = None
    ) -> list[str]:
        from rloo.agents.episodes import episode_text, make_episode_runner
        from rloo.generation import SamplingParams, TransformersGenerator, left_pad
        from rloo.models import load_causal_lm, load_tokenizer, position_limit

        cfg = self.cfg
        flag = "baseline_model" if model_path == cfg.baseline_model else "model_name_or_path"
        model_path = full_model_dir(model_path, flag)
        tok = load_tokenizer(model_path, flag=flag, trust_remote_code=cfg.trust_remote_code)
        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        model = load_causal_lm(model_path, flag=flag, trust_remote_code=cfg.trust_remote_code, dtype=dtype)
        model.to(self.device).eval()
        episodes = make_episode_runner(tok, cfg, budget=cfg.max_new_tokens)  # None: single answers
        found = position_limit(model.config, tok)
        tools = episodes.schemas() if episodes is not None else None
        ids = prompt_token_ids(prompts, tok, found[0] if found else None, cfg.max_new_tokens, tools=tools)
        params = SamplingParams(
            max_new_tokens=cfg.max_new_tokens,
            temperature=cfg.temperature if cfg.temperature > 0 else 1.0,
            greedy=cfg.greedy,
            stop_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
        gen = TransformersGenerator(model, batch_size=cfg.generation_batch_size)
        texts: list[str] = []
        bs = cfg.generation_batch_size
        for start in range(0, len(ids), bs):
            batch = ids[start : start + bs]
            # per-prompt seeds from the dataset index: the same prompt samples the same way in any batch
            seeds = torch.arange(start, start + len(batch), device=self.device) + cfg.seed
            if episodes is not None:  # the judge reads the whole episode: turns and tool results
                out = episodes.run(
                    gen, batch, 1, params, seeds, return_logprobs=False, device=self.device,
                    prompts=prompts[start : start + bs], rows=(rows or [{} for _ in prompts])[start : start + bs],
                )  # fmt: skip
                texts.extend(episode_text(m) for m in out.episodes.messages)
                continue
            pids, pmask = left_pad(batch, tok.pad_token_id, self.device)
            tokens = gen.generate(pids, pmask, 1, params, seeds).tokens.cpu()
            texts.extend(_decode(tok, row.tolist()) for row in tokens)
        del model, gen
        release_memory()
        return texts


def prompt_token_ids(
    prompts: list[Any],
    tok: Any,
    max_len: int | None,
    max_new_tokens: int,
    *,
    tools: list[dict[str, Any]] | None = None,
) -> list[list[int]]:
    """Token ids of each prompt, as the policy saw them in training, cut to fit ``max_len`` with the answer.

    Chat prompts go through the chat template, which already holds the special tokens, so the tokenizer
    adds none (a second BOS otherwise). A prompt too long for the model keeps its last tokens, where the
    task is asked, rather than failing the whole batch.
    """
    from rloo.data import format_prompts, tokenize_prompts

    chat = bool(prompts) and isinstance(prompts[0], list)
    ids = tokenize_prompts(format_prompts(prompts, tok, tools=tools), tok, chat=chat)
    if max_len is not None:
        if max_len <= max_new_tokens:  # no room for even one prompt token: positions past the model's
            raise UserError(
                f"--max_new_tokens {max_new_tokens} leaves no room for a prompt: the model takes {max_len} "
                f"positions; use a max_new_tokens below {max_len}."
            )
        keep = max_len - max_new_tokens
        ids = [s[-keep:] for s in ids]
    return [list(s) for s in ids]


def _decode(tok: Any, ids: list[int]) -> str:
    if tok.eos_token_id in ids:
        ids = ids[: ids.index(tok.eos_token_id)]
    return tok.decode(ids, skip_special_tokens=True).strip()


def release_memory() -> None:
    """Give back what a released model held: Python's garbage, then CUDA's cache."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def vllm_llm_kwargs(
    cfg: EvalConfig,
    model_path: str,
    *,
    platform: str = CUDA,
    max_model_len: int | None = None,
    num_prompts: int = 1,
) -> dict[str, Any]:
    """Arguments of ``vllm.LLM`` for one model (each one a field of vLLM's ``EngineArgs``).

    On CPU the engine runs in float32, as the transformers engine does there (so both engines' greedy
    completions can be compared), holds at most ``num_prompts`` sequences (capped at 256), and gets an
    explicit KV cache sized for ``max_model_len`` (see :mod:`rloo.vllm_support`).
    """
    kw: dict[str, Any] = {
        "model": model_path,
        "tensor_parallel_size": cfg.vllm_tensor_parallel_size,
        "gpu_memory_utilization": cfg.vllm_gpu_memory_utilization,
        "trust_remote_code": cfg.trust_remote_code,
        "seed": cfg.seed,
    }
    if cfg.vllm_max_model_len is not None:
        kw["max_model_len"] = cfg.vllm_max_model_len
    if platform == CPU:
        seqs = max(1, min(num_prompts, 256))
        kw.update(dtype="float32", max_num_seqs=seqs)
        if max_model_len is not None:
            kw["max_model_len"] = max_model_len
            kw.update(
                cpu_engine_kwargs(
                    model_path=model_path,
                    dtype="float32",
                    max_model_len=max_model_len,
                    max_num_seqs=seqs,
                    fraction=cfg.vllm_gpu_memory_utilization,
                    flag="--vllm_gpu_memory_utilization",
                    trust_remote_code=cfg.trust_remote_code,
                )
            )
    return kw


def vllm_sampling_kwargs(cfg: EvalConfig) -> dict[str, Any]:
    """Arguments of ``vllm.SamplingParams``: the reference evaluation's ``temperature=0, max_tokens=200``.

    Token ids come back undecoded: they are decoded like the transformers engine's (:func:`_decode`).
    """
    return {
        "temperature": cfg.temperature,
        "max_tokens": cfg.max_new_tokens,
        "seed": cfg.seed,
        "detokenize": False,
    }


def vllm_prompts(ids: list[list[int]]) -> list[dict[str, list[int]]]:
    """Token-id prompts (vLLM's ``TokensPrompt``): vLLM neither re-tokenizes nor adds special tokens."""
    return [{"prompt_token_ids": list(s)} for s in ids]


def full_model_dir(model_path: str, flag: str) -> str:
    """What vLLM can load for ``model_path``: itself, or for a LoRA output (adapter only) the merged
    model beside it; a one-line error when there is none."""
    from rloo.models import ADAPTER_CONFIG, MERGED_SUBDIR

    path = Path(model_path)
    if not (path / ADAPTER_CONFIG).is_file() or (path / "config.json").is_file():
        return model_path
    if (path / MERGED_SUBDIR / "config.json").is_file():
        return str(path / MERGED_SUBDIR)
    raise UserError(
        f"--{flag} {model_path} is a LoRA adapter: the vLLM engine evaluates full models; train with "
        "--merge_adapter (and pass this directory) or evaluate with --engine transformers."
    )


def vllm_max_len(cfg: EvalConfig, model_path: str) -> int | None:
    """The sequence length vLLM will allow: ``--vllm_max_model_len``, else the model's context length."""
    if cfg.vllm_max_model_len is not None:
        return cfg.vllm_max_model_len
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path, trust_remote_code=cfg.trust_remote_code)
    config = getattr(config, "get_text_config", lambda: config)()
    return getattr(config, "max_position_embeddings", None)


class VLLMEngine:  # pragma: no cover - needs vLLM and a GPU; its arguments are tested through the helpers
    name = "vllm"

    def __init__(self, cfg: EvalConfig) -> None:
        self.cfg = cfg

    def generate(
        self, model_path: str, prompts: list[Any], rows: list[dict[str, Any]] | None = None
    ) -> list[str]:
        import os

        from rloo.models import check_safetensors_weights, load_tokenizer

        cfg = self.cfg
        flag = "baseline_model" if model_path == cfg.baseline_model else "model_name_or_path"
        model_path = full_model_dir(model_path, flag)
        tok = load_tokenizer(model_path, flag=flag, trust_remote_code=cfg.trust_remote_code)
        if Path(model_path).is_dir():  # vLLM loads the weights itself: check them as load_causal_lm does
            check_safetensors_weights(Path(model_path), flag=flag, shown=model_path)
        ids = prompt_token_ids(prompts, tok, vllm_max_len(cfg, model_path), cfg.max_new_tokens)
        # read by vLLM when the engine starts
        os.environ["VLLM_BATCH_INVARIANT"] = "1" if cfg.vllm_batch_invariant else "0"
        release_memory()  # vLLM sizes its budget from the free memory: release what the previous model left cached
        from vllm import LLM, SamplingParams

        platform = vllm_platform() or CUDA
        # on CPU the sequences are no longer than the longest prompt and its answer: the KV cache is sized
        # from that (the model's whole context would reserve RAM no request uses)
        longest = max(map(len, ids), default=0) + cfg.max_new_tokens
        llm = LLM(
            **vllm_llm_kwargs(
                cfg,
                model_path,
                platform=platform,
                max_model_len=cfg.vllm_max_model_len or longest,
                num_prompts=len(ids),
            )
        )
        try:
            outs = llm.generate(
                vllm_prompts(ids), SamplingParams(**vllm_sampling_kwargs(cfg)), use_tqdm=False
            )
            return [_decode(tok, list(o.outputs[0].token_ids)) for o in outs]
        finally:
            # two models are loaded one after the other in the same process: free the first one's memory
            del llm
            release_memory()
