"""The rollout copy's fused projections: one matmul for q/k/v and one for gate/up, the same model."""

from __future__ import annotations

import pytest
import torch

from rloo.generation import (
    SamplingParams,
    TransformersGenerator,
    left_pad,
    rollout_copy,
    row_seeds,
    sync_rollout_copy,
)
from rloo.models import load_causal_lm, load_tokenizer
from rloo.rollout_fusion import is_fused

PROMPTS = ["Write about the sea:", "Hi", "Tell me a long story about a cat and the wind:"]


@pytest.fixture(scope="module", params=[("qwen2", 4), ("llama", 2), ("gpt_neox", None)])
def family(request, tmp_path_factory):
    from rloo.demo.tiny import build_causal_lm, build_tokenizer

    arch, kv_heads = request.param
    root = tmp_path_factory.mktemp(f"fusion-{arch}")
    build_tokenizer(root / "tok")
    # qwen2 has q/k/v biases; llama none, and 2 key/value heads for 4 query heads
    path = build_causal_lm(root / "lm", root / "tok", arch=arch, seed=6, num_key_value_heads=kv_heads)
    return arch, path, load_tokenizer(str(path))


def _logits(model, tok) -> torch.Tensor:
    ids, mask = left_pad([tok(p)["input_ids"] for p in PROMPTS], tok.pad_token_id)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, position_ids=pos).logits  # (P, L, V)


def _fused_modules(model) -> int:
    return sum(is_fused(m) for m in model.modules())


def test_fused_copy_is_the_unfused_copy_before_and_after_a_sync(family) -> None:
    arch, path, tok = family
    policy = load_causal_lm(str(path), flag="model_name_or_path")
    fused = rollout_copy(policy, torch.float32)
    plain = rollout_copy(policy, torch.float32, fuse=False)
    layers = policy.config.num_hidden_layers
    # attention and MLP of every layer where the family is fusible; none elsewhere
    assert _fused_modules(fused) == (2 * layers if arch in ("qwen2", "llama") else 0)
    assert _fused_modules(plain) == 0
    # the same parameters, names and order as the policy's: sync_rollout_copy pairs them up by position
    assert [n for n, _ in fused.named_parameters()] == [n for n, _ in policy.named_parameters()]
    assert fused.state_dict().keys() == policy.state_dict().keys()
    torch.testing.assert_close(_logits(fused, tok), _logits(plain, tok), atol=1e-5, rtol=1e-5)

    opt = torch.optim.AdamW(policy.parameters(), lr=5e-2)
    policy(input_ids=torch.arange(1, 9)[None], labels=torch.arange(1, 9)[None]).loss.backward()
    opt.step()
    moved = _logits(policy, tok)
    assert not torch.allclose(_logits(fused, tok), moved, atol=1e-3)  # the step moved the policy only
    pointers = [p.data_ptr() for p in fused.parameters()]
    sync_rollout_copy(fused, policy)
    sync_rollout_copy(plain, policy)
    assert pointers == [p.data_ptr() for p in fused.parameters()]  # in place: recorded graphs stay valid
    torch.testing.assert_close(_logits(fused, tok), _logits(plain, tok), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(_logits(fused, tok), moved, atol=1e-5, rtol=1e-5)


def test_fused_projections_are_views_of_one_weight(family) -> None:
    arch, path, _ = family
    if arch == "gpt_neox":
        pytest.skip("not a fusible family")
    fused = rollout_copy(load_causal_lm(str(path), flag="model_name_or_path"), torch.bfloat16)
    attn = fused.model.layers[0].self_attn
    weight = attn.fused_qkv_weight  # ((Hq + 2 Hkv) d, hidden)
    assert weight.dtype == torch.bfloat16
    assert weight.size(0) == sum(getattr(attn, n).out_features for n in ("q_proj", "k_proj", "v_proj"))
    with torch.no_grad():
        attn.k_proj.weight.add_(1.0)  # a write through a projection's parameter is a write to the fused one
    start = attn.q_proj.out_features
    torch.testing.assert_close(weight[start : start + attn.k_proj.out_features], attn.k_proj.weight)


def test_a_fused_copy_samples_like_an_unfused_one(family) -> None:
    # The whole decode (shared-prefix attention where it applies) through the fused layers.
    _, path, tok = family
    policy = load_causal_lm(str(path), flag="model_name_or_path")
    ids, mask = left_pad([tok(p)["input_ids"] for p in PROMPTS], tok.pad_token_id)
    params = SamplingParams(max_new_tokens=12, temperature=1.0, pad_token_id=tok.pad_token_id)
    seeds = row_seeds(2, 0, torch.arange(3), 3)
    runs = [
        TransformersGenerator(rollout_copy(policy, torch.float32, fuse=fuse), batch_size=64).generate(
            ids, mask, 3, params, seeds, return_logprobs=True
        )
        for fuse in (True, False)
    ]
    assert torch.equal(runs[0].tokens, runs[1].tokens)
    torch.testing.assert_close(runs[0].logprobs, runs[1].logprobs, atol=1e-5, rtol=1e-5)
