from __future__ import annotations

import pytest
import torch

from rloo.demo.tiny import build_tiny_setup
from rloo.forward import response_logits
from rloo.generation import left_pad
from rloo.models import load_causal_lm, load_tokenizer

# "a" is one token: left-padded beside the others, all of its row but the last column is padding, which
# the shared path's prefill (every prompt token but the last) sees as a row with nothing to attend to.
PROMPTS = ["Write about the sea:", "Hi", "Tell me a long story about a cat and the wind:", "a"]


@pytest.mark.parametrize("arch", ["gpt_neox", "llama", "qwen2"])
def test_shared_prefix_equals_full_rows_values_and_gradients(tmp_path, arch: str) -> None:
    # Each prompt run once and its KV cache gathered to its completions must give the logits and the
    # parameter gradients of the plain forward over [prompt; response] rows (left padding included).
    setup = build_tiny_setup(tmp_path, arch=arch)
    tok = load_tokenizer(str(setup.policy))
    model = load_causal_lm(str(setup.policy), flag="model_name_or_path").train()
    ids, mask = left_pad([tok(p)["input_ids"] for p in PROMPTS], tok.pad_token_id)
    rows = torch.tensor([2, 0, 0, 1, 2, 3, 1, 2])  # unsorted, uneven group sizes
    responses = torch.randint(0, len(tok), (8, 6), generator=torch.Generator().manual_seed(0))

    def run(share: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model.zero_grad()
        logits = response_logits(model, ids, mask, rows, responses, share_prefix=share)  # (8, 6, V)
        logp = torch.log_softmax(logits, -1).gather(-1, responses[..., None]).squeeze(-1)
        (logp * torch.linspace(-1, 1, 6)).sum().backward()  # weights of both signs, like advantages
        return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    full, g_full = run(False)
    shared, g_shared = run(True)
    assert full.shape[:2] == (8, 6) and torch.isfinite(shared).all()
    torch.testing.assert_close(shared, full, atol=1e-5, rtol=1e-5)
    assert g_full.keys() == g_shared.keys() and g_full
    for name in g_full:
        torch.testing.assert_close(g_shared[name], g_full[name], atol=1e-5, rtol=1e-4)


def test_single_token_responses(tmp_path) -> None:
    setup = build_tiny_setup(tmp_path)
    tok = load_tokenizer(str(setup.policy))
    model = load_causal_lm(str(setup.policy), flag="model_name_or_path").eval()
    ids, mask = left_pad([tok(p)["input_ids"] for p in PROMPTS], tok.pad_token_id)
    rows, responses = torch.tensor([0, 1, 2, 2]), torch.tensor([[5], [6], [7], [8]])
    with torch.no_grad():
        a = response_logits(model, ids, mask, rows, responses, share_prefix=False)
        b = response_logits(model, ids, mask, rows, responses, share_prefix=True)
    assert b.shape[:2] == (4, 1)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_auto_sharing_follows_the_token_count(tmp_path) -> None:
    # auto mode must pick the cheaper plan and still return the same logits either way
    setup = build_tiny_setup(tmp_path)
    tok = load_tokenizer(str(setup.policy))
    model = load_causal_lm(str(setup.policy), flag="model_name_or_path").eval()
    calls: list[int] = []
    model.register_forward_hook(lambda m, a, kw, out: calls.append(kw["input_ids"].size(1)), with_kwargs=True)
    long_prompt = " ".join(["the sea and the moon"] * 30)
    ids, mask = left_pad([tok(long_prompt)["input_ids"]], tok.pad_token_id)  # L ~ 150
    rows = torch.zeros(4, dtype=torch.long)
    with torch.no_grad():
        # 1 prompt x 150 + 4 x 3 tokens << 4 x 153: shared -> two calls (prompt, then responses)
        response_logits(model, ids, mask, rows, torch.randint(0, 500, (4, 3)))
        assert len(calls) == 2
        calls.clear()
        # long responses after a short prompt: sharing would save little -> one plain call
        short, smask = left_pad([tok("Hi")["input_ids"]], tok.pad_token_id)
        response_logits(model, short, smask, torch.zeros(2, dtype=torch.long), torch.randint(0, 500, (2, 40)))
        assert len(calls) == 1


def test_plain_rows_compute_the_output_layer_at_response_positions_only(tmp_path) -> None:
    # The output layer (hidden -> vocabulary) dominates the cost with a real vocabulary: a plain forward
    # over [prompt; response] must not run it on the L prompt positions, only on the T it needs (+1).
    setup = build_tiny_setup(tmp_path)
    tok = load_tokenizer(str(setup.policy))
    model = load_causal_lm(str(setup.policy), flag="model_name_or_path").eval()
    ids, mask = left_pad([tok(p)["input_ids"] for p in PROMPTS], tok.pad_token_id)
    rows, responses = torch.tensor([0, 1, 2]), torch.randint(0, 500, (3, 5))
    seen: list[int] = []
    model.get_output_embeddings().register_forward_hook(lambda m, a, out: seen.append(a[0].size(1)))
    with torch.no_grad():
        logits = response_logits(model, ids, mask, rows, responses, share_prefix=False)
        full = model(
            input_ids=torch.cat([ids[rows], responses], 1),
            attention_mask=torch.cat([mask[rows], torch.ones_like(responses)], 1),
            position_ids=(torch.cat([mask[rows], torch.ones_like(responses)], 1).cumsum(-1) - 1).clamp(min=0),
        ).logits
    assert seen[0] == 5 + 1  # T + 1 positions, not L + T
    torch.testing.assert_close(logits, full[:, ids.size(1) - 1 : -1], atol=1e-5, rtol=1e-5)


class _EngineLike(torch.nn.Module):
    """What the trainer holds under DeepSpeed: the model as ``.module`` and a ``config`` that is
    DeepSpeed's own dict, not the model's (the GPU run failed on exactly this)."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module
        self.config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2}}

    def forward(self, **kwargs):
        return self.module(**kwargs)


def test_shared_prefix_through_a_wrapper_whose_config_is_not_the_models(tmp_path) -> None:
    setup = build_tiny_setup(tmp_path)
    tok = load_tokenizer(str(setup.policy))
    model = load_causal_lm(str(setup.policy), flag="model_name_or_path").eval()
    ids, mask = left_pad([tok(p)["input_ids"] for p in PROMPTS], tok.pad_token_id)
    rows, responses = torch.tensor([0, 0, 1, 2, 3, 3]), torch.randint(0, len(tok), (6, 4))
    with torch.no_grad():
        bare = response_logits(model, ids, mask, rows, responses, share_prefix=True)
        wrapped = response_logits(_EngineLike(model), ids, mask, rows, responses, share_prefix=True)
    torch.testing.assert_close(wrapped, bare)
