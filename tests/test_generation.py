from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from rloo.demo.tiny import build_tiny_setup
from rloo.generation import (
    SamplingParams,
    TransformersGenerator,
    exponential_race,
    inverse_cdf_tokens,
    left_pad,
    race_uniforms,
    row_seeds,
    sample_tokens,
    uniforms,
)
from rloo.models import load_causal_lm, load_tokenizer
from tests.fixtures.decode import spy_static_buffers

PROBS = torch.tensor([[0.2, 0.5, 0.3]])  # cdf [0.2, 0.7, 1.0]


def _sample(u: float, **kw) -> int:
    return int(sample_tokens(PROBS.log(), torch.tensor([u], dtype=torch.float64), temperature=1.0, **kw)[0])


@pytest.mark.parametrize(("u", "token"), [(0.05, 0), (0.19, 0), (0.21, 1), (0.69, 1), (0.71, 2), (0.99, 2)])
def test_inverse_cdf_by_hand(u: float, token: int) -> None:
    # cdf = [0.2, 0.7, 1.0]: u < 0.2 -> 0, 0.2 <= u < 0.7 -> 1, else 2
    got = inverse_cdf_tokens(PROBS.log(), torch.tensor([u], dtype=torch.float64), top_k=0, top_p=1.0)
    assert int(got[0]) == token


def test_top_k_and_top_p_by_hand() -> None:
    # top_k=1 keeps only the 0.5 token whatever u is
    assert {_sample(u, top_k=1) for u in (0.01, 0.5, 0.99)} == {1}
    # top_p=0.5: sorted [0.5, 0.3, 0.2]; mass before 0.3 is 0.5 >= 0.5 -> dropped, only token 1 left
    assert {_sample(u, top_p=0.5) for u in (0.01, 0.5, 0.99)} == {1}
    # top_p=0.6: keep 0.5 and 0.3 -> renormalised [0, 0.625, 0.375], cdf [0, 0.625, 1.0]
    assert _sample(0.01, top_p=0.6) == 1
    assert _sample(0.6, top_p=0.6) == 1
    assert _sample(0.7, top_p=0.6) == 2


def _step_uniforms(rows: int, step: int = 0) -> torch.Tensor:
    return uniforms(row_seeds(seed=11, update=0, prompt_index=torch.arange(rows), k=1), step)  # (rows,)


def _race(logits: torch.Tensor, u: torch.Tensor, temperature: float) -> torch.Tensor:
    return exponential_race(logits.float() / temperature, u)


def _inverse_cdf(logits: torch.Tensor, u: torch.Tensor, temperature: float) -> torch.Tensor:
    return sample_tokens(logits, u, temperature=temperature)  # untruncated on a CPU: the inverse CDF


SAMPLERS = {"race": _race, "inverse_cdf": _inverse_cdf}


@pytest.mark.parametrize("sampler", SAMPLERS)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("vocab", [6, 50])
def test_each_sampler_draws_from_the_softmax(sampler: str, temperature: float, vocab: int) -> None:
    # Pearson's chi-square of the token counts of many rows (each its own seed) against the softmax at the
    # temperature: a wrong distribution (the temperature ignored, a biased hash) lands far above the
    # 0.999 quantile; this one draw (fixed seeds) is below it.
    from scipy.stats import chi2

    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(vocab)) * 2  # (V,)
    n = 40_000
    toks = SAMPLERS[sampler](logits.expand(n, vocab), _step_uniforms(n), temperature)  # (n,)
    expected = torch.softmax(logits.double() / temperature, -1) * n  # (V,)
    counts = torch.bincount(toks, minlength=vocab).double()
    stat = float(((counts - expected) ** 2 / expected).sum())
    assert stat < chi2.ppf(0.999, vocab - 1), stat
    # and at the other temperature the same counts are rejected: the test tells temperatures apart
    other = torch.softmax(logits.double() / (1.7 - temperature), -1) * n
    assert float(((counts - other) ** 2 / other).sum()) > chi2.ppf(0.999, vocab - 1)


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_each_sampler_is_reproducible_and_each_row_its_own(sampler: str) -> None:
    draw = SAMPLERS[sampler]
    logits = torch.randn(64, 1000, generator=torch.Generator().manual_seed(0))  # (B, V)
    u = _step_uniforms(64)
    toks = draw(logits, u, 0.7)
    assert torch.equal(toks, draw(logits, u, 0.7))  # same seeds, same tokens
    # a row's token does not depend on which other rows are in the batch, nor on their order
    some = torch.tensor([5, 0, 33])
    assert torch.equal(draw(logits[some], u[some], 0.7), toks[some])
    # another step draws other tokens
    assert not torch.equal(toks, draw(logits, _step_uniforms(64, step=1), 0.7))


def test_a_cpu_samples_by_inverse_cdf_where_the_race_would_run_eagerly() -> None:
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(1))  # (B, V)
    u = _step_uniforms(8)
    want = inverse_cdf_tokens(logits.float(), u, top_k=0, top_p=1.0)
    assert torch.equal(sample_tokens(logits, u, temperature=1.0), want)


def test_race_uniforms_are_uniform_and_independent_of_vocabulary_size() -> None:
    r = race_uniforms(_step_uniforms(256), 2000)  # (256, 2000)
    assert ((r > 0) & (r < 1)).all()
    hist = torch.histc(r, bins=10, min=0, max=1) / r.numel()
    assert (hist - 0.1).abs().max() < 0.005  # binomial sd at n=512000 is 0.04%
    # token v's uniform is the same whatever the vocabulary's size (a padded output layer)
    assert torch.equal(race_uniforms(_step_uniforms(256), 3000)[:, :2000], r)


def test_uniforms_are_uniform_and_distinct() -> None:
    seeds = row_seeds(seed=0, update=0, prompt_index=torch.arange(4096), k=4)  # 16384 rows
    assert seeds.unique().numel() > 16384 * 0.99
    u = uniforms(seeds, step=3)
    assert ((u > 0) & (u < 1)).all()
    hist = torch.histc(u.float(), bins=10, min=0, max=1) / u.numel()
    # each decile holds 10% +- 1.5% (binomial sd at n=16384 is 0.23%)
    assert (hist - 0.1).abs().max() < 0.015
    # different steps, updates and seeds give different streams
    assert not torch.equal(u, uniforms(seeds, step=4))
    assert not torch.equal(seeds, row_seeds(seed=0, update=1, prompt_index=torch.arange(4096), k=4))
    assert not torch.equal(seeds, row_seeds(seed=1, update=0, prompt_index=torch.arange(4096), k=4))


@pytest.fixture(scope="module")
def lm(tmp_path_factory: pytest.TempPathFactory):
    setup = build_tiny_setup(tmp_path_factory.mktemp("gen"))
    tok = load_tokenizer(str(setup.policy))
    model = load_causal_lm(str(setup.policy), flag="model_name_or_path").eval()
    return Path(setup.policy), tok, model


PROMPTS = ["Write about the sea:", "Hi", "Tell me a long story about a cat and the wind:"]


def test_samples_do_not_depend_on_batching(lm) -> None:
    _, tok, model = lm
    ids = [tok(p)["input_ids"] for p in PROMPTS]
    params = SamplingParams(max_new_tokens=12, temperature=1.0, pad_token_id=tok.pad_token_id)
    seeds = row_seeds(7, 2, torch.tensor([10, 11, 12]), 3)  # (9,)
    together = (
        TransformersGenerator(model, batch_size=64)
        .generate(*left_pad(ids, tok.pad_token_id), 3, params, seeds)
        .tokens
    )
    # one prompt at a time (different left padding, different batch) must give the same samples
    alone = torch.cat(
        [
            TransformersGenerator(model, batch_size=3)
            .generate(*left_pad([ids[i]], tok.pad_token_id), 3, params, seeds[3 * i : 3 * i + 3])
            .tokens
            for i in range(3)
        ]
    )
    assert torch.equal(together, alone)
    # and K samples of one prompt differ from each other
    assert len({tuple(r.tolist()) for r in together[:3]}) > 1


def test_greedy_matches_transformers_generate(lm) -> None:
    _, tok, model = lm
    ids, mask = left_pad([tok(p)["input_ids"] for p in PROMPTS], tok.pad_token_id)
    k = 2
    params = SamplingParams(max_new_tokens=10, pad_token_id=tok.pad_token_id, greedy=True)
    ours = (
        TransformersGenerator(model, batch_size=64)
        .generate(ids, mask, k, params, torch.zeros(6, dtype=torch.long))
        .tokens
    )
    ref = model.generate(
        input_ids=ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=10,
        min_new_tokens=10,
        pad_token_id=tok.pad_token_id,
    )[:, ids.size(1) :]
    # the shared prefill + repeated KV cache gives every one of the K copies the reference's tokens
    assert torch.equal(ours, ref.repeat_interleave(k, dim=0))


def test_stop_token_pads_after_it_and_stops_early(lm) -> None:
    _, tok, model = lm
    ids, mask = left_pad([tok(p)["input_ids"] for p in PROMPTS], tok.pad_token_id)
    seeds = row_seeds(0, 0, torch.arange(3), 4)
    free = SamplingParams(max_new_tokens=16, temperature=1.0, pad_token_id=tok.pad_token_id)
    out = TransformersGenerator(model, batch_size=64).generate(ids, mask, 4, free, seeds).tokens
    # make a token that was sampled somewhere the stop token: rows must end right after it
    stop = int(out[0, 1])
    pad = (stop + 1) % len(tok)  # a real id (it is fed back to the model), distinct from the stop token
    stopped = (
        TransformersGenerator(model, batch_size=64)
        .generate(
            ids,
            mask,
            4,
            SamplingParams(**{**free.__dict__, "stop_token_id": stop, "pad_token_id": pad}),
            seeds,
        )
        .tokens
    )
    for row_free, row_stop in zip(out, stopped, strict=True):
        hits = (row_free == stop).nonzero()
        n = int(hits[0]) + 1 if hits.numel() else row_free.numel()
        assert torch.equal(row_stop[:n], row_free[:n])  # identical up to and including the stop token
        assert (row_stop[n:] == pad).all()
    assert math.isclose(float((stopped[0, 2:] == pad).float().mean()), 1.0)


def test_generation_logprobs_match_a_full_forward(lm) -> None:
    # The on-policy fast path feeds these to the KL penalty instead of a second policy forward: they
    # must be the log-softmax at the sampling temperature of the sampled tokens, as a full forward gives.
    _, tok, model = lm
    ids, mask = left_pad([tok(p)["input_ids"] for p in PROMPTS], tok.pad_token_id)
    params = SamplingParams(max_new_tokens=8, temperature=0.7, pad_token_id=tok.pad_token_id)
    gen = TransformersGenerator(model, batch_size=64).generate(
        ids, mask, 2, params, row_seeds(1, 0, torch.arange(3), 2), return_logprobs=True
    )
    full = torch.cat([ids.repeat_interleave(2, 0), gen.tokens], dim=1)  # (6, L+8)
    attn = torch.cat([mask.repeat_interleave(2, 0), torch.ones_like(gen.tokens)], dim=1)
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=full, attention_mask=attn, position_ids=pos).logits[:, ids.size(1) - 1 : -1]
    expected = torch.log_softmax(logits / (0.7 + 1e-7), -1).gather(-1, gen.tokens[..., None]).squeeze(-1)
    torch.testing.assert_close(gen.logprobs, expected, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module", params=["gpt_neox", "llama", "qwen2"])
def arch_lm(request, tmp_path_factory):
    from rloo.demo.tiny import build_causal_lm, build_tokenizer

    root = tmp_path_factory.mktemp(f"static-{request.param}")
    build_tokenizer(root / "tok")
    path = build_causal_lm(root / "lm", root / "tok", arch=request.param, seed=3)
    tok = load_tokenizer(str(path))
    return tok, load_causal_lm(str(path), flag="model_name_or_path").eval()


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("greedy", [False, True])
def test_static_cache_decode_matches_the_dynamic_one(arch_lm, attn: str, greedy: bool) -> None:
    # The static path (preallocated cache, fixed-shape steps: what CUDA graphs replay) must sample what
    # the dynamic one samples: same uniforms, logits equal up to float summation order.
    tok, model = arch_lm
    model.config._attn_implementation = attn
    ids, mask = left_pad([tok(p)["input_ids"] for p in PROMPTS], tok.pad_token_id)
    seeds = row_seeds(5, 1, torch.arange(3), 4)
    params = SamplingParams(max_new_tokens=20, temperature=0.9, pad_token_id=tok.pad_token_id, greedy=greedy)
    runs = {
        impl: TransformersGenerator(model, batch_size=64, cache_implementation=impl).generate(
            ids, mask, 4, params, seeds, return_logprobs=True
        )
        for impl in ("dynamic", "static")
    }
    _assert_same_samples(runs["static"], runs["dynamic"])


def _assert_same_samples(a, b) -> None:
    """Equal up to float summation order: the static cache attends over a wider, masked key range, so
    logits can differ in the last bit, and a uniform that falls on a CDF boundary can (rarely) pick the
    neighbouring token, after which the row goes its own way. Every row agrees up to its first such
    flip with equal log-probs, and nearly all tokens agree."""
    agree = a.tokens == b.tokens  # (B, T)
    assert float(agree.float().mean()) >= 0.95
    for row in range(agree.size(0)):
        flips = (~agree[row]).nonzero()
        upto = int(flips[0]) if flips.numel() else agree.size(1)
        torch.testing.assert_close(a.logprobs[row, :upto], b.logprobs[row, :upto], atol=1e-5, rtol=1e-5)


def test_static_cache_decode_stops_like_the_dynamic_one(lm) -> None:
    # The static loop looks at `done` only every STOP_CHECK_EVERY steps; the rows must not show it.
    _, tok, model = lm
    ids, mask = left_pad([tok(p)["input_ids"] for p in PROMPTS], tok.pad_token_id)
    seeds = row_seeds(0, 0, torch.arange(3), 4)
    free = SamplingParams(max_new_tokens=40, temperature=1.0, pad_token_id=tok.pad_token_id)
    sampled = TransformersGenerator(model, batch_size=64).generate(ids, mask, 4, free, seeds).tokens
    params = SamplingParams(**{**free.__dict__, "stop_token_id": int(sampled[0, 3])})
    dynamic, static = (
        TransformersGenerator(model, batch_size=64, cache_implementation=impl).generate(
            ids, mask, 4, params, seeds, return_logprobs=True
        )
        for impl in ("dynamic", "static")
    )
    _assert_same_samples(static, dynamic)
    stop = params.stop_token_id
    for row in static.tokens:  # nothing but padding after the stop token, however late the loop noticed
        hits = (row == stop).nonzero()
        if hits.numel():
            assert (row[int(hits[0]) + 1 :] == params.pad_token_id).all()


# -- the compute-dtype cache, the whole-step graph and the rollout copy -------------------------------
def _autocast_bf16():
    return torch.autocast("cpu", dtype=torch.bfloat16)


def _prompts(tok):
    return left_pad([tok(p)["input_ids"] for p in PROMPTS], tok.pad_token_id)


def test_static_decode_under_autocast_keeps_a_compute_dtype_cache(arch_lm) -> None:
    # An fp32 model under bf16 autocast makes fp32 keys (the rotary embedding promotes) and bf16 values;
    # the static cache used to take the keys' dtype for both and failed at the first decode step.
    tok, model = arch_lm
    model.config._attn_implementation = "sdpa"
    ids, mask = _prompts(tok)
    seeds = row_seeds(2, 0, torch.arange(3), 4)
    params = SamplingParams(max_new_tokens=12, temperature=1.0, pad_token_id=tok.pad_token_id)
    runs = {}
    for impl in ("dynamic", "static"):
        gen = TransformersGenerator(model, batch_size=64, autocast=_autocast_bf16, cache_implementation=impl)
        made = spy_static_buffers(gen)
        runs[impl] = gen.generate(ids, mask, 4, params, seeds, return_logprobs=True)
    (buf,) = made
    assert _static_cache_dtypes(buf) == {torch.bfloat16}
    # the same bf16 attention inputs as the dynamic cache's (attention casts its fp32 keys to bf16)
    agree = float((runs["static"].tokens == runs["dynamic"].tokens).float().mean())
    assert agree >= 0.9, agree


def _static_cache_dtypes(buf) -> set[torch.dtype]:
    """The dtypes of everything a static decode's KV cache holds: a StaticCache's layers, or a shared-prefix
    cache's prompt and response parts."""
    cache = buf.cache
    if hasattr(cache, "layers"):
        tensors = [t for layer in cache.layers for t in (layer.keys, layer.values)]
    else:
        tensors = [*cache.prompt_keys, *cache.prompt_values, *cache.response_keys, *cache.response_values]
    return {t.dtype for t in tensors}


@pytest.mark.parametrize("greedy", [False, True])
@pytest.mark.parametrize("stop", [False, True])
def test_whole_step_decode_equals_the_step_by_step_loop(lm, greedy: bool, stop: bool) -> None:
    # Sampling inside the step (indexed by a device counter) must choose exactly what the host loop chooses.
    _, tok, model = lm
    ids, mask = _prompts(tok)
    seeds = row_seeds(7, 3, torch.arange(3), 4)
    params = SamplingParams(max_new_tokens=24, temperature=0.8, top_p=0.95, pad_token_id=tok.pad_token_id)
    if stop:
        free = TransformersGenerator(model, batch_size=64).generate(ids, mask, 4, params, seeds).tokens
        params = SamplingParams(**{**params.__dict__, "stop_token_id": int(free[1, 2])})
    params = SamplingParams(**{**params.__dict__, "greedy": greedy})
    whole, host, dynamic = (
        TransformersGenerator(model, batch_size=64, cache_implementation=impl, whole_step=w).generate(
            ids, mask, 4, params, seeds, return_logprobs=True
        )
        for impl, w in (("static", True), ("static", False), ("dynamic", True))
    )
    assert torch.equal(whole.tokens, host.tokens)
    assert torch.equal(whole.logprobs, host.logprobs)
    _assert_same_samples(whole, dynamic)


def test_an_uncompiled_static_decode_keeps_no_cache_after_the_call(lm) -> None:
    # Without a recorded graph to keep addresses for, the static cache goes with the call, as the
    # dynamic one does: not held through the optimisation phase.
    _, tok, model = lm
    gen = TransformersGenerator(model, batch_size=8, cache_implementation="static")
    made = spy_static_buffers(gen)
    params = SamplingParams(max_new_tokens=4, pad_token_id=tok.pad_token_id)
    gen.generate(*_prompts(tok), 4, params, row_seeds(0, 0, torch.arange(3), 4))
    assert made and gen._buffers == {}


def test_compiled_whole_step_decode_matches_eager_and_replays(lm) -> None:
    # torch.compile of the whole step (sampling included): on a GPU the step replays as one CUDA graph;
    # here inductor compiles it for the CPU, and the tokens must be the eager loop's. A second rollout of
    # another prompt width in the same length bucket decodes in the same buffers with the same graph.
    from torch._dynamo.utils import counters

    _, tok, model = lm
    params = SamplingParams(max_new_tokens=10, temperature=1.0, pad_token_id=tok.pad_token_id)
    short = left_pad([tok(p)["input_ids"] for p in ["Hi", "Hello", "Hi"]], tok.pad_token_id)
    longer = _prompts(tok)
    assert short[0].size(1) != longer[0].size(1)
    seeds = row_seeds(1, 0, torch.arange(3), 4)
    gen = TransformersGenerator(model, batch_size=64, cache_implementation="static", compile_decode=True)
    made = spy_static_buffers(gen)
    gen.generate(*short, 4, params, seeds, return_logprobs=True)
    graphs = counters["stats"]["unique_graphs"]
    assert graphs > 0  # the first call compiled
    compiled = gen.generate(*longer, 4, params, seeds, return_logprobs=True)
    assert counters["stats"]["unique_graphs"] == graphs  # replayed, not traced again
    assert made[0] is made[1] and list(gen._buffers.values()) == [made[0]]
    eager = TransformersGenerator(model, batch_size=64, cache_implementation="static").generate(
        *longer, 4, params, seeds, return_logprobs=True
    )
    _assert_same_samples(compiled, eager)


def test_rollout_copy_is_the_policy_in_bf16_after_every_sync(lm) -> None:
    from rloo.generation import rollout_copy, sync_rollout_copy

    path, _, _ = lm
    policy = load_causal_lm(str(path), flag="model_name_or_path")
    copy = rollout_copy(policy, torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 and not p.requires_grad for p in copy.parameters())
    # buffers keep their dtype and values: bf16 rotary frequencies would shift every position's phase
    buffers = dict(policy.named_buffers())
    assert buffers and any(b.is_floating_point() for b in buffers.values())
    assert all(
        torch.equal(b, buffers[name]) and b.dtype == buffers[name].dtype for name, b in copy.named_buffers()
    )
    assert all(p.dtype == torch.float32 and p.requires_grad for p in policy.parameters())  # untouched
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    loss = policy(input_ids=torch.arange(1, 9)[None], labels=torch.arange(1, 9)[None]).loss
    loss.backward()
    opt.step()
    assert not _equal_states(copy, _bf16(policy))  # the step moved the policy, not the copy
    pointers = [p.data_ptr() for p in copy.parameters()]
    sync_rollout_copy(copy, policy)
    assert _equal_states(copy, _bf16(policy))
    assert pointers == [p.data_ptr() for p in copy.parameters()]  # in place: recorded graphs stay valid


def _bf16(model):
    """``model`` as its rollout copy must be: parameters cast to bf16, buffers (rotary frequencies) as they
    are."""
    import copy

    out = copy.deepcopy(model)
    for p in out.parameters():
        p.data = p.data.to(torch.bfloat16)
    return out


def _equal_states(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_generator_refreshes_its_copy_only_when_the_weights_moved(lm) -> None:
    from rloo.generation import GenerationSettings

    path, tok, _ = lm
    policy = load_causal_lm(str(path), flag="model_name_or_path")
    settings = GenerationSettings(
        use_vllm=False,
        cache_implementation="static",
        compile_generation=False,
        generation_dtype="bfloat16",
        ds3_gather_for_generation=True,
        model_path=str(path),
        bf16=True,
        fp16=False,
        seed=0,
        trust_remote_code=False,
        vllm_gpu_memory_utilization=0.5,
        vllm_enable_sleep_mode=False,
        vllm_batch_invariant=False,
        vllm_server_url=None,
        vllm_server_timeout=240.0,
        async_generation=False,
    )
    gen = TransformersGenerator.from_settings(policy, settings, batch_size=8, copy_dtype=torch.bfloat16)
    assert gen.model is not policy and gen.source is policy
    gen.weights_version = 0
    ids, mask = _prompts(tok)
    params = SamplingParams(max_new_tokens=4, greedy=True, pad_token_id=tok.pad_token_id)
    seeds = row_seeds(0, 0, torch.arange(3), 1)
    gen.generate(ids, mask, 1, params, seeds)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.5)
    gen.generate(ids, mask, 1, params, seeds)  # same version: the copy keeps the old weights
    assert not _equal_states(gen.model, _bf16(policy))
    gen.weights_version = 1
    gen.generate(ids, mask, 1, params, seeds)
    assert _equal_states(gen.model, _bf16(policy))


def test_the_compiled_race_draws_the_eager_race_tokens() -> None:
    # An eager decode on a GPU samples through the compiled race (one kernel instead of a dozen passes):
    # it must draw the tokens the eager one does, and the whole-step graph's inlined copy too.
    from rloo.generation import _compiled_race, _race

    logits = torch.randn(64, 1000, generator=torch.Generator().manual_seed(1)) / 0.7  # (B, V)
    u = _step_uniforms(64)
    assert torch.equal(_compiled_race()(logits, u), _race(logits, u))
    assert torch.equal(_compiled_race()(logits[:40], u[:40]), _race(logits[:40], u[:40]))
