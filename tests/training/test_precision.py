"""Which models run in the compute dtype: the rollout copy's dtype and the reference's."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from accelerate.utils import DistributedType

from rloo.errors import UserError
from rloo.training.precision import cast_parameters, half_dtype, reference_dtype, rollout_copy_dtype


def _acc(mixed: str = "bf16", device: str = "cuda", deepspeed: bool = False) -> SimpleNamespace:
    # accelerate's Accelerator cannot be built for CUDA here: the three attributes the rules read
    kind = DistributedType.DEEPSPEED if deepspeed else DistributedType.NO
    return SimpleNamespace(mixed_precision=mixed, device=torch.device(device), distributed_type=kind)


def test_half_dtype_follows_the_mixed_precision() -> None:
    assert half_dtype(_acc("bf16")) is torch.bfloat16
    assert half_dtype(_acc("fp16")) is torch.float16
    assert half_dtype(_acc("no")) is None


@pytest.mark.parametrize(
    ("acc", "lora", "expected"),
    [
        (_acc("bf16"), False, torch.bfloat16),  # the case it exists for: a GPU run in bf16
        (_acc("fp16"), False, None),  # pure fp16 activations can overflow: opt in with 'float16'
        (_acc("no"), False, None),  # fp32 training samples from its fp32 weights
        (_acc("bf16", device="cpu"), False, None),  # CPU: nothing to gain from a second copy in memory
        (_acc("bf16", deepspeed=True), False, None),  # ZeRO holds (or shards) the policy itself
        (_acc("bf16"), True, None),  # LoRA: the base would be held twice
    ],
)
def test_auto_copies_only_where_it_pays(
    acc: SimpleNamespace, lora: bool, expected: torch.dtype | None
) -> None:
    policy = SimpleNamespace(peft_config={}) if lora else SimpleNamespace()
    assert rollout_copy_dtype("auto", acc, policy) is expected


def test_an_explicit_choice_is_taken_and_refused_under_deepspeed() -> None:
    cpu = _acc("no", device="cpu")
    assert rollout_copy_dtype("bfloat16", cpu, object()) is torch.bfloat16
    assert rollout_copy_dtype("float16", cpu, object()) is torch.float16
    assert rollout_copy_dtype("policy", _acc("bf16"), object()) is None
    with pytest.raises(UserError, match="leave --generation_dtype auto under DeepSpeed"):
        rollout_copy_dtype("bfloat16", _acc("bf16", deepspeed=True), object())


def test_a_real_cpu_accelerator_keeps_the_policy() -> None:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=False)
    try:
        acc = Accelerator(mixed_precision="bf16", cpu=True)
        assert half_dtype(acc) is torch.bfloat16
        assert rollout_copy_dtype("auto", acc, object()) is None
        assert reference_dtype(acc, moving=False) is None
    finally:
        AcceleratorState._reset_state(reset_partial_state=False)


def test_the_reference_is_held_in_the_compute_dtype_unless_it_moves() -> None:
    assert reference_dtype(_acc("bf16"), moving=False) is torch.bfloat16
    assert reference_dtype(_acc("fp16"), moving=False) is None  # fp16 activations could overflow
    assert reference_dtype(_acc("bf16"), moving=True) is None  # --sync_ref_model: its small steps need fp32
    assert reference_dtype(_acc("bf16", deepspeed=True), moving=False) is None
    assert reference_dtype(_acc("no"), moving=False) is None
    assert reference_dtype(_acc("bf16", device="cpu"), moving=False) is None


def test_cast_parameters_leaves_the_rotary_frequencies_in_fp32(tmp_path) -> None:
    # model.to(bf16) would round inv_freq too: Qwen2's 0.6494 becomes 0.6484, half a radian by position 500
    from rloo.demo.tiny import build_causal_lm, build_tokenizer
    from rloo.models import load_causal_lm

    build_tokenizer(tmp_path / "tok")
    model = load_causal_lm(str(build_causal_lm(tmp_path / "lm", tmp_path / "tok", arch="qwen2")), flag="m")
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    assert any(b.dtype == torch.float32 for b in buffers.values())
    cast_parameters(model, torch.bfloat16)
    for name, p in model.named_parameters():
        assert p.dtype == torch.bfloat16 and torch.equal(p, weights[name].to(torch.bfloat16)), name
    for name, b in model.named_buffers():
        assert b.dtype == buffers[name].dtype and torch.equal(b, buffers[name]), name


def test_lm_head_in_fp32_under_bf16(tmp_path) -> None:
    """--cast_lm_head_to_fp32 (TRL's grpo_trainer.py ``_cast_lm_head_to_fp32``): the logits come out in fp32
    under a bf16 autocast and from bf16 weights, closer to an fp32 model's; the weights keep dtype and names,
    and a deep copy (the rollout copy) computes its head in fp32 too."""
    import copy

    from rloo.demo.tiny import build_causal_lm, build_tokenizer
    from rloo.models import load_causal_lm
    from rloo.training.precision import lm_head_in_fp32

    build_tokenizer(tmp_path / "tok")
    path = str(build_causal_lm(tmp_path / "lm", tmp_path / "tok", arch="qwen2"))
    ids = torch.tensor([[1, 5, 9, 3, 7, 2]])
    reference = load_causal_lm(path, flag="m")
    with torch.no_grad():
        exact = reference(input_ids=ids).logits.log_softmax(-1)  # (1, 6, V) fp32 throughout
    plain, cast = load_causal_lm(path, flag="m"), load_causal_lm(path, flag="m")
    names = [n for n, _ in cast.named_parameters()]
    lm_head_in_fp32(cast)
    assert [n for n, _ in cast.named_parameters()] == names
    for model in (plain, cast):
        cast_parameters(model, torch.bfloat16)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        low = plain(input_ids=ids).logits
        high = cast(input_ids=ids).logits
        copied = copy.deepcopy(cast)(input_ids=ids).logits
    assert low.dtype == torch.bfloat16 and high.dtype == torch.float32 and copied.dtype == torch.float32
    err_low = (low.float().log_softmax(-1) - exact).abs().max()
    err_high = (high.log_softmax(-1) - exact).abs().max()
    assert err_high < err_low, (err_high, err_low)
    assert cast.get_output_embeddings().weight.dtype == torch.bfloat16  # the weights as they were


def test_lm_head_in_fp32_refuses_an_adapted_head() -> None:
    class Adapted(torch.nn.Linear):
        pass

    from rloo.training.precision import lm_head_in_fp32

    model = SimpleNamespace(get_output_embeddings=lambda: Adapted(2, 3))
    with pytest.raises(
        UserError, match=r"needs a plain linear LM head \(got Adapted\).*--lora_target_modules"
    ):
        lm_head_in_fp32(model)
