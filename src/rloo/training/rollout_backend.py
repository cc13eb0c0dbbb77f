"""The rollout generator a run asks for: the built-in one, a vLLM engine in each process, or a vLLM server."""

from __future__ import annotations

from typing import Any

from rloo.generation import GenerationSettings, Generator
from rloo.training.vllm_backend import make_generator
from rloo.training.vllm_server import make_server_generator


def make_rollout_generator(
    settings: GenerationSettings,
    model: Any,
    *,
    accelerator: Any,
    batch_size: int,
    autocast: Any,
    max_model_len: int,
    max_num_seqs: int,
) -> Generator:
    """``settings``' backend for the prepared policy ``model``: a server (``--vllm_mode server``, checked
    against the longest prompt plus the response, ``max_model_len``), else ``make_generator``'s choice
    (``batch_size`` completions per built-in sampling batch; an engine sized by ``max_model_len`` and
    ``max_num_seqs``)."""
    if settings.use_vllm and settings.vllm_server_url is not None:
        return make_server_generator(settings, model, accelerator=accelerator, max_model_len=max_model_len)
    return make_generator(
        settings,
        model,
        accelerator=accelerator,
        batch_size=batch_size,
        autocast=autocast,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
    )
