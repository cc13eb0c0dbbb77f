"""The shipped accelerate configs: each loads with accelerate's own loader and launches what it says.

The GPU configs cannot launch here (no GPU, no DeepSpeed), so for DeepSpeed the launcher's own
argument handling turns each file into the environment a launched process would see, and the
``DeepSpeedPlugin`` built from that environment (what the trainer's ``Accelerator`` gets) is checked. The
CPU config really launches two processes that all-reduce over gloo.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

import pytest
from accelerate.commands.config.config_args import ClusterConfig, load_config_from_file
from accelerate.utils import DistributedType

from rloo.training import deepspeed_utils
from tests.fixtures import recipes, zygote

CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "accelerate"
GPU_CONFIGS = {
    "multi_gpu.yaml": (DistributedType.MULTI_GPU, None),
    "deepspeed_zero2.yaml": (DistributedType.DEEPSPEED, 2),
    "deepspeed_zero3.yaml": (DistributedType.DEEPSPEED, 3),
}


def _load(name: str) -> ClusterConfig:
    config = load_config_from_file(str(CONFIGS / name))
    assert isinstance(config, ClusterConfig)  # a local-machine config, not a SageMaker one
    return config


def test_every_shipped_config_is_tested() -> None:
    assert {p.name for p in CONFIGS.glob("*.yaml")} == {*GPU_CONFIGS, "cpu_2proc.yaml"}


@pytest.mark.parametrize("name", sorted(GPU_CONFIGS))
def test_gpu_configs_load_with_expected_type(name: str) -> None:
    distributed_type, stage = GPU_CONFIGS[name]
    config = _load(name)
    assert config.distributed_type == distributed_type
    assert config.mixed_precision == "bf16"
    assert config.num_processes == 8
    assert config.num_machines == 1
    assert not config.use_cpu
    if stage is None:
        assert not config.deepspeed_config
    else:
        assert config.deepspeed_config["zero_stage"] == stage
        assert config.deepspeed_config["offload_optimizer_device"] == "none"
        assert config.deepspeed_config["offload_param_device"] == "none"


def test_zero3_config_inits_sharded_and_saves_16bit() -> None:
    ds = _load("deepspeed_zero3.yaml").deepspeed_config
    assert ds["zero3_init_flag"] is True
    assert ds["zero3_save_16bit_model"] is True
    assert _load("deepspeed_zero2.yaml").deepspeed_config["zero3_init_flag"] is False


def _deepspeed_launch_env(name: str) -> dict[str, str]:
    """The ACCELERATE_* variables ``accelerate launch --config_file name`` gives each DeepSpeed process."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import prepare_deepspeed_cmd_env

    args = launch_command_parser().parse_args(["--config_file", str(CONFIGS / name), "train.py"])
    args, defaults, _ = _validate_launch_command(args)
    assert args.use_deepspeed
    # launch_command sets this before choosing the launcher; mirrored here
    args.deepspeed_fields_from_accelerate_config = ",".join([*defaults.deepspeed_config, "mixed_precision"])
    _, env = prepare_deepspeed_cmd_env(args)
    return {k: v for k, v in env.items() if k.startswith("ACCELERATE_")}


@pytest.mark.parametrize(("name", "stage"), [("deepspeed_zero2.yaml", 2), ("deepspeed_zero3.yaml", 3)])
def test_deepspeed_configs_reach_the_plugin(name: str, stage: int) -> None:
    from accelerate.utils import DeepSpeedPlugin

    env = _deepspeed_launch_env(name)
    assert env["ACCELERATE_MIXED_PRECISION"] == "bf16"
    with mock.patch.dict(os.environ, env):
        plugin = DeepSpeedPlugin()
    assert plugin.zero_stage == stage
    assert plugin.deepspeed_config["zero_optimization"]["stage"] == stage
    if stage == 3:
        assert plugin.zero3_init_flag
        assert plugin.deepspeed_config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"]

    # what the trainer's helpers make of it
    accelerator: Any = SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=plugin), num_processes=8)
    assert deepspeed_utils.zero_stage(accelerator) == stage
    assert deepspeed_utils.is_zero3(accelerator) is (stage == 3)
    # accelerate cannot infer the micro-batch without a dataloader: the trainer fills it from its flags
    assert plugin.deepspeed_config["train_micro_batch_size_per_gpu"] == "auto"
    deepspeed_utils.fill_deepspeed_config(
        accelerator, micro_batch_size=4, gradient_accumulation_steps=2, max_grad_norm=1.0
    )
    assert plugin.deepspeed_config["train_micro_batch_size_per_gpu"] == 4
    assert plugin.deepspeed_config["gradient_accumulation_steps"] == 2
    assert plugin.deepspeed_config["train_batch_size"] == 4 * 2 * 8
    assert plugin.deepspeed_config["gradient_clipping"] == 1.0


def test_cpu_config_launches_two_gloo_processes(tmp_path: Path) -> None:
    config = _load("cpu_2proc.yaml")
    assert config.num_processes == 2
    script = tmp_path / "allreduce.py"
    script.write_text(
        textwrap.dedent(
            """
            import torch
            import torch.distributed as dist
            from accelerate import Accelerator

            acc = Accelerator()
            t = torch.tensor([acc.process_index + 1.0])
            dist.all_reduce(t)  # 1 + 2 over two ranks
            print(f"rank={acc.process_index} world={acc.num_processes} backend={dist.get_backend()} "
                  f"device={acc.device.type} sum={t.item():g}", flush=True)
            # Exiting with a live gloo group sometimes aborts in its threads' teardown ("terminate called
            # without an active exception"); tearing the group down first is what every launched script needs.
            acc.end_training()
            """
        )
    )
    accelerate = Path(sys.executable).with_name("accelerate")
    env = {
        **os.environ,
        "ACCELERATE_USE_CPU": "true",
        "OMP_NUM_THREADS": "1",
        "CUDA_VISIBLE_DEVICES": "",
        "PYTHONWARNINGS": "ignore",
    }
    proc = subprocess.run(
        [str(accelerate), "launch", "--config_file", str(CONFIGS / "cpu_2proc.yaml"), str(script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # both ranks write to one pipe, so their lines may interleave: match the reports, not lines
    reports = sorted(re.findall(r"rank=\d+ world=\d+ backend=\w+ device=\w+ sum=\d+", proc.stdout))
    assert reports == [
        "rank=0 world=2 backend=gloo device=cpu sum=3",
        "rank=1 world=2 backend=gloo device=cpu sum=3",
    ]


# ------------------------------------------------------------------------------------------------------
# rloo.training.deepspeed_utils: the decisions, with stand-in accelerator states (and real DeepSpeed below,
# where it is installed)
def _accelerator(stage: int | None) -> Any:
    plugin = None
    if stage is not None:
        plugin = SimpleNamespace(zero_stage=stage, deepspeed_config={"zero_optimization": {"stage": stage}})
    return SimpleNamespace(
        state=SimpleNamespace(deepspeed_plugin=plugin),
        num_processes=2,
        device="cpu",
        unwrap_model=lambda m: getattr(m, "module", m),
    )


class _FakeGathered:
    calls: list[int]

    def __init__(self, params: list[Any], modifier_rank: int | None = None) -> None:
        assert modifier_rank is None  # read-only gather: nothing written back into the shards
        _FakeGathered.calls.append(len(params))

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


@pytest.fixture
def fake_deepspeed(monkeypatch: pytest.MonkeyPatch) -> type[_FakeGathered]:
    _FakeGathered.calls = []
    module = SimpleNamespace(zero=SimpleNamespace(GatheredParameters=_FakeGathered))
    monkeypatch.setitem(sys.modules, "deepspeed", module)
    return _FakeGathered


@pytest.fixture
def no_deepspeed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # any `import deepspeed` raises ImportError


def _engine() -> Any:
    """A stand-in DeepSpeed engine with ZeRO-3 hooks on its optimizer's parameter offload."""
    import torch

    module = torch.nn.Linear(3, 3)
    removed: list[str] = []
    hooks = [SimpleNamespace(remove=lambda n=n: removed.append(n)) for n in ("fwd", "bwd")]
    coordinator = SimpleNamespace(invalidated=0, is_invalid_trace=lambda: False)
    coordinator._invalidate_trace = lambda: setattr(coordinator, "invalidated", coordinator.invalidated + 1)
    offload = SimpleNamespace(
        module=module, forward_hooks=[hooks[0]], backward_hooks=[hooks[1]], param_coordinator=coordinator
    )
    offload._register_deepspeed_module = lambda m: offload.forward_hooks.append("re-registered")
    return SimpleNamespace(
        module=module,
        optimizer=SimpleNamespace(parameter_offload=offload),
        parameters=module.parameters,
        removed=removed,
        offload=offload,
    )


@pytest.mark.parametrize(("stage", "enabled"), [(None, True), (2, True), (3, False)])
def test_gather_is_a_no_op_unless_zero3_and_enabled(
    no_deepspeed: None, stage: int | None, enabled: bool
) -> None:
    acc = _accelerator(stage)
    engine = _engine()
    with deepspeed_utils.gather_for_generation(engine, acc, enabled):
        pass
    with deepspeed_utils.unwrap_for_generation(engine, acc, gather=enabled) as bare:
        assert bare is engine.module
    with deepspeed_utils.gathered([1, 2], acc, enabled=enabled):
        pass
    assert engine.removed == []


def test_gather_under_zero3_gathers_everything_and_restores_hooks(
    fake_deepspeed: type[_FakeGathered],
) -> None:
    acc, engine = _accelerator(3), _engine()
    with deepspeed_utils.unwrap_for_generation(engine, acc, gather=True) as bare:
        assert bare is engine.module
        assert fake_deepspeed.calls == [2]  # weight and bias in one gather
        assert engine.removed == ["fwd", "bwd"]  # the per-module fetch/release hooks are off while whole
        assert engine.offload.forward_hooks == []
    assert engine.offload.forward_hooks == ["re-registered"]
    assert engine.offload.param_coordinator.invalidated == 1
    with deepspeed_utils.gathered(list(engine.parameters()), acc):
        pass
    assert fake_deepspeed.calls == [2, 2]


def test_gather_before_the_first_step_has_no_hooks_to_move(fake_deepspeed: type[_FakeGathered]) -> None:
    engine = _engine()
    del engine.optimizer  # a fresh engine has no optimizer attribute yet
    with deepspeed_utils.gather_for_generation(engine, _accelerator(3), True):
        pass
    assert fake_deepspeed.calls == [2]


def test_synced_generation_steps_only_for_sharded_zero3() -> None:
    for stage, gather, expected in [
        (None, False, False),
        (2, False, False),
        (3, True, False),
        (3, False, True),
    ]:
        assert deepspeed_utils.generation_needs_synced_steps(_accelerator(stage), gather=gather) is expected


def test_helpers_without_deepspeed_leave_things_alone(no_deepspeed: None) -> None:
    import torch

    acc = _accelerator(None)
    assert deepspeed_utils.zero_stage(acc) == 0
    assert not deepspeed_utils.is_deepspeed(acc)
    deepspeed_utils.fill_deepspeed_config(
        acc, micro_batch_size=2, gradient_accumulation_steps=1, max_grad_norm=1
    )
    ref = torch.nn.Linear(2, 2)
    assert deepspeed_utils.prepare_reference_model(ref, acc) is ref  # .to(cpu) of a CPU module
    assert deepspeed_utils.prepare_reference_model(ref, _accelerator(2)) is ref  # ZeRO-2: a plain copy
    # a bare object without accelerate state counts as "no DeepSpeed"
    assert deepspeed_utils.zero_stage(SimpleNamespace()) == 0


_REAL_ZERO3 = """
import os, sys, torch
for k, v in dict(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0").items():
    os.environ.setdefault(k, v)
from accelerate import Accelerator, DeepSpeedPlugin
from rloo.training import deepspeed_utils
from rloo.generation import SamplingParams, TransformersGenerator, left_pad, row_seeds
from rloo.models import load_causal_lm

# the full weights, loaded before any ZeRO-3 state exists (transformers loads sharded under ZeRO-3)
plain = load_causal_lm(sys.argv[1], flag="model_name_or_path")
full = dict(plain.named_parameters())
x = torch.tensor([[5, 6, 7, 8]])
with torch.no_grad():
    expected_logits = plain(input_ids=x).logits
acc = Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=3, zero3_init_flag=True))
assert deepspeed_utils.is_zero3(acc)
deepspeed_utils.fill_deepspeed_config(acc, micro_batch_size=2, gradient_accumulation_steps=1, max_grad_norm=1.0)
policy = load_causal_lm(sys.argv[1], flag="model_name_or_path")
opt = torch.optim.AdamW(policy.parameters(), lr=1e-3)
policy, opt = acc.prepare(policy, opt)
bare = acc.unwrap_model(policy)
assert bare.get_input_embeddings().weight.numel() == 0, "expected sharded (empty) local weights"
ids, mask = left_pad([[5, 6, 7], [8, 9]], 0)
params = SamplingParams(max_new_tokens=6, temperature=1.0, pad_token_id=0)
seeds = row_seeds(0, 0, torch.tensor([0, 1]), 2)
gen = TransformersGenerator(bare, batch_size=4)
with deepspeed_utils.unwrap_for_generation(policy, acc, gather=True) as m:
    assert m is bare
    assert all(torch.equal(p, full[n]) for n, p in m.named_parameters()), "gathered weights differ"
    whole = gen.generate(ids, mask, 2, params, seeds).tokens
sharded = gen.generate(ids, mask, 2, params, seeds).tokens  # generate from the shards: hooks gather per layer
assert torch.equal(whole, sharded), (whole, sharded)
# the frozen reference, loaded sharded under ZeRO-3 like the policy, runs once placed by the helper
ref = deepspeed_utils.prepare_reference_model(load_causal_lm(sys.argv[1], flag="model_name_or_path"), acc)
with torch.no_grad():
    assert torch.allclose(ref(input_ids=x).logits, expected_logits, atol=1e-5)
policy.train()
loss = policy(input_ids=torch.tensor([[5, 6, 7, 8]]), labels=torch.tensor([[5, 6, 7, 8]])).loss
acc.backward(loss)  # training still works after the hooks came back
opt.step()
print("ZERO3-OK", tuple(whole.shape))
"""


def test_zero3_gather_with_real_deepspeed(tmp_path: Path, tiny_setup: Any) -> None:
    pytest.importorskip("deepspeed")
    script = tmp_path / "zero3.py"
    script.write_text(_REAL_ZERO3)
    env = recipes.subprocess_env(MASTER_PORT=str(_free_port()))
    proc = zygote.run([str(script), str(tiny_setup.policy)], env=env, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "ZERO3-OK (4, 6)" in proc.stdout


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
