"""LoRA training end to end on a tiny local model (CPU): what is trained, what the reference is, what is
written, resume, and that eval/push loading takes the adapter."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rloo.config import RLOOConfig
from rloo.demo.tiny import build_tiny_setup
from rloo.demo.toy import write_toy_dataset
from rloo.errors import UserError
from rloo.models import MERGED_SUBDIR, load_causal_lm
from rloo.training import lora
from rloo.training.trainer import RLOOTrainer, train
from tests.fixtures import recipes

pytest.importorskip("peft")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory):
    return build_tiny_setup(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_toy_dataset(tmp_path_factory.mktemp("toy"))


def _cfg(setup, data: Path, out: Path, **kw) -> RLOOConfig:
    lora = {
        "learning_rate": 5e-2,
        "max_steps": 3,
        "seed": 3,
        "use_peft": True,
        "lora_r": 4,
        "lora_alpha": 8.0,
    }
    return recipes.config(setup, data, out, recipes.LEARNING, **{**lora, **kw})


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_only_adapters_train_and_the_reference_is_the_base(setup, data: Path, tmp_path: Path) -> None:
    trainer = RLOOTrainer(_cfg(setup, data, tmp_path / "out"))
    trainable, total = lora.parameter_counts(trainer.policy)
    assert trainer.ref_policy is None  # no second copy of the weights
    names = [n for n, p in trainer.policy.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n for n in names)
    assert trainable < total / 10
    result = trainer.train()
    assert all(math.isfinite(h["objective/kl"]) for h in result.history)
    assert result.history[-1]["objective/kl"] != 0.0  # the adapters moved away from the reference
    # the reference the KL was measured against is exactly the untouched base model
    base = load_causal_lm(str(setup.policy), flag="model_name_or_path").eval()
    ids = torch.tensor([[5, 17, 42, 9, 3]])
    trainer.policy.eval()
    with lora.adapter_disabled(trainer.policy) as ref:
        torch.testing.assert_close(_logits(ref, ids), _logits(base, ids))
    assert not torch.allclose(_logits(trainer.policy, ids), _logits(base, ids))


def test_output_is_the_adapter_and_eval_loading_merges_it(setup, data: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    train(_cfg(setup, data, out, merge_adapter=True))
    assert (out / "adapter_model.safetensors").is_file() and not (out / "model.safetensors").exists()
    adapter = load_file(str(out / "adapter_model.safetensors"))
    assert adapter and all("lora_" in k for k in adapter)
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(setup.policy)  # the durable base, loadable later
    assert (out / "training_complete.json").is_file()
    # what eval and push load: the adapter directory (merged on load) and the merged model agree
    ids = torch.tensor([[5, 17, 42, 9, 3]])
    from_adapter = load_causal_lm(str(out), flag="model_path").eval()
    merged = load_causal_lm(str(out / MERGED_SUBDIR), flag="model_path").eval()
    base = load_causal_lm(str(setup.policy), flag="model_name_or_path").eval()
    torch.testing.assert_close(_logits(from_adapter, ids), _logits(merged, ids), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(_logits(merged, ids), _logits(base, ids))


def test_checkpoints_hold_the_adapter_and_resume_exactly(setup, data: Path, tmp_path: Path, caplog) -> None:
    straight = tmp_path / "straight"
    train(_cfg(setup, data, straight, max_steps=4))
    split = tmp_path / "split"
    train(_cfg(setup, data, split, max_steps=4, save_steps=2))
    ckpt = split / "checkpoint-2"
    files = {p.name for p in ckpt.iterdir()}
    assert "adapter_model.safetensors" in files and "model.safetensors" not in files
    # drop the finished output and resume from the checkpoint of update 2
    for name in ("adapter_model.safetensors", "training_complete.json"):
        (split / name).unlink()
    lines = (split / "metrics.jsonl").read_text().splitlines()[:2]
    (split / "metrics.jsonl").write_text("".join(line + "\n" for line in lines))
    with caplog.at_level(logging.INFO, logger="rloo.training"):
        train(_cfg(setup, data, split, max_steps=4, save_steps=2))
    assert f"resumed from {ckpt} (update 2 of 4)" in caplog.text  # not a fresh start
    a, b = (
        load_file(str(straight / "adapter_model.safetensors")),
        load_file(str(split / "adapter_model.safetensors")),
    )
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=0, rtol=0)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"use_peft": False, "merge_adapter": True}, "--merge_adapter applies to LoRA training"),
        ({"use_peft": False, "load_in_4bit": True}, "--load_in_4bit applies to LoRA training"),
        ({"lora_r": 0}, "--lora_r must be >= 1"),
        ({"lora_dropout": 1.0}, r"--lora_dropout must be in \[0, 1\)"),
    ],
)
def test_bad_lora_flags_are_one_line_errors(setup, data: Path, tmp_path: Path, kw, match: str) -> None:
    with pytest.raises(UserError, match=match) as info:
        _cfg(setup, data, tmp_path / "out", **kw)
    assert "\n" not in str(info.value)


def test_unknown_target_module_and_4bit_on_cpu_are_one_line_errors(setup, data: Path, tmp_path: Path) -> None:
    with pytest.raises(UserError, match="--lora_target_modules"):
        RLOOTrainer(_cfg(setup, data, tmp_path / "a", lora_target_modules=["no_such_proj"]))
    if not torch.cuda.is_available():
        with pytest.raises(UserError, match="--load_in_4bit needs a CUDA GPU"):
            RLOOTrainer(_cfg(setup, data, tmp_path / "b", load_in_4bit=True))


def test_merged_weights_for_an_inference_engine(setup, data: Path, tmp_path: Path) -> None:
    # what the vLLM weight push hands over: base-checkpoint names, the adapter folded in, and the live
    # model unmerged again afterwards
    trainer = RLOOTrainer(_cfg(setup, data, tmp_path / "out", gradient_checkpointing=True, max_steps=2))
    trainer.train()
    model = trainer.policy.eval()
    ids = torch.tensor([[5, 17, 42, 9, 3]])
    before = _logits(model, ids)
    import copy

    reference = dict(copy.deepcopy(model).merge_and_unload().named_parameters())
    with lora.merged_weights(model) as weights:
        got = dict(weights)
        assert got.keys() == reference.keys()
        for name, tensor in got.items():
            torch.testing.assert_close(tensor, reference[name].data)
    torch.testing.assert_close(_logits(model, ids), before)  # unmerged: the adapter is live again


@pytest.mark.parametrize("merge", [False, True])
def test_push_publishes_a_lora_output_as_a_full_model(
    setup, data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, merge: bool
) -> None:
    from rloo.push import PushConfig, run_push
    from rloo.storage import read_manifest

    for name in ("MLFLOW_TRACKING_URI", "KFP_RUN_ID", "KFP_RUN_NAME", "HF_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    out = tmp_path / "out"
    train(_cfg(setup, data, out, merge_adapter=merge))
    result = run_push(
        PushConfig(
            model_path=str(out), output_dir=str(tmp_path / "push"), storage_uri=str(tmp_path / "store")
        )
    )
    version = tmp_path / "store" / result.run_key
    files = {f.path for f in read_manifest(version).files}
    # a full model (merged here, or as --merge_adapter wrote it), without the adapter files, which
    # transformers would apply on top of the merged weights a second time
    assert {"config.json", "model.safetensors", "rloo_config.json", "training_complete.json"} <= files
    assert not files & {"adapter_config.json", "adapter_model.safetensors"}
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([[5, 17, 42, 9, 3]])
    published = AutoModelForCausalLM.from_pretrained(str(version)).eval()
    trained = load_causal_lm(str(out), flag="model_path").eval()  # the adapter dir, merged on load
    torch.testing.assert_close(_logits(published, ids), _logits(trained, ids), atol=1e-5, rtol=1e-5)


def test_vllm_eval_takes_the_merged_model_of_a_lora_output(setup, data: Path, tmp_path: Path) -> None:
    from rloo.eval.generation import full_model_dir

    plain, merged = tmp_path / "plain", tmp_path / "merged"
    train(_cfg(setup, data, plain))
    train(_cfg(setup, data, merged, merge_adapter=True))
    assert full_model_dir(str(setup.policy), "model_name_or_path") == str(setup.policy)
    assert full_model_dir(str(merged), "model_name_or_path") == str(merged / MERGED_SUBDIR)
    with pytest.raises(UserError, match="--merge_adapter"):
        full_model_dir(str(plain), "model_name_or_path")
