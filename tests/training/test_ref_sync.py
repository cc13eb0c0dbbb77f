"""Reference-model sync (--sync_ref_model): the mix, its schedule, ZeRO-3 gathering (DeepSpeed stood in for)
and the moved reference surviving a checkpoint and resume."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest
import torch

from rloo.errors import UserError
from rloo.models import load_causal_lm, load_tokenizer
from rloo.storage.manifest import write_manifest
from rloo.training import ref_sync
from rloo.training.checkpoint import MANIFEST, checkpoint_problem
from rloo.training.checkpoint_manager import CheckpointManager
from rloo.training.ref_sync import matched_parameters, mix_into, should_sync, sync_reference
from tests.fixtures.checkpoints import manager_config


class Toy(torch.nn.Module):
    def __init__(self, a: list[float], b: list[list[float]], *, b_first: bool = False) -> None:
        super().__init__()
        if b_first:  # the same names registered in the other order
            self.b = torch.nn.Parameter(torch.tensor(b))
            self.a = torch.nn.Parameter(torch.tensor(a))
        else:
            self.a = torch.nn.Parameter(torch.tensor(a))
            self.b = torch.nn.Parameter(torch.tensor(b))


def _toys(**policy_kw: Any) -> tuple[Toy, Toy]:
    return Toy([1.0, 2.0], [[4.0], [8.0]]), Toy([3.0, 6.0], [[0.0], [16.0]], **policy_kw)


@pytest.mark.parametrize(
    ("alpha", "a", "b"),
    [
        # ref + alpha * (policy - ref), by hand:
        (0.25, [1.5, 3.0], [[3.0], [10.0]]),  # a: 1 + .25*2, 2 + .25*4; b: 4 + .25*(-4), 8 + .25*8
        (0.75, [2.5, 5.0], [[1.0], [14.0]]),  # a: 1 + .75*2, 2 + .75*4; b: 4 + .75*(-4), 8 + .75*8
        (0.0, [1.0, 2.0], [[4.0], [8.0]]),  # never moves
        (1.0, [3.0, 6.0], [[0.0], [16.0]]),  # becomes the policy
    ],
)
def test_mix_by_hand(alpha: float, a: list[float], b: list[list[float]]) -> None:
    ref, policy = _toys(b_first=True)  # paired by name, not position
    mix_into(ref, policy, alpha)
    assert torch.equal(ref.a, torch.tensor(a)) and torch.equal(ref.b, torch.tensor(b))
    assert torch.equal(policy.a, torch.tensor([3.0, 6.0])) and torch.equal(
        policy.b, torch.tensor([[0.0], [16.0]])
    )
    assert ref.a.grad is None  # under no_grad: nothing recorded


def test_mix_at_the_default_alpha_is_the_formula_in_the_references_dtype() -> None:
    ref, policy = _toys()
    ref.to(torch.bfloat16)  # an fp32 policy (mixed precision keeps fp32 weights) into a bf16 reference
    expected = {
        n: (0.6 * policy.get_parameter(n).double() + 0.4 * p.double()) for n, p in ref.named_parameters()
    }
    mix_into(ref, policy, 0.6)
    for n, p in ref.named_parameters():
        assert p.dtype == torch.bfloat16
        assert torch.allclose(p.double(), expected[n], rtol=1e-2), (n, p, expected[n])


def test_mismatched_models_are_refused_naming_the_first_difference() -> None:
    ref, _ = _toys()
    other = Toy([3.0, 6.0], [[0.0], [16.0]])
    other.register_parameter("c", torch.nn.Parameter(torch.zeros(1)))
    with pytest.raises(ValueError, match=r"^the policy has parameter 'c', which the reference lacks$"):
        mix_into(ref, other, 0.5)
    with pytest.raises(ValueError, match=r"^the reference has parameter 'c', which the policy lacks$"):
        mix_into(other, ref, 0.5)
    wide = Toy([3.0, 6.0, 9.0], [[0.0], [16.0]])
    with pytest.raises(
        ValueError, match=r"^parameter 'a' has shape \[2\] in the reference but \[3\] in the policy$"
    ):
        mix_into(ref, wide, 0.5)
    assert torch.equal(ref.a, torch.tensor([1.0, 2.0]))  # refused before anything moved
    with pytest.raises(ValueError, match="within"):
        mix_into(ref, _toys()[1], 1.5)


def test_sync_schedule() -> None:
    assert [u for u in range(10) if should_sync(u, 3)] == [2, 5, 8]  # after the 3rd, 6th, 9th update
    assert [u for u in range(3) if should_sync(u, 1)] == [0, 1, 2]
    assert [u for u in range(1024) if should_sync(u, 512)] == [511, 1023]
    assert not any(should_sync(u, 0) for u in range(5))


# ------------------------------------------------------------------------------------------------------
# real (tiny) models
@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from rloo.demo.tiny import build_tiny_setup

    # qwen2 ties lm_head to the embeddings: a tied weight is mixed once, and saved once
    return build_tiny_setup(tmp_path_factory.mktemp("qwen2"), arch="qwen2")


def _models(setup: Any) -> tuple[Any, Any]:
    ref = load_causal_lm(str(setup.policy), flag="model_name_or_path")
    policy = load_causal_lm(str(setup.policy), flag="model_name_or_path")
    with torch.no_grad():
        for i, p in enumerate(policy.parameters()):
            p.add_(0.5 + i)  # the policy has moved away from the reference
    return ref, policy


def _accelerator() -> Any:
    from accelerate import Accelerator

    return Accelerator(cpu=True)


def test_sync_reference_on_real_models_mixes_each_weight_once(setup: Any) -> None:
    ref, policy = _models(setup)
    assert ref.get_input_embeddings().weight is ref.get_output_embeddings().weight  # tied
    before = {n: p.clone() for n, p in ref.named_parameters()}
    acc = _accelerator()
    sync_reference(ref, acc.prepare(policy), 0.25, accelerator=acc, deepspeed=False)
    for n, p in ref.named_parameters():
        expected = before[n] + 0.25 * (policy.get_parameter(n) - before[n])
        assert torch.allclose(p, expected, atol=1e-6), n


class _FakeGathered:
    """deepspeed.zero.GatheredParameters stand-in: the weights are whole already; records each gather."""

    calls: ClassVar[list[tuple[tuple[str, ...], int | None]]] = []
    names: ClassVar[dict[int, str]] = {}

    def __init__(self, params: list[Any], modifier_rank: int | None = None) -> None:
        _FakeGathered.calls.append((tuple(self.names[id(p)] for p in params), modifier_rank))

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def test_zero3_gathers_one_module_at_a_time_and_writes_back_the_reference_only(
    setup: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    ref, policy = _models(setup)
    before = {n: p.clone() for n, p in ref.named_parameters()}
    _FakeGathered.calls = []
    _FakeGathered.names = {
        **{id(p): f"policy:{n}" for n, p in policy.named_parameters()},
        **{id(p): f"ref:{n}" for n, p in ref.named_parameters()},
    }
    monkeypatch.setitem(
        sys.modules, "deepspeed", SimpleNamespace(zero=SimpleNamespace(GatheredParameters=_FakeGathered))
    )
    plugin = SimpleNamespace(deepspeed_config={"zero_optimization": {"stage": 3}})
    acc = SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=plugin), unwrap_model=lambda m: m)
    sync_reference(ref, policy, 0.5, accelerator=acc, deepspeed=True)
    names = [n for n, _ in ref.named_parameters()]
    gathered = [c for c in _FakeGathered.calls if c[0]]
    assert [c[1] for c in gathered] == [None, 0] * (len(gathered) // 2)  # policy read-only, reference written
    assert [n.removeprefix("ref:") for names_, _ in gathered[1::2] for n in names_] == names  # each once
    assert all(len({n.rpartition(".")[0] for n in names_}) == 1 for names_, _ in gathered)  # one module each
    assert [n.removeprefix("policy:") for c in gathered[0::2] for n in c[0]] == names
    for n, p in ref.named_parameters():
        assert torch.allclose(p, (before[n] + policy.get_parameter(n)) / 2, atol=1e-6), n


# ------------------------------------------------------------------------------------------------------
# checkpoint and resume
def _manager(
    setup: Any, out: Path, *, reference: Any, resume: str = "latest"
) -> tuple[CheckpointManager, Any]:
    ref, policy = _models(setup)
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    cfg = manager_config(resume)
    acc = _accelerator()
    manager = CheckpointManager(
        accelerator=acc,
        cfg=cfg,
        policy=policy,
        optimizer=opt,
        scheduler=torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0),
        tokenizer=load_tokenizer(str(setup.policy)),
        num_updates=8,
        trainer_state=lambda u: {"update": u, "num_updates": 8},
        reference=ref if reference == "yes" else None,
    )
    return manager, ref


def test_checkpoint_carries_the_moved_reference_and_resume_restores_it_exactly(
    setup: Any, tmp_path: Path
) -> None:
    manager, ref = _manager(setup, tmp_path, reference="yes")
    sync_reference(ref, manager.policy, 0.6, accelerator=manager.accelerator, deepspeed=False)
    moved = {k: v.clone() for k, v in ref.state_dict().items()}
    path = manager.save(tmp_path, 4)
    assert (path / ref_sync.REFERENCE_FILE).is_file()
    assert checkpoint_problem(path) is None  # in the manifest, written before it
    assert "reference/model.safetensors" in (path / MANIFEST).read_text()

    # a fresh process: the reference loaded from the original model again
    fresh, fresh_ref = _manager(setup, tmp_path, reference="yes")
    assert not torch.equal(fresh_ref.get_input_embeddings().weight, moved["model.embed_tokens.weight"])
    st = fresh.resume(tmp_path)
    assert st is not None and st["update"] == 4
    restored = fresh_ref.state_dict()
    assert restored.keys() == moved.keys() and all(torch.equal(restored[k], moved[k]) for k in moved)
    assert fresh_ref.get_input_embeddings().weight is fresh_ref.get_output_embeddings().weight  # still tied


def test_a_checkpoint_without_the_reference_is_refused_in_one_line(setup: Any, tmp_path: Path) -> None:
    plain, _ = _manager(setup, tmp_path, reference="no")
    path = plain.save(tmp_path, 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2"]
    assert not (path / "reference").exists()  # without a reference: nothing new in a checkpoint
    syncing, _ = _manager(setup, tmp_path, reference="yes")
    with pytest.raises(UserError) as info:
        syncing.resume(tmp_path)
    msg = str(info.value)
    assert msg == (
        f"cannot resume from {path}: it was written without --sync_ref_model (it holds no reference model); "
        "start a new --output_dir, or resume without --sync_ref_model."
    )


def test_resuming_a_synced_checkpoint_without_sync_keeps_the_original_reference(
    setup: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    manager, _ = _manager(setup, tmp_path, reference="yes")
    manager.save(tmp_path, 2)
    plain, _ = _manager(setup, tmp_path, reference="no")
    with caplog.at_level("WARNING"):
        assert plain.resume(tmp_path) is not None
    assert "written with --sync_ref_model" in caplog.text


def test_a_damaged_reference_file_is_a_one_line_user_error(setup: Any, tmp_path: Path) -> None:
    manager, _ = _manager(setup, tmp_path, reference="yes")
    path = manager.save(tmp_path, 2)
    weights = path / ref_sync.REFERENCE_FILE
    weights.write_bytes(b"\0" * weights.stat().st_size)
    assert (checkpoint_problem(path) or "").startswith("reference/model.safetensors fails its SHA-256 check")
    write_manifest(path)  # a manifest that matches (e.g. damaged before sealing): only reading it tells
    again, _ = _manager(setup, tmp_path, reference="yes", resume=str(path))
    with pytest.raises(UserError) as info:
        again.resume(tmp_path)
    msg = str(info.value)
    assert msg.startswith(f"cannot resume from {path}: reference/model.safetensors cannot be read"), msg
    assert "\n" not in msg


def test_saved_reference_round_trips_tied_and_untied(setup: Any, tmp_path: Path) -> None:
    ref, policy = _models(setup)
    file = tmp_path / ref_sync.REFERENCE_FILE
    ref_sync.save_reference_state(ref.state_dict(), file)
    acc = _accelerator()
    ref_sync.load_reference(policy, file, accelerator=acc, deepspeed=False)
    assert all(
        torch.equal(a, b)
        for a, b in zip(ref.state_dict().values(), policy.state_dict().values(), strict=True)
    )
    assert matched_parameters(ref, policy)  # same names and shapes


# ------------------------------------------------------------------------------------------------------
# real DeepSpeed ZeRO-3 (CPU, gloo), when deepspeed is installed
_REAL_ZERO3 = """
import os, sys, torch
from pathlib import Path
from types import SimpleNamespace
from accelerate import Accelerator, DeepSpeedPlugin
from accelerate.utils import InitProcessGroupKwargs
from rloo.models import load_causal_lm, load_tokenizer
from rloo.training import deepspeed_utils, process_group, ref_sync
from rloo.training.checkpoint import checkpoint_problem
from rloo.training.checkpoint_manager import CheckpointManager

path, out = sys.argv[1], Path(sys.argv[2])
plain_ref = load_causal_lm(path, flag="model_name_or_path")
plain_pol = load_causal_lm(path, flag="model_name_or_path")
with torch.no_grad():
    for i, p in enumerate(plain_pol.parameters()):
        p.add_(0.5 + i)
ref_sync.mix_into(plain_ref, plain_pol, 0.6)  # what the sharded sync must give
expected = {n: p.detach().clone() for n, p in plain_ref.named_parameters()}

plugin = DeepSpeedPlugin(zero_stage=3, zero3_init_flag=True, zero3_save_16bit_model=True)
acc = Accelerator(deepspeed_plugin=plugin, kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")])
process_group.release_at_exit()  # as the trainer does: gloo's groups left to the interpreter's exit abort it
assert deepspeed_utils.is_zero3(acc) and acc.num_processes == int(os.environ["WORLD_SIZE"])
deepspeed_utils.fill_deepspeed_config(
    acc, micro_batch_size=1, gradient_accumulation_steps=1, max_grad_norm=1.0
)


def build():
    policy = load_causal_lm(path, flag="model_name_or_path")
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    policy, opt = acc.prepare(policy, opt)
    ref = deepspeed_utils.prepare_reference_model(load_causal_lm(path, flag="model_name_or_path"), acc)
    assert acc.unwrap_model(ref).get_input_embeddings().weight.numel() == 0, "the reference is not sharded"
    cfg = SimpleNamespace(
        to_dict=dict, save_total_limit=None, learning_rate=1e-3, resume_from_checkpoint="latest",
        mirror_uri=None, use_peft=False,
    )
    manager = CheckpointManager(
        accelerator=acc, cfg=cfg, policy=policy, optimizer=opt,
        scheduler=torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0), tokenizer=load_tokenizer(path),
        num_updates=4, trainer_state=lambda u: {"update": u}, deepspeed=True, reference=ref,
    )
    return manager, policy, ref


def full(model):
    m = acc.unwrap_model(model)
    with deepspeed_utils.gathered(list(m.parameters()), acc):
        return {n: p.detach().clone() for n, p in m.named_parameters()}


manager, policy, ref = build()
moved_policy = dict(plain_pol.named_parameters())
with torch.no_grad():  # the sharded policy takes the moved weights
    for n, p in acc.unwrap_model(policy).named_parameters():
        with deepspeed_utils.gathered([p], acc, modifier_rank=0):
            p.copy_(moved_policy[n])
ref_sync.sync_reference(ref, policy, 0.6, accelerator=acc, deepspeed=True)
got = full(ref)
assert all(torch.allclose(got[n], expected[n], atol=1e-6) for n in expected), "sharded sync differs"
assert all(torch.equal(v, moved_policy[n]) for n, v in full(policy).items()), "the policy changed"

ckpt = manager.save(out, 1)  # every rank assembles the reference; the main process writes it
assert checkpoint_problem(ckpt) is None
_, _, fresh = build()
ref_sync.load_reference(fresh, ckpt / ref_sync.REFERENCE_FILE, accelerator=acc, deepspeed=True)
restored = full(fresh)
assert all(torch.equal(restored[n], got[n]) for n in got), "restored reference differs"
# one write: the ranks share stdout, and print writes its arguments apart (two ranks' lines could merge)
sys.stdout.write(f"ZERO3-REF-OK {acc.process_index}\\n")
sys.stdout.flush()
sys.exit(process_group.end_rank(0))  # as the rloo command ends a rank: no teardown for gloo to abort
"""


@pytest.mark.parametrize("world", [1, 2])
def test_zero3_sync_save_and_load_with_real_deepspeed(setup: Any, tmp_path: Path, world: int) -> None:
    pytest.importorskip("deepspeed")
    import os
    import socket
    import subprocess

    script = tmp_path / "zero3_ref.py"
    script.write_text(_REAL_ZERO3)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        **os.environ,
        "ACCELERATE_USE_DEEPSPEED": "true",
        "CUDA_VISIBLE_DEVICES": "",  # DeepSpeed's CPU accelerator, gloo between the ranks
        "OMP_NUM_THREADS": "1",
        "PYTHONWARNINGS": "ignore",
    }
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={world}",
        f"--master_port={port}",
    ]
    proc = subprocess.run(
        [*torchrun, str(script), str(setup.policy), str(tmp_path / "out")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert sorted(re.findall(r"ZERO3-REF-OK (\d+)", proc.stdout)) == [str(rank) for rank in range(world)]
