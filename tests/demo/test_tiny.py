"""Tests for rloo.demo.tiny: tiny random-init models of real architectures, built locally and loaded back."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from rloo.demo.tiny import (
    ARCHITECTURES,
    EOS_TOKEN,
    PAD_TOKEN,
    TinySetup,
    build_causal_lm,
    build_reward_model,
    build_tiny_setup,
    build_tokenizer,
)

CLASS_NAMES = {
    "gpt_neox": ("GPTNeoXForCausalLM", "GPTNeoXForSequenceClassification"),
    "llama": ("LlamaForCausalLM", "LlamaForSequenceClassification"),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2ForSequenceClassification"),
}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tok") / "tokenizer"
    build_tokenizer(path)
    return path


@pytest.fixture(scope="module", params=ARCHITECTURES)
def setup(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> TinySetup:
    return build_tiny_setup(tmp_path_factory.mktemp(request.param), arch=request.param)


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


def _all_mtimes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in root.rglob("*") if p.is_file()}


def test_setup_layout(setup: TinySetup) -> None:
    assert setup.tokenizer == setup.root / "tokenizer"
    assert setup.policy == setup.root / "policy"
    assert setup.reward_model == setup.root / "reward_model"
    for model_dir in (setup.policy, setup.reward_model):
        assert (model_dir / "model.safetensors").is_file()
        assert (model_dir / "config.json").is_file()
        assert (model_dir / "tokenizer.json").is_file()
    assert (setup.tokenizer / "tokenizer.json").is_file()
    assert json.loads((setup.root / "tiny_setup.json").read_text())["arch"] in ARCHITECTURES
    with pytest.raises(AttributeError):  # frozen dataclass
        setup.policy = setup.root  # type: ignore[misc]


def test_models_load_back_and_run(setup: TinySetup) -> None:
    arch = json.loads((setup.root / "tiny_setup.json").read_text())["arch"]
    tokenizer = AutoTokenizer.from_pretrained(setup.policy)
    policy = AutoModelForCausalLM.from_pretrained(setup.policy)
    reward = AutoModelForSequenceClassification.from_pretrained(setup.reward_model)
    assert (type(policy).__name__, type(reward).__name__) == CLASS_NAMES[arch]
    assert policy.config.model_type == arch
    assert policy.config.hidden_size == 64 and policy.config.num_hidden_layers == 2
    assert policy.config.vocab_size == len(tokenizer) == 512
    assert policy.dtype == torch.float32
    assert policy.config.eos_token_id == tokenizer.eos_token_id == tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    # The reward model needs a pad id to find each row's last token: eos, since the tokenizer has no pad.
    assert reward.config.num_labels == 1
    assert reward.config.pad_token_id == tokenizer.eos_token_id

    tokenizer.pad_token = tokenizer.eos_token
    batch = tokenizer(["Write about the sea:", "aeiou eau oo"], return_tensors="pt", padding=True)
    seq_len = batch["input_ids"].shape[1]
    with torch.no_grad():
        assert policy(**batch).logits.shape == (2, seq_len, 512)
        assert reward(**batch).logits.shape == (2, 1)
        generated = policy.generate(
            **batch, max_new_tokens=3, do_sample=False, pad_token_id=tokenizer.eos_token_id
        )
    assert generated.shape[0] == 2 and seq_len < generated.shape[1] <= seq_len + 3


def test_tokenizer_special_tokens_and_pad(tmp_path: Path, tokenizer_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    assert tok.eos_token == tok.bos_token == EOS_TOKEN
    assert tok.pad_token is None and tok.pad_token_id is None
    assert 400 <= len(tok) <= 600
    assert tok("hello world")["input_ids"] == tok("hello world", add_special_tokens=False)["input_ids"]

    padded = build_tokenizer(tmp_path / "padded", with_pad_token=True)
    assert padded.pad_token == PAD_TOKEN
    assert padded.pad_token_id == len(tok) == len(padded) - 1
    assert padded.pad_token_id != padded.eos_token_id
    # A model built on it takes the bigger vocab and the pad id; every arch's folder agrees on the pad.
    for arch in ARCHITECTURES:
        path = build_causal_lm(tmp_path / arch, tmp_path / "padded", arch=arch)
        config = json.loads((path / "config.json").read_text())
        assert config["vocab_size"] == len(padded)
        assert config["pad_token_id"] == padded.pad_token_id
        assert AutoTokenizer.from_pretrained(path).pad_token == PAD_TOKEN


def test_every_folder_has_the_same_tokenizer(setup: TinySetup, tokenizer_dir: Path) -> None:
    # transformers loads a qwen2 folder with its own Qwen2Tokenizer class: it must still agree with ours.
    reference = AutoTokenizer.from_pretrained(tokenizer_dir)
    texts = ["Write about the sea:", "Hello, world! 2024 don't  x\n\n y  ", "aeiou eau oo ee"]
    for folder in (setup.tokenizer, setup.policy, setup.reward_model):
        tok = AutoTokenizer.from_pretrained(folder)
        assert tok.pad_token is None
        assert tok.eos_token == EOS_TOKEN
        assert tok.get_vocab() == reference.get_vocab()
        assert [tok.encode(t) for t in texts] == [reference.encode(t) for t in texts]


def test_decode_encode_round_trip(setup: TinySetup) -> None:
    rng = random.Random(0)
    for folder in (setup.tokenizer, setup.policy):
        tok = AutoTokenizer.from_pretrained(folder)
        special = set(tok.all_special_ids)
        ids = [i for i in range(len(tok)) if i not in special]
        for _ in range(50):
            text = tok.decode(rng.choices(ids, k=rng.randint(1, 24)), skip_special_tokens=True)
            assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
        text = "Hello, wörld! 12 apples  and\n\tspaces "
        assert tok.decode(tok.encode(text)) == text


def test_vocab_has_all_vowel_tokens(tokenizer_dir: Path) -> None:
    # The toy task rewards vowels: the policy must find multi-letter all-vowel tokens to shift mass to.
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    vowel_tokens = []
    for token_id in range(len(tok)):
        text = tok.decode([token_id]).strip()
        if len(text) >= 2 and set(text) <= set("aeiou"):
            vowel_tokens.append(text)
    assert len(vowel_tokens) >= 20
    assert {"aeiou", "eau", "oo", "ee", "ai"} <= set(vowel_tokens)


def test_chat_template(tmp_path: Path, tokenizer_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    messages = [{"role": "user", "content": "Write about the sea:"}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "user: Write about the sea:\n\nassistant:"
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert tok.decode(ids) == text
    assert tok.eos_token_id not in ids  # no eos inside prompts: it would look like padding when pad == eos
    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
    ]
    assert (
        tok.apply_chat_template(conversation, tokenize=False)
        == "system: Be brief.\n\nuser: Hi\n\nassistant: Hello"
    )

    plain = build_tokenizer(tmp_path / "plain", with_chat_template=False)
    assert plain.chat_template is None
    with pytest.raises(ValueError):
        plain.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


@pytest.mark.parametrize("builder", [build_causal_lm, build_reward_model])
def test_seeding(tmp_path: Path, tokenizer_dir: Path, builder) -> None:
    kwargs = {"arch": "llama", "hidden_size": 32, "num_layers": 1}
    state = torch.get_rng_state()
    a = _weights(builder(tmp_path / "a", tokenizer_dir, seed=3, **kwargs))
    assert torch.equal(torch.get_rng_state(), state)  # the caller's global RNG is left alone
    b = _weights(builder(tmp_path / "b", tokenizer_dir, seed=3, **kwargs))
    c = _weights(builder(tmp_path / "c", tokenizer_dir, seed=4, **kwargs))
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)


def test_sizes_and_tying(tmp_path: Path, tokenizer_dir: Path) -> None:
    for arch, tied in (("gpt_neox", False), ("llama", False), ("qwen2", True)):
        path = build_causal_lm(
            tmp_path / arch, tokenizer_dir, arch=arch, hidden_size=32, num_layers=3, num_heads=2
        )
        config = json.loads((path / "config.json").read_text())
        assert config["hidden_size"] == 32 and config["num_hidden_layers"] == 3
        assert config["num_attention_heads"] == 2 and config["intermediate_size"] == 128
        assert config["max_position_embeddings"] == 512
        assert config["tie_word_embeddings"] is tied
        model = AutoModelForCausalLM.from_pretrained(path)
        tied_now = (
            model.get_input_embeddings().weight.data_ptr() == model.get_output_embeddings().weight.data_ptr()
        )
        assert tied_now is tied


def test_build_tiny_setup_is_idempotent(tmp_path: Path) -> None:
    first = build_tiny_setup(tmp_path, hidden_size=32, num_layers=1)
    before = _all_mtimes(tmp_path)
    assert len(before) > 10
    second = build_tiny_setup(tmp_path, hidden_size=32, num_layers=1)
    assert second == first
    assert _all_mtimes(tmp_path) == before  # nothing rewritten

    # Different parameters rebuild in place.
    old = _weights(first.policy)
    third = build_tiny_setup(tmp_path, hidden_size=32, num_layers=1, seed=5)
    assert json.loads((tmp_path / "tiny_setup.json").read_text())["seed"] == 5
    new = _weights(third.policy)
    assert any(not torch.equal(old[k], new[k]) for k in old)
    # The reward model is seeded differently from the policy.
    assert not torch.equal(
        new["gpt_neox.embed_in.weight"], _weights(third.reward_model)["gpt_neox.embed_in.weight"]
    )


def test_build_tiny_setup_rebuilds_an_incomplete_setup(tmp_path: Path) -> None:
    setup = build_tiny_setup(tmp_path, hidden_size=32, num_layers=1)
    (setup.reward_model / "model.safetensors").unlink()
    (tmp_path / "tiny_setup.json").unlink()  # as if an earlier build was interrupted
    build_tiny_setup(tmp_path, hidden_size=32, num_layers=1)
    assert (setup.reward_model / "model.safetensors").is_file()
    assert (tmp_path / "tiny_setup.json").is_file()


def test_unknown_arch(tmp_path: Path, tokenizer_dir: Path) -> None:
    for call in (
        lambda: build_causal_lm(tmp_path / "m", tokenizer_dir, arch="gpt2"),
        lambda: build_reward_model(tmp_path / "r", tokenizer_dir, arch="gpt2"),
        lambda: build_tiny_setup(tmp_path / "s", arch="gpt2"),
    ):
        with pytest.raises(ValueError, match="gpt2") as info:
            call()
        assert all(arch in str(info.value) for arch in ARCHITECTURES)
    assert not (tmp_path / "m").exists() and not (tmp_path / "s").exists()


def test_tiny_models_are_readable_by_other_users(tmp_path: Path) -> None:
    """Like a trained model: files 0644 under umask 022, weights included (safetensors writes them 0600)."""
    import os
    import stat

    from rloo.demo.tiny import build_tiny_setup

    old = os.umask(0o022)
    try:
        setup = build_tiny_setup(tmp_path / "tiny")
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in setup.policy.iterdir() if p.is_file()}
    assert modes["model.safetensors"] == 0o644 and set(modes.values()) == {0o644}
