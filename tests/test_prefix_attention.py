"""Shared-prefix decode attention: the prompt's KV held once per group of K, merged by log-sum-exp."""

from __future__ import annotations

import pytest
import torch

from rloo import prefix_attention
from rloo.generation import SamplingParams, TransformersGenerator, left_pad, row_seeds
from rloo.models import load_causal_lm, load_tokenizer

PROMPTS = ["Write about the sea:", "Hi", "Tell me a long story about a cat and the wind:"]


def _reference(query, rk, rv, pk, pv, pmask, k, scaling):
    """Today's layout: the prompt KV repeated K times, concatenated with each row's response KV, one SDPA."""
    g = query.size(1) // pk.size(1)
    keys = torch.cat([pk.repeat_interleave(k, 0), rk], dim=2).repeat_interleave(g, 1)  # (B, Hq, L+t, d)
    values = torch.cat([pv.repeat_interleave(k, 0), rv], dim=2).repeat_interleave(g, 1)
    mask = torch.cat([pmask.repeat_interleave(k, 0), torch.ones(rk.size(0), rk.size(2), dtype=torch.bool)], 1)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, keys, values, attn_mask=mask[:, None, None, :], scale=scaling
    )  # (B, Hq, 1, d)
    return out.transpose(1, 2)  # (B, 1, Hq, d)


@pytest.mark.parametrize(("k", "hkv", "g"), [(1, 2, 1), (3, 2, 2), (4, 1, 4)])
def test_two_part_attention_equals_attention_over_the_repeated_cache(k: int, hkv: int, g: int) -> None:
    gen = torch.Generator().manual_seed(k * 10 + g)
    p, length, t, d = 3, 7, 5, 8
    pk, pv = (torch.randn(p, hkv, length, d, generator=gen) for _ in range(2))
    rk, rv = (torch.randn(p * k, hkv, t, d, generator=gen) for _ in range(2))
    query = torch.randn(p * k, hkv * g, 1, d, generator=gen)
    pmask = torch.ones(p, length, dtype=torch.bool)
    pmask[1, :4] = False  # left padding of different widths
    pmask[2, :1] = False
    pk[1, :, :4] = 1e3  # padded keys that would dominate were they not masked
    got = prefix_attention.shared_prefix_attention(query, rk, rv, pk, pv, pmask, k, d**-0.5)
    want = _reference(query, rk, rv, pk, pv, pmask, k, d**-0.5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_a_prompt_with_no_token_attends_to_its_response_only() -> None:
    p, k, h, length, t, d = 2, 2, 1, 4, 3, 8
    pk, pv = torch.randn(p, h, length, d), torch.randn(p, h, length, d)
    rk, rv = torch.randn(p * k, h, t, d), torch.randn(p * k, h, t, d)
    query = torch.randn(p * k, h, 1, d)
    pmask = torch.ones(p, length, dtype=torch.bool)
    pmask[0] = False
    got = prefix_attention.shared_prefix_attention(query, rk, rv, pk, pv, pmask, k, d**-0.5)
    alone = torch.nn.functional.scaled_dot_product_attention(query[:k], rk[:k], rv[:k], scale=d**-0.5)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got[:k], alone.transpose(1, 2), atol=1e-6, rtol=1e-5)


@pytest.fixture(scope="module", params=[("qwen2", 4), ("llama", 2), ("gpt_neox", None)])
def family_lm(request, tmp_path_factory):
    from rloo.demo.tiny import build_causal_lm, build_tokenizer

    arch, kv_heads = request.param
    root = tmp_path_factory.mktemp(f"prefix-{arch}")
    build_tokenizer(root / "tok")
    # llama with 2 key/value heads for 4 query heads: grouped-query attention
    path = build_causal_lm(root / "lm", root / "tok", arch=arch, seed=4, num_key_value_heads=kv_heads)
    tok = load_tokenizer(str(path))
    return arch, tok, load_causal_lm(str(path), flag="model_name_or_path").eval()


def _spy_shared_steps(monkeypatch) -> list[int]:
    """How many shared-prefix attention calls run, and with the repeated cache forced where asked."""
    calls: list[int] = []
    attend = prefix_attention.shared_prefix_attention

    def spy(*args, **kwargs):
        calls.append(1)
        return attend(*args, **kwargs)

    monkeypatch.setattr(prefix_attention, "shared_prefix_attention", spy)
    return calls


def _generate(model, tok, k: int, params: SamplingParams, *, shared: bool, monkeypatch, **kw):
    ids, mask = left_pad([tok(p)["input_ids"] for p in PROMPTS], tok.pad_token_id)
    seeds = row_seeds(3, 1, torch.arange(3), k)
    with monkeypatch.context() as m:
        if not shared:
            m.setattr(prefix_attention, "supports", lambda model, k: False)
        return TransformersGenerator(model, batch_size=64, **kw).generate(
            ids, mask, k, params, seeds, return_logprobs=True
        )


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("mode", ["greedy", "sampled", "stop"])
def test_shared_prefix_decode_samples_what_the_repeated_cache_samples(
    family_lm, attn: str, k: int, mode: str, monkeypatch
) -> None:
    arch, tok, model = family_lm
    model.config._attn_implementation = attn
    params = SamplingParams(
        max_new_tokens=16, temperature=0.9, pad_token_id=tok.pad_token_id, greedy=mode == "greedy"
    )
    if mode == "stop":  # a token sampled early in some row becomes the stop token
        free = _generate(model, tok, k, params, shared=False, monkeypatch=monkeypatch).tokens
        params = SamplingParams(**{**params.__dict__, "stop_token_id": int(free[-1, 2])})
    repeated = _generate(model, tok, k, params, shared=False, monkeypatch=monkeypatch)
    calls = _spy_shared_steps(monkeypatch)
    shared = _generate(model, tok, k, params, shared=True, monkeypatch=monkeypatch)
    assert torch.equal(shared.tokens, repeated.tokens)
    torch.testing.assert_close(shared.logprobs, repeated.logprobs, atol=1e-5, rtol=1e-5)
    # the shared path ran exactly where it applies: K > 1 and a family whose layers use the interface
    applies = k > 1 and arch in ("qwen2", "llama")
    assert bool(calls) == applies
    assert model.config._attn_implementation == attn  # restored after the decode
    if mode == "stop" and params.stop_token_id is not None:
        for row in shared.tokens:
            hits = (row == params.stop_token_id).nonzero()
            if hits.numel():
                assert (row[int(hits[0]) + 1 :] == params.pad_token_id).all()


def test_other_forwards_of_the_model_are_unchanged_while_decoding_shared(family_lm) -> None:
    # A forward that is not a shared-prefix decode step (the training forward, were it to run meanwhile)
    # must go through the model's own attention and masks.
    arch, tok, model = family_lm
    if arch not in prefix_attention.SUPPORTED_MODEL_TYPES:
        pytest.skip("the family keeps the repeated cache")
    model.config._attn_implementation = "sdpa"
    ids, mask = left_pad([tok(p)["input_ids"] for p in PROMPTS], tok.pad_token_id)
    with torch.no_grad():
        before = model(input_ids=ids, attention_mask=mask).logits
        with prefix_attention.attending_shared_prefix(model):
            assert model.config._attn_implementation != "sdpa"
            during = model(input_ids=ids, attention_mask=mask).logits
    assert model.config._attn_implementation == "sdpa"
    torch.testing.assert_close(during, before, atol=0, rtol=0)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_describe_says_which_decode_path_runs(family_lm, cache: str) -> None:
    arch, _, model = family_lm
    text = TransformersGenerator(model, batch_size=8, cache_implementation=cache).describe()
    assert ("held once" in text) == (arch in prefix_attention.SUPPORTED_MODEL_TYPES)
    assert ("repeated" in text) == (arch not in prefix_attention.SUPPORTED_MODEL_TYPES)
    assert f"a {cache} KV cache" in text


@pytest.mark.parametrize("whole_step", [True, False])
@pytest.mark.parametrize("mode", ["greedy", "sampled", "stop"])
def test_static_shared_prefix_decode_samples_what_the_repeated_static_cache_samples(
    family_lm, whole_step: bool, mode: str, monkeypatch
) -> None:
    # The fixed-shape variant (prompt part once per group in buffers rounded up to CACHE_BUCKET slots,
    # response slots opened by a device counter) against the repeated static cache: same tokens.
    arch, tok, model = family_lm
    model.config._attn_implementation = "sdpa"
    kw = {"cache_implementation": "static", "whole_step": whole_step}
    params = SamplingParams(
        max_new_tokens=20, temperature=0.9, pad_token_id=tok.pad_token_id, greedy=mode == "greedy"
    )
    if mode == "stop":
        free = _generate(model, tok, 3, params, shared=False, monkeypatch=monkeypatch, **kw).tokens
        params = SamplingParams(**{**params.__dict__, "stop_token_id": int(free[-1, 2])})
    repeated = _generate(model, tok, 3, params, shared=False, monkeypatch=monkeypatch, **kw)
    calls = _spy_shared_steps(monkeypatch)
    shared = _generate(model, tok, 3, params, shared=True, monkeypatch=monkeypatch, **kw)
    assert torch.equal(shared.tokens, repeated.tokens)
    torch.testing.assert_close(shared.logprobs, repeated.logprobs, atol=1e-5, rtol=1e-5)
    assert bool(calls) == (arch in prefix_attention.SUPPORTED_MODEL_TYPES)


def test_compiled_static_shared_prefix_decode_replays_for_another_prompt_width(family_lm) -> None:
    from torch._dynamo.utils import counters

    from tests.fixtures.decode import spy_static_buffers

    arch, tok, model = family_lm
    if arch not in prefix_attention.SUPPORTED_MODEL_TYPES:
        pytest.skip("the family keeps the repeated cache")
    model.config._attn_implementation = "sdpa"
    params = SamplingParams(max_new_tokens=10, temperature=1.0, pad_token_id=tok.pad_token_id)
    seeds = row_seeds(1, 0, torch.arange(3), 4)
    longer = left_pad([tok(p)["input_ids"] for p in PROMPTS], tok.pad_token_id)
    short = left_pad([tok(p)["input_ids"] for p in ["Hi", "Hello", "Hi"]], tok.pad_token_id)
    gen = TransformersGenerator(model, batch_size=64, cache_implementation="static", compile_decode=True)
    made = spy_static_buffers(gen)
    gen.generate(*short, 4, params, seeds, return_logprobs=True)
    graphs = counters["stats"]["unique_graphs"]
    compiled = gen.generate(*longer, 4, params, seeds, return_logprobs=True)
    assert counters["stats"]["unique_graphs"] == graphs  # replayed, not traced again
    assert made[0] is made[1] and made[0].shared
    # the prompt part once per prompt: P rows, not P*K
    assert made[0].cache.prompt_keys[0].size(0) == 3
    eager = TransformersGenerator(model, batch_size=64).generate(
        *longer, 4, params, seeds, return_logprobs=True
    )
    assert torch.equal(compiled.tokens, eager.tokens)
    torch.testing.assert_close(compiled.logprobs, eager.logprobs, atol=1e-5, rtol=1e-5)


def test_shared_prefix_samples_do_not_depend_on_batching(family_lm) -> None:
    # Each prompt alone (its own padding width, its own batch) samples what it samples among the others.
    _, tok, model = family_lm
    model.config._attn_implementation = "sdpa"
    ids = [tok(p)["input_ids"] for p in PROMPTS]
    params = SamplingParams(max_new_tokens=12, temperature=1.0, pad_token_id=tok.pad_token_id)
    seeds = row_seeds(7, 2, torch.tensor([10, 11, 12]), 3)  # (9,)
    together = TransformersGenerator(model, batch_size=64).generate(
        *left_pad(ids, tok.pad_token_id), 3, params, seeds
    )
    alone = [
        TransformersGenerator(model, batch_size=3)
        .generate(*left_pad([ids[i]], tok.pad_token_id), 3, params, seeds[3 * i : 3 * i + 3])
        .tokens
        for i in range(3)
    ]
    assert torch.equal(together.tokens, torch.cat(alone))
    assert len({tuple(r.tolist()) for r in together.tokens[:3]}) > 1  # and the K samples differ
