"""Loading tokenizers and models from local directories, with one-line errors for bad ones."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from rloo.demo.tiny import EOS_TOKEN, PAD_TOKEN, TinySetup, build_tokenizer
from rloo.errors import UserError
from rloo.models import (
    check_finite_weights,
    check_model_source,
    check_safetensors_weights,
    disable_dropout,
    load_causal_lm,
    load_reward_model,
    load_tokenizer,
    local_model_dir,
)
from tests.fixtures.weights import corrupt_copy


def test_load_tokenizer_sets_pad_to_eos_when_missing(tiny_setup: TinySetup) -> None:
    tok = load_tokenizer(str(tiny_setup.policy))
    assert tok.eos_token == EOS_TOKEN
    assert tok.pad_token == EOS_TOKEN and tok.pad_token_id == tok.eos_token_id
    assert tok.padding_side == "left"  # generation pads on the left


def test_load_tokenizer_keeps_an_existing_pad_token(tmp_path: Path) -> None:
    build_tokenizer(tmp_path / "tok", with_pad_token=True)
    (tmp_path / "tok" / "config.json").write_text("{}")  # only checked for presence by load_tokenizer
    tok = load_tokenizer(str(tmp_path / "tok"))
    assert tok.pad_token == PAD_TOKEN and tok.pad_token_id != tok.eos_token_id


def test_load_causal_lm(tiny_setup: TinySetup) -> None:
    model = load_causal_lm(str(tiny_setup.policy), flag="model_name_or_path")
    assert model.dtype == torch.float32
    assert all(m.p == 0.0 for m in model.modules() if isinstance(m, torch.nn.Dropout))


def test_disable_dropout() -> None:
    net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.5), torch.nn.Dropout(0.1))
    disable_dropout(net)
    assert [m.p for m in net.modules() if isinstance(m, torch.nn.Dropout)] == [0.0, 0.0]
    x = torch.ones(4, 2)
    net.train()
    torch.testing.assert_close(net(x), net[0](x))


def test_load_reward_model(tiny_setup: TinySetup) -> None:
    model, tok = load_reward_model(str(tiny_setup.reward_model))
    assert tok.padding_side == "right"
    assert tok.pad_token_id == tok.eos_token_id == model.config.pad_token_id
    assert not model.training
    assert not any(p.requires_grad for p in model.parameters())


def _corrupt_copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    (dst / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a safetensors header")
    return dst


def _refusal(which: str, path: Path, *, policy_flag: str) -> tuple[str, str]:
    """(the UserError's message, the flag it must name) of loading ``path`` as a policy or reward model."""
    with pytest.raises(UserError) as info:
        if which == "policy":
            load_causal_lm(str(path), flag=policy_flag)
        else:
            load_reward_model(str(path))
    return str(info.value), f"--{policy_flag}" if which == "policy" else "--reward_model_path"


@pytest.mark.parametrize("which", ["policy", "reward_model"])
def test_corrupt_model_dir_is_a_one_line_user_error(
    tmp_path: Path, tiny_setup: TinySetup, which: str
) -> None:
    bad = _corrupt_copy(getattr(tiny_setup, which), tmp_path / "bad")
    msg, flag = _refusal(which, bad, policy_flag="sft_model_path")
    assert msg.startswith(f"{flag} {bad}: cannot load it")
    assert "save_pretrained" in msg
    assert "\n" not in msg


def test_missing_or_incomplete_model_dir(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="no such directory"):
        load_causal_lm(str(tmp_path / "absent"), flag="model_name_or_path")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match=r"--model_name_or_path .*no config.json"):
        load_tokenizer(str(tmp_path / "empty"))
    with pytest.raises(UserError, match=r"--reward_model_path .*no config.json"):
        load_reward_model(str(tmp_path / "empty"))


def test_one_rule_for_a_local_model_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """local_model_dir decides for the loader and for push: a save_pretrained output, or a LoRA adapter
    unless the caller needs a full model; every refusal one line naming the argument, with the caller's hint."""
    monkeypatch.chdir(tmp_path)
    full, adapter, empty = (tmp_path / n for n in ("full", "adapter", "empty"))
    for d in (full, adapter, empty):
        d.mkdir()
    (full / "config.json").write_text("{}")
    (adapter / "adapter_config.json").write_text("{}")
    assert local_model_dir("model_path", "./full") == Path("full")
    assert local_model_dir("model_path", f"file://{full}") == full
    assert local_model_dir("model_path", str(adapter)) == adapter
    with pytest.raises(UserError, match=r"^--m adapter: not a model directory \(no config\.json\); hint\.$"):
        local_model_dir("m", "adapter", adapter=False, hint="hint")
    with pytest.raises(UserError, match=r"^--m empty: not a model directory \(no config\.json or adapter"):
        local_model_dir("m", "empty")
    with pytest.raises(UserError, match=r"^--m gpt2: no such directory; hint\.$"):
        local_model_dir("m", "gpt2", hint="hint")  # the caller wants a directory: a Hub id is none
    with pytest.raises(UserError, match=r"^--m s3://b/p: an s3:// prefix, not a local directory"):
        local_model_dir("m", "s3://b/p")
    # the loader's check applies it to local paths only
    check_model_source("model_name_or_path", str(adapter))
    check_model_source("model_name_or_path", "gpt2")
    with pytest.raises(UserError, match="not a model directory"):
        check_model_source("model_name_or_path", str(empty))


def test_garbage_config_is_a_user_error(tmp_path: Path, tiny_setup: TinySetup) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(tiny_setup.policy, bad)
    (bad / "config.json").write_text("{ this is not json")
    with pytest.raises(UserError) as info:
        load_causal_lm(str(bad), flag="model_name_or_path")
    assert "cannot load it" in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("byte", [0x7F, 0xFF])  # 3.39e38 (finite, overflowing) and NaN in float32
@pytest.mark.parametrize("which", ["policy", "reward_model"])
def test_non_finite_weights_are_refused_naming_path_and_tensor(
    tmp_path: Path, tiny_setup: TinySetup, which: str, byte: int
) -> None:
    # the header is intact, so transformers loads these bytes without complaint
    bad = corrupt_copy(getattr(tiny_setup, which), tmp_path / "bad", byte)
    msg, flag = _refusal(which, bad, policy_flag="model_name_or_path")
    assert msg.startswith(f"{flag} {bad}: tensor '"), msg
    assert ("NaN" if byte == 0xFF else "magnitude 3.4e+38") in msg
    assert "corrupt" in msg and "\n" not in msg


def test_check_safetensors_weights_names_the_file_and_tensor(tmp_path: Path, tiny_setup: TinySetup) -> None:
    check_safetensors_weights(tiny_setup.policy, flag="model_path")  # a sound model passes
    bad = corrupt_copy(tiny_setup.policy, tmp_path / "bad")
    with pytest.raises(
        UserError, match=r"^--model_path .*bad: tensor 'model.safetensors:[\w.]+' holds a value"
    ):
        check_safetensors_weights(bad, flag="model_path")


def test_large_but_sane_weights_pass() -> None:
    net = torch.nn.Linear(2, 2)
    with torch.no_grad():
        net.weight.fill_(1e6)
    check_finite_weights(net, flag="model_name_or_path", path="/m")
    with torch.no_grad():
        net.bias[0] = float("inf")
    with pytest.raises(UserError, match=r"tensor 'bias' holds inf"):
        check_finite_weights(net, flag="model_name_or_path", path="/m")


def test_a_causal_lm_given_as_reward_model_is_refused(tiny_setup: TinySetup) -> None:
    """transformers ``modeling_utils.py`` (``_load_pretrained_model``) initialises every weight a checkpoint
    lacks at random and only reports it (``missing_keys``): a causal LM loaded as a sequence classifier
    gets a random ``score`` head, and a run on it would train towards noise."""
    from rloo.models import load_reward_model

    with pytest.raises(UserError, match=r"^reward_model_path .*: its checkpoint has no score\.weight"):
        load_reward_model(str(tiny_setup.policy))
    model, _ = load_reward_model(str(tiny_setup.reward_model))  # a trained one loads
    assert model.config.num_labels == 1
