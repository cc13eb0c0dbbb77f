from __future__ import annotations

import pytest
import torch

from rloo.algo import policy_loss, selective_log_softmax
from rloo.algo.choices import LOSS_AGG_MODES, LOSS_TYPES
from rloo.demo.tiny import build_tiny_setup
from rloo.forward import response_logits
from rloo.generation import left_pad
from rloo.models import load_causal_lm, load_tokenizer
from rloo.training.compile import decoder_layers
from rloo.training.completion_logprobs import LogProbs
from rloo.training.trainer import enable_activation_checkpointing
from tests.fixtures.logprob_inputs import Completions, NoAutocast

# "a" is one token: left-padded beside the others, all of its row but the last column is padding, which
# the shared path's prefill (every prompt token but the last) sees as a row with nothing to attend to.
PROMPTS = ["Write about the sea:", "Hi", "Tell me a long story about a cat and the wind:", "a"]


@pytest.mark.parametrize("arch", ["gpt_neox", "llama", "qwen2"])
def test_kv_cache_sharing_equals_full_rows_values_and_gradients(tmp_path, arch: str) -> None:
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
        logits = response_logits(
            model, ids, mask, rows, responses, share_prefix=share, packed=False
        )  # (8, 6, V)
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
        b = response_logits(model, ids, mask, rows, responses, share_prefix=True, packed=False)
        c = response_logits(model, ids, mask, rows, responses, share_prefix=True, packed=True)
    assert b.shape[:2] == c.shape[:2] == (4, 1)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(a, c, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_auto_sharing_follows_the_token_count(tmp_path, attn: str) -> None:
    # auto mode must pick the cheaper plan; where the attention takes a 4D mask, sharing is one packed
    # call: one row (the prompt once, then the 4 responses but their last token), a 4D mask
    setup = build_tiny_setup(tmp_path)
    tok = load_tokenizer(str(setup.policy))
    model = load_causal_lm(str(setup.policy), flag="model_name_or_path", attn_implementation=attn).eval()
    calls: list[tuple[int, int, int]] = []

    def seen(m, a, kw, out) -> None:
        calls.append((kw["input_ids"].size(0), kw["input_ids"].size(1), kw["attention_mask"].dim()))

    model.register_forward_hook(seen, with_kwargs=True)
    long_prompt = " ".join(["the sea and the moon"] * 30)
    ids, mask = left_pad([tok(long_prompt)["input_ids"]], tok.pad_token_id)  # L ~ 150
    rows = torch.zeros(4, dtype=torch.long)
    with torch.no_grad():
        # 1 prompt x 150 + 4 x 3 tokens << 4 x 153: shared -> one packed row of L + 4 x 2 columns
        response_logits(model, ids, mask, rows, torch.randint(0, 500, (4, 3)))
        assert calls == [(1, ids.size(1) + 4 * 2, 4)]
        calls.clear()
        # the same through the KV cache: two calls (prompt, then responses), 2D masks
        response_logits(model, ids, mask, rows, torch.randint(0, 500, (4, 3)), packed=False)
        assert [(r, d) for r, _, d in calls] == [(1, 2), (4, 2)]
        calls.clear()
        # long responses after a short prompt: sharing would save little -> one plain call, 2D mask
        short, smask = left_pad([tok("Hi")["input_ids"]], tok.pad_token_id)
        response_logits(model, short, smask, torch.zeros(2, dtype=torch.long), torch.randint(0, 500, (2, 40)))
        assert [(r, d) for r, _, d in calls] == [(2, 2)]


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
    for packed in (False, True):
        with torch.no_grad():
            bare = response_logits(model, ids, mask, rows, responses, share_prefix=True, packed=packed)
            wrapped = response_logits(
                _EngineLike(model), ids, mask, rows, responses, share_prefix=True, packed=packed
            )
        torch.testing.assert_close(wrapped, bare)


# ----------------------------------------------------------------------------------------------------
# packed rows: the prompt once per group, the responses back to back under a block mask


def _prompts_and_responses(tok, *, k: int = 3, t: int = 7, seed: int = 0):
    """PROMPTS left-padded (different lengths, one of a single token), K responses each in whole groups
    listed out of order, each response padded after a stop token at a random place."""
    ids, mask = left_pad([tok(p)["input_ids"] for p in PROMPTS], tok.pad_token_id)
    g = torch.Generator().manual_seed(seed)
    rows = torch.arange(len(PROMPTS)).repeat_interleave(k)[torch.randperm(len(PROMPTS) * k, generator=g)]
    responses = torch.randint(5, len(tok), (rows.numel(), t), generator=g)  # (b, T)
    stop = torch.randint(1, t + 1, (rows.numel(), 1), generator=g)  # tokens up to the stop token
    loss_mask = torch.arange(t) < stop  # (b, T)
    responses = responses.masked_fill(~loss_mask, tok.pad_token_id)
    return ids, mask, rows, responses, loss_mask


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same_grads(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys() and want
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize(
    ("arch", "attn"), [("qwen2", "sdpa"), ("qwen2", "eager"), ("llama", "sdpa"), ("gpt_neox", "eager")]
)
@pytest.mark.parametrize("share", [True, False], ids=["per-prompt", "per-completion"])
def test_packed_rows_equal_plain_rows_values_and_gradients(
    tmp_path, arch: str, attn: str, share: bool
) -> None:
    setup = build_tiny_setup(tmp_path, arch=arch)
    tok = load_tokenizer(str(setup.policy))
    model = load_causal_lm(str(setup.policy), flag="model_name_or_path", attn_implementation=attn).train()
    ids, mask, rows, responses, _ = _prompts_and_responses(tok)
    rows = torch.cat([rows, torch.tensor([1])])  # one group of K + 1: slots of uneven groups padded
    responses = torch.cat([responses, responses[:1]])
    weights = torch.linspace(-1, 1, responses.size(1))  # both signs, like advantages

    def run(**how) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model.zero_grad()
        logits = response_logits(model, ids, mask, rows, responses, **how)  # (b, T, V)
        logp = torch.log_softmax(logits, -1).gather(-1, responses[..., None]).squeeze(-1)
        (logp * weights).sum().backward()
        return logits.detach(), _grads(model)

    plain, g_plain = run(share_prefix=False, packed=False)
    for multiple in (1, 64):  # compiled layers' width padding: more left padding, same values
        packed, g_packed = run(share_prefix=share, packed=True, width_multiple=multiple)
        assert packed.shape == plain.shape
        torch.testing.assert_close(packed, plain, atol=1e-5, rtol=1e-5)
        _assert_same_grads(g_packed, g_plain)


def test_packed_rows_run_each_prompt_once_and_the_output_layer_at_response_positions(tmp_path) -> None:
    setup = build_tiny_setup(tmp_path)
    tok = load_tokenizer(str(setup.policy))
    model = load_causal_lm(str(setup.policy), flag="model_name_or_path").eval()
    ids, mask, rows, responses, _ = _prompts_and_responses(tok, k=3, t=5)
    inputs: list[tuple[int, ...]] = []
    heads: list[tuple[int, ...]] = []
    model.register_forward_hook(
        lambda m, a, kw, out: inputs.append(tuple(kw["input_ids"].shape)), with_kwargs=True
    )
    model.get_output_embeddings().register_forward_hook(lambda m, a, out: heads.append(tuple(a[0].shape[:2])))
    with torch.no_grad():
        response_logits(model, ids, mask, rows, responses, share_prefix=True)
    # 4 rows of L + 3 x 4 columns: each prompt once, each response but its last token
    assert inputs == [(4, ids.size(1) + 3 * 4)]
    assert heads == [(12, 5)]  # the output layer at the (b, T) predicting positions only


def test_packed_mask_keeps_responses_apart(tmp_path) -> None:
    # A response's logits must not depend on the other responses of its row: change one response, the
    # logits of the others stay (up to float noise), its own change.
    setup = build_tiny_setup(tmp_path)
    tok = load_tokenizer(str(setup.policy))
    model = load_causal_lm(str(setup.policy), flag="model_name_or_path").eval()
    ids, mask, rows, responses, _ = _prompts_and_responses(tok, k=3, t=6)
    changed = responses.clone()
    changed[0, 1:] = (changed[0, 1:] + 7) % len(tok)
    with torch.no_grad():
        a = response_logits(model, ids, mask, rows, responses, share_prefix=True, packed=True)
        b = response_logits(model, ids, mask, rows, changed, share_prefix=True, packed=True)
    torch.testing.assert_close(a[1:], b[1:], atol=1e-6, rtol=1e-6)
    assert not torch.allclose(a[0, 2:], b[0, 2:])


def _policy_loss(logits, responses, old, advantages, loss_mask, agg: str, loss_type: str) -> torch.Tensor:
    logprobs = selective_log_softmax(logits, responses)  # (b, T)
    loss, _ = policy_loss(
        logprobs,
        old,
        advantages,
        loss_mask,
        0.2,
        loss_agg_mode=agg,
        max_response_length=responses.size(1),
        loss_type=loss_type,
    )
    return loss


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")  # PEFT's call
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_packed_loss_and_gradients_equal_plain_rows_for_every_loss(tmp_path, lora: bool) -> None:
    setup = build_tiny_setup(tmp_path, arch="qwen2")
    tok = load_tokenizer(str(setup.policy))
    model = load_causal_lm(str(setup.policy), flag="model_name_or_path").train()
    if lora:
        peft = pytest.importorskip("peft")
        config = peft.LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8, target_modules="all-linear")
        model = peft.get_peft_model(model, config)
        for n, p in model.named_parameters():  # LoRA B starts at zero: nudge it so its A gets a gradient
            if "lora_B" in n:
                torch.nn.init.normal_(p, std=0.1, generator=torch.Generator().manual_seed(1))
    ids, mask, rows, responses, loss_mask = _prompts_and_responses(tok, k=2, t=6)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        base = selective_log_softmax(
            response_logits(model, ids, mask, rows, responses, share_prefix=False), responses
        )
    old = base + 0.3 * torch.randn(base.shape, generator=g)  # ratios away from 1: some clip
    advantages = torch.randn(rows.numel(), generator=g)  # (b,)
    for agg in LOSS_AGG_MODES:
        for loss_type in LOSS_TYPES:
            results = []
            for packed in (False, True):
                model.zero_grad()
                logits = response_logits(
                    model, ids, mask, rows, responses, share_prefix=packed, packed=packed
                )
                loss = _policy_loss(logits, responses, old, advantages, loss_mask, agg, loss_type)
                loss.backward()
                results.append((loss.detach(), _grads(model)))
            (plain_loss, g_plain), (packed_loss, g_packed) = results
            assert torch.isfinite(plain_loss) and plain_loss != 0, (agg, loss_type)
            torch.testing.assert_close(
                packed_loss, plain_loss, atol=1e-5, rtol=1e-5, msg=f"{agg} {loss_type}"
            )
            _assert_same_grads(g_packed, g_plain)
            if lora:
                assert all("lora_" in n for n in g_plain) and len(g_plain) > 4


def test_packed_rows_under_activation_checkpointing(tmp_path) -> None:
    setup = build_tiny_setup(tmp_path, arch="qwen2")
    tok = load_tokenizer(str(setup.policy))
    model = load_causal_lm(str(setup.policy), flag="model_name_or_path").train()
    ids, mask, rows, responses, _ = _prompts_and_responses(tok)

    def run(packed: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model.zero_grad()
        logits = response_logits(model, ids, mask, rows, responses, share_prefix=packed, packed=packed)
        logp = selective_log_softmax(logits, responses)
        (logp * torch.linspace(-1, 1, responses.size(1))).sum().backward()
        return logits.detach(), _grads(model)

    plain, g_plain = run(False)
    enable_activation_checkpointing(model)
    checkpointed: list[int] = []
    layer = decoder_layers(model)[0]
    checkpoint = layer._gradient_checkpointing_func  # what transformers runs each layer's forward through

    def counting(*args, **kwargs):
        checkpointed.append(1)
        return checkpoint(*args, **kwargs)

    layer._gradient_checkpointing_func = counting
    packed, g_packed = run(True)
    assert checkpointed == [1]
    torch.testing.assert_close(packed, plain, atol=1e-5, rtol=1e-5)
    _assert_same_grads(g_packed, g_plain)


@pytest.mark.parametrize("cache_free", [False, True], ids=["cache-ok", "cache-free"])
def test_logprobs_share_prompts_through_packed_rows(tmp_path, cache_free: bool) -> None:
    # The producer's no-grad log-probs and the update's forward take packed rows (one model call with a
    # 4D mask) also for a policy that takes no KV cache (activation checkpointing, compiled layers), and
    # read the log-probs of plain rows.
    setup = build_tiny_setup(tmp_path, arch="qwen2")
    tok = load_tokenizer(str(setup.policy))
    model = load_causal_lm(str(setup.policy), flag="model_name_or_path").eval()
    long_prompts = [" ".join([p] * 8) for p in PROMPTS]
    ids, mask = left_pad([tok(p)["input_ids"] for p in long_prompts], tok.pad_token_id)
    rows = torch.arange(4).repeat_interleave(2)  # whole groups of K = 2
    responses = torch.randint(5, len(tok), (8, 4), generator=torch.Generator().manual_seed(0))
    ro = Completions(ids, mask, rows, responses)
    lp = LogProbs(NoAutocast(), model, temperature=0.7, cache_free=cache_free, rloo_k=2, chunk_size=4)
    masks: list[int] = []
    model.register_forward_hook(
        lambda m, a, kw, out: masks.append(kw["attention_mask"].dim()), with_kwargs=True
    )
    got = lp.batched(model, ro)  # (8, 4)
    assert masks == [4, 4]  # two chunks of 2 groups, each one packed call
    with torch.no_grad():
        logits = response_logits(model, ids, mask, rows, responses, share_prefix=False, packed=False)
    torch.testing.assert_close(
        got, selective_log_softmax(logits, responses, temperature=0.7), atol=1e-5, rtol=1e-5
    )
    model.train()
    masks.clear()
    logprobs, _ = lp.forward(model, ro, torch.arange(4), entropy=True)
    assert masks == [4] and logprobs.requires_grad
    torch.testing.assert_close(logprobs.detach(), got[:4], atol=1e-5, rtol=1e-5)
