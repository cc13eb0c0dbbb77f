"""What of the colocated vLLM engine only a CUDA GPU can show: sleep mode (``pytest -m gpu``).

vLLM's CPU build has no sleep mode (it refuses ``enable_sleep_mode`` and ignores sleep / wake_up), so the
round trip sleep level 2 -> wake -> reload_weights, where upstream once produced gibberish, runs on a GPU
only. Everything else of the engine runs on CPU in ``make test-vllm`` (tests/vllm_engine): weights pushed at every
update (1 and 2 processes, LoRA, resume), log-probs against the trainer's forward, eval, the judge server.
On a GPU machine with the train image's packages: ``pytest -m gpu tests/gpu``.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("vllm")

from rloo.demo.tiny import build_tiny_setup  # noqa: E402
from rloo.generation import SamplingParams, left_pad, row_seeds  # noqa: E402
from rloo.training import vllm_backend as vb  # noqa: E402


class _SingleProcess:
    """The accelerator attributes create_colocated_llm and named_weights use, for one process."""

    process_index = local_process_index = 0
    num_processes = 1
    state = SimpleNamespace(deepspeed_plugin=None)

    def wait_for_everyone(self) -> None:
        pass

    def unwrap_model(self, model: Any) -> Any:
        return model


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    setup = build_tiny_setup(tmp_path_factory.mktemp("tiny"), arch="llama")
    policy = AutoModelForCausalLM.from_pretrained(setup.policy, dtype=torch.float32).cuda().eval()
    tok = AutoTokenizer.from_pretrained(setup.policy)
    acc = _SingleProcess()
    llm = vb.create_colocated_llm(
        acc,
        model_path=str(setup.policy),
        gpu_memory_utilization=0.2,
        enable_sleep_mode=True,
        dtype="float32",
        seed=0,
        max_model_len=256,
        max_num_seqs=8,
    )
    gen = vb.VLLMGenerator(llm, policy, accelerator=acc, enable_sleep_mode=True)
    yield SimpleNamespace(gen=gen, policy=policy, tok=tok, path=Path(setup.policy))
    del llm


def _prompts(tok: Any) -> tuple[torch.Tensor, torch.Tensor]:
    ids = [tok(t)["input_ids"] for t in ("Write about the sea:", "A red fox and the moon", "Hello")]
    return left_pad(ids, tok.pad_token_id or 0, torch.device("cuda"))


def test_sleep_wake_push_generate_round_trip_is_identical(engine: Any) -> None:
    """Greedy outputs survive sleep level 2 -> wake -> reload_weights (the 'gibberish after sleep' bug)."""
    ids, mask = _prompts(engine.tok)
    params = SamplingParams(max_new_tokens=16, greedy=True, pad_token_id=engine.tok.pad_token_id or 0)
    seeds = row_seeds(0, 0, torch.arange(3), 2)
    first = engine.gen.generate(ids, mask, 2, params, seeds).tokens  # woke, pushed, generated, slept
    second = engine.gen.generate(ids, mask, 2, params, seeds).tokens
    assert torch.equal(first, second)
    # ... and a changed policy changes what the engine samples, then changing it back restores it
    with torch.no_grad():
        saved = [p.detach().clone() for p in engine.policy.parameters()]
        for p in engine.policy.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    moved = engine.gen.generate(ids, mask, 2, params, seeds).tokens
    with torch.no_grad():
        for p, s in zip(engine.policy.parameters(), saved, strict=True):
            p.copy_(s)
    assert not torch.equal(first, moved)
    assert torch.equal(first, engine.gen.generate(ids, mask, 2, params, seeds).tokens)
