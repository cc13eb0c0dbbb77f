"""bf16 training and the built-in generator on a real GPU (``pytest -m gpu``; skipped without CUDA).

What the GPU must show, on random-initialised models of real architectures with their full
vocabularies (built locally, nothing downloaded): a bf16 run trains without NaN and its first PPO ratio
is 1 within 1e-3; the built-in generator samples what ``generate`` samples (greedy identical, sampled
sequences equally likely under the model); the static-cache decode path, compiled, agrees with the
dynamic one; DeepSpeed ZeRO-2 and ZeRO-3 run on one GPU and resume from a checkpoint.

Run them with ``benchmarks/gpu_check.sh`` (or ``make gpu-check``), which also installs what a bare node
lacks from a folder of wheels. The CPU suite covers the same code paths in float32 on tiny models.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from rloo.config import RLOOConfig  # noqa: E402
from rloo.demo.tiny import build_causal_lm, build_tokenizer  # noqa: E402
from rloo.demo.toy import write_toy_dataset  # noqa: E402
from rloo.generation import SamplingParams, TransformersGenerator, left_pad, row_seeds  # noqa: E402
from rloo.models import load_causal_lm, load_tokenizer  # noqa: E402
from rloo.training.trainer import train  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
# the real vocabularies: Qwen2's 151,936 rows and Llama 3's 128,256
FULL_VOCAB = {"qwen2": 151_936, "llama": 128_256}
PROMPTS = ["Write about the sea:", "Hi", "Tell me a long story about a cat and the wind:", "Once upon"]


@pytest.fixture(scope="module", params=sorted(FULL_VOCAB))
def full_vocab_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp(f"gpu-{request.param}")
    build_tokenizer(root / "tok")
    return build_causal_lm(
        root / "lm",
        root / "tok",
        arch=request.param,
        hidden_size=512,
        num_layers=4,
        num_heads=8,
        vocab_size=FULL_VOCAB[request.param],
        max_position_embeddings=2048,
        seed=11,
    )


@pytest.fixture(scope="module")
def toy_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_toy_dataset(tmp_path_factory.mktemp("toy"))


def _config(model: Path, data: Path, out: Path, **overrides: Any) -> RLOOConfig:
    kw: dict[str, Any] = dict(
        model_name_or_path=str(model),
        reward_funcs=["rloo.demo.toy:letter_reward"],
        dataset_name=str(data),
        output_dir=str(out),
        per_device_train_batch_size=64,
        rloo_k=4,
        response_length=53,
        temperature=1.0,
        bf16=True,
        num_sample_generations=0,
        save_steps=0,
        disable_tqdm=True,
        seed=5,
    )
    kw.update(overrides)
    return RLOOConfig(**kw)


def test_bf16_first_ratio_is_one(full_vocab_model: Path, toy_data: Path, tmp_path: Path) -> None:
    # lr 0: the weights never move, so every ratio of 2 epochs x 2 mini-batches is 1 up to the batch
    # composition of the bf16 forward -- the reference took its "old" log-probs from generation and
    # clipped 20-40% of its ratios in bf16.
    cfg = _config(
        full_vocab_model,
        toy_data,
        tmp_path / "out",
        max_steps=1,
        learning_rate=0.0,
        num_ppo_epochs=2,
        num_mini_batches=2,
    )
    (h,) = train(cfg).history
    assert h["val/ratio"] == pytest.approx(1.0, abs=1e-3)
    assert h["policy/clipfrac_avg"] == pytest.approx(0.0, abs=1e-3)


def test_bf16_run_trains_without_nan(full_vocab_model: Path, toy_data: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    out = tmp_path / "out"
    cfg = _config(full_vocab_model, toy_data, out, max_steps=4, learning_rate=1e-5, num_ppo_epochs=2)
    history = train(cfg).history
    assert len(history) == 4
    for record in history:
        bad = {k: v for k, v in record.items() if isinstance(v, float) and not math.isfinite(v)}
        assert not bad, f"non-finite metrics at episode {record['episode']}: {bad}"
    weights = load_file(str(out / "model.safetensors"))
    assert all(bool(torch.isfinite(w.float()).all()) for w in weights.values())


def _loaded(path: Path, dtype: torch.dtype) -> tuple[Any, Any]:
    tok = load_tokenizer(str(path))
    model = load_causal_lm(str(path), flag="model_name_or_path").to("cuda", dtype).eval()
    return tok, model


def test_greedy_matches_generate_in_bf16(full_vocab_model: Path) -> None:
    tok, model = _loaded(full_vocab_model, torch.bfloat16)
    ids, mask = left_pad([tok(p)["input_ids"] for p in PROMPTS], tok.pad_token_id, torch.device("cuda"))
    params = SamplingParams(max_new_tokens=24, pad_token_id=tok.pad_token_id, greedy=True)
    seeds = torch.zeros(len(PROMPTS), dtype=torch.long)
    ours = TransformersGenerator(model, batch_size=64).generate(ids, mask, 1, params, seeds).tokens
    ref = model.generate(
        input_ids=ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=24,
        min_new_tokens=24,
        pad_token_id=tok.pad_token_id,
    )[:, ids.size(1) :]
    assert torch.equal(ours, ref)


def _sequence_logprob(
    model: Any, ids: torch.Tensor, mask: torch.Tensor, completions: torch.Tensor
) -> torch.Tensor:
    """(b,) summed log-probability of each completion under a plain full forward in float32."""
    full = torch.cat([ids, completions], dim=1)
    attn = torch.cat([mask, torch.ones_like(completions)], dim=1)
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=full, attention_mask=attn, position_ids=pos).logits[:, ids.size(1) - 1 : -1]
    logp = torch.log_softmax(logits.float(), -1).gather(-1, completions[..., None]).squeeze(-1)  # (b, T)
    return logp.sum(-1)


def test_sampling_matches_generate_in_distribution(full_vocab_model: Path) -> None:
    # Both samplers draw from the same distribution iff the mean log-probability (under one scoring
    # forward) of what they draw agrees: E[log p(x)] = -H. 1024 sequences a prompt; 4 standard errors.
    tok, model = _loaded(full_vocab_model, torch.bfloat16)
    n, steps = 1024, 16
    ids, mask = left_pad([tok(PROMPTS[0])["input_ids"]], tok.pad_token_id, torch.device("cuda"))
    params = SamplingParams(max_new_tokens=steps, temperature=1.0, pad_token_id=tok.pad_token_id)
    ours = TransformersGenerator(model, batch_size=n).generate(
        ids, mask, n, params, row_seeds(3, 0, torch.arange(1), n)
    )
    torch.manual_seed(0)
    theirs = model.generate(
        input_ids=ids.expand(n, -1),
        attention_mask=mask.expand(n, -1),
        do_sample=True,
        top_k=0,
        temperature=1.0,
        max_new_tokens=steps,
        min_new_tokens=steps,
        pad_token_id=tok.pad_token_id,
    )[:, ids.size(1) :]
    a = _sequence_logprob(model, ids.expand(n, -1), mask.expand(n, -1), ours.tokens.cuda())
    b = _sequence_logprob(model, ids.expand(n, -1), mask.expand(n, -1), theirs)
    se = math.sqrt(float(a.var()) / n + float(b.var()) / n)
    assert abs(float(a.mean()) - float(b.mean())) < 4 * se, (float(a.mean()), float(b.mean()), se)


@pytest.mark.parametrize("compiled", [False, True])
def test_static_decode_matches_dynamic_on_gpu(full_vocab_model: Path, compiled: bool) -> None:
    # Greedy: the same tokens (fp32, so that a compiled step's other fusion cannot flip a near-tie).
    # Sampled: token-by-token equality is the wrong test -- one flip at a CDF boundary (dense over 150k
    # near-uniform tokens of a random model) changes the rest of its row -- so, as for generate above,
    # the two paths must draw sequences of equal mean log-probability: 1024 a prompt, 4 standard errors.
    tok, model = _loaded(full_vocab_model, torch.float32)
    ids, mask = left_pad([tok(p)["input_ids"] for p in PROMPTS], tok.pad_token_id, torch.device("cuda"))
    greedy = SamplingParams(max_new_tokens=32, pad_token_id=tok.pad_token_id, greedy=True)
    seeds = row_seeds(1, 0, torch.arange(len(PROMPTS)), 4)

    def generator(static: bool) -> TransformersGenerator:
        if not static:
            return TransformersGenerator(model, batch_size=1024)
        return TransformersGenerator(
            model, batch_size=1024, cache_implementation="static", compile_decode=compiled
        )

    dynamic = generator(False).generate(ids, mask, 4, greedy, seeds).tokens
    static = generator(True).generate(ids, mask, 4, greedy, seeds).tokens
    assert torch.equal(static, dynamic)

    n = 1024
    one, one_mask = ids[:1], mask[:1]
    sampled = SamplingParams(max_new_tokens=16, temperature=1.0, pad_token_id=tok.pad_token_id)
    draws = [
        generator(static).generate(one, one_mask, n, sampled, row_seeds(3 + static, 0, torch.arange(1), n))
        for static in (False, True)
    ]
    a, b = (
        _sequence_logprob(model, one.expand(n, -1), one_mask.expand(n, -1), d.tokens.cuda()) for d in draws
    )
    se = math.sqrt(float(a.var()) / n + float(b.var()) / n)
    assert abs(float(a.mean()) - float(b.mean())) < 4 * se, (float(a.mean()), float(b.mean()), se)


def test_whole_step_graph_replays_without_recording_again(full_vocab_model: Path) -> None:
    # The whole decode step (forward, sampling, token write, mask) as one compiled CUDA graph: the same
    # greedy tokens as the forward-only graph (fp32: no near-tie flips), and a second rollout of other
    # prompt widths in the same length bucket reuses the recorded graph (no new compilation).
    tok, model = _loaded(full_vocab_model, torch.float32)
    ids, mask = left_pad([tok(p)["input_ids"] for p in PROMPTS], tok.pad_token_id, torch.device("cuda"))
    greedy = SamplingParams(max_new_tokens=32, pad_token_id=tok.pad_token_id, greedy=True)
    seeds = row_seeds(1, 0, torch.arange(len(PROMPTS)), 4)
    runs = {
        whole: TransformersGenerator(
            model, batch_size=1024, cache_implementation="static", compile_decode=True, whole_step=whole
        )
        for whole in (False, True)
    }
    tokens = {whole: gen.generate(ids, mask, 4, greedy, seeds).tokens for whole, gen in runs.items()}
    assert torch.equal(tokens[True], tokens[False])
    from torch._dynamo.utils import counters

    compiled = dict(counters["stats"])
    narrower = left_pad(
        [tok(p)["input_ids"] for p in PROMPTS[:2] + PROMPTS[:2]], tok.pad_token_id, torch.device("cuda")
    )
    runs[True].generate(*narrower, 4, greedy, seeds)
    assert dict(counters["stats"]).get("unique_graphs") == compiled.get("unique_graphs")


def test_bf16_run_samples_from_a_bf16_copy(full_vocab_model: Path, toy_data: Path, tmp_path: Path) -> None:
    # On a GPU in bf16, --generation_dtype auto samples from a bf16 copy of the policy into a bf16 cache.
    from rloo.training.trainer import RLOOTrainer

    cfg = _config(
        full_vocab_model,
        toy_data,
        tmp_path / "out",
        max_steps=2,
        learning_rate=1e-5,
        cache_implementation="static",
        compile_generation=True,
    )
    trainer = RLOOTrainer(cfg)
    assert trainer.generator.source is trainer.policy
    assert {p.dtype for p in trainer.generator.model.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in trainer.ref_policy.parameters()} == {torch.bfloat16}
    history = trainer.train().history
    assert trainer.generator._synced_version == 1
    for record in history:
        bad = {k: v for k, v in record.items() if isinstance(v, float) and not math.isfinite(v)}
        assert not bad, f"non-finite metrics at episode {record['episode']}: {bad}"


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed")
@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_on_one_gpu_runs_and_resumes(
    stage: int, full_vocab_model: Path, toy_data: Path, tmp_path: Path
) -> None:
    if "gpu-llama" in str(full_vocab_model):
        pytest.skip(
            "DeepSpeed's wrapping does not depend on the architecture: Qwen2 only, to keep the run short"
        )
    out = tmp_path / "out"

    def launch(max_steps: int) -> None:
        cmd = [
            sys.executable, "-m", "accelerate.commands.launch",
            "--config_file", str(REPO / "configs" / "accelerate" / f"deepspeed_zero{stage}.yaml"),
            "--num_processes", "1",
            "-m", "rloo.cli", "train",
            "--model_name_or_path", str(full_vocab_model),
            "--reward_funcs", "rloo.demo.toy:letter_reward",
            "--dataset_name", str(toy_data),
            "--output_dir", str(out),
            "--per_device_train_batch_size", "16",
            "--rloo_k", "4",
            "--response_length", "16",
            "--learning_rate", "1e-5",
            "--bf16",
            "--max_steps", str(max_steps),
            "--save_steps", "1",
            "--num_sample_generations", "0",
            "--disable_tqdm",
        ]  # fmt: skip
        proc = subprocess.run(
            cmd, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}
        )
        # our one-line errors first: the launcher's traceback that follows them would push them out of view
        ours = [line for line in proc.stderr.splitlines() if "[rloo]" in line or "rloo train: error" in line]
        assert proc.returncode == 0, "\n".join(ours[-10:]) + "\n" + proc.stdout[-2000:] + proc.stderr[-2000:]

    launch(2)
    launch(4)  # resumes from the checkpoint of update 2
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    episodes = [r["episode"] for r in records]
    assert len(episodes) == 4 and episodes == sorted(set(episodes))  # updates 3 and 4 follow 1 and 2
    assert all(math.isfinite(r["loss/policy_avg"]) for r in records)
    assert (out / "training_complete.json").is_file()


# -- the fast paths' agreement on the GPU: packed prefix rows, shared-prefix decode, the compiled race --------
def test_packed_rows_match_plain_rows_on_gpu(full_vocab_model: Path) -> None:
    # One row per prompt group under a 4D block mask (SDPA's kernel for an arbitrary mask) against a plain
    # row per completion: the same log-probs, fp32 tight, bf16 within its rounding.
    from rloo import algo
    from rloo.forward import response_logits

    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 0.1)):
        tok, model = _loaded(full_vocab_model, dtype)
        ids, mask = left_pad([tok(p)["input_ids"] for p in PROMPTS], tok.pad_token_id, torch.device("cuda"))
        rows = torch.arange(len(PROMPTS), device="cuda").repeat_interleave(4)  # (16,)
        responses = torch.randint(10, 1000, (rows.numel(), 12), device="cuda")  # (16, 12)
        with torch.no_grad():
            packed = response_logits(model, ids, mask, rows, responses, share_prefix=True, packed=True)
            plain = response_logits(model, ids, mask, rows, responses, share_prefix=False, packed=False)
        a = algo.selective_log_softmax(packed.float(), responses)  # (16, 12)
        b = algo.selective_log_softmax(plain.float(), responses)
        assert (a - b).abs().max() < tol, (dtype, float((a - b).abs().max()))


def test_shared_prefix_decode_matches_the_repeated_cache_on_gpu(full_vocab_model: Path, monkeypatch) -> None:
    # Each prompt's KV held once and read once per step for its K rows: the same greedy tokens as K copies
    # of it (fp32: no near-tie flips), dynamic and static caches.
    from rloo import prefix_attention

    tok, model = _loaded(full_vocab_model, torch.float32)
    ids, mask = left_pad([tok(p)["input_ids"] for p in PROMPTS], tok.pad_token_id, torch.device("cuda"))
    greedy = SamplingParams(max_new_tokens=32, pad_token_id=tok.pad_token_id, greedy=True)
    seeds = row_seeds(1, 0, torch.arange(len(PROMPTS)), 4)
    assert prefix_attention.supports(model, 4)
    for cache in ("dynamic", "static"):
        shared = TransformersGenerator(model, batch_size=1024, cache_implementation=cache)
        got = shared.generate(ids, mask, 4, greedy, seeds).tokens
        with monkeypatch.context() as m:
            m.setattr(prefix_attention, "supports", lambda model, k: False)
            repeated = TransformersGenerator(model, batch_size=1024, cache_implementation=cache)
            want = repeated.generate(ids, mask, 4, greedy, seeds).tokens
        assert torch.equal(got, want), cache


def test_the_compiled_race_draws_from_the_softmax_on_gpu() -> None:
    # On a GPU untruncated sampling is the exponential race, compiled: the same tokens as the race run
    # eagerly, and token counts that fit the softmax (Pearson's chi-square at its 0.999 quantile).
    from scipy.stats import chi2

    from rloo.generation import _race, exponential_race, sample_tokens, uniforms

    vocab, n = 50, 40_000
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(3)).cuda() * 2  # (V,)
    u = uniforms(row_seeds(7, 0, torch.arange(n), 1), 0).cuda()  # (n,)
    toks = sample_tokens(logits.expand(n, vocab), u, temperature=0.7)  # (n,)
    assert torch.equal(toks, exponential_race(logits.expand(n, vocab).float() / 0.7, u))
    assert torch.equal(toks, _race(logits.expand(n, vocab).float() / 0.7, u))
    expected = torch.softmax(logits.double().cpu() / 0.7, -1) * n
    counts = torch.bincount(toks.cpu(), minlength=vocab).double()
    assert float(((counts - expected) ** 2 / expected).sum()) < chi2.ppf(0.999, vocab - 1)
