"""Checkpoints under DeepSpeed, what needs no engine: the layout a resume refuses in one line (written with or
without DeepSpeed, ZeRO partitions for another process count, a planted pickle among the engine's files) and
the check that every rank sees the checkpoint's directory. Real engines: tests/integration/test_deepspeed_resume.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from rloo.errors import UserError
from rloo.models import load_causal_lm, load_tokenizer
from rloo.storage.manifest import write_manifest
from rloo.training.checkpoint import ENGINE_DIR, ENGINE_TAG, checkpoint_problem, list_checkpoints
from rloo.training.checkpoint_manager import CheckpointManager
from rloo.training.collectives import Collectives
from tests.fixtures.checkpoints import manager_config
from tests.fixtures.planted import plant


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from rloo.demo.tiny import build_tiny_setup

    return build_tiny_setup(tmp_path_factory.mktemp("tiny"))


def _manager(setup: Any, *, deepspeed: bool, resume: str = "latest", comm: Any = None) -> CheckpointManager:
    from accelerate import Accelerator

    policy = load_causal_lm(str(setup.policy), flag="model_name_or_path")
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    cfg = manager_config(resume)
    return CheckpointManager(
        accelerator=Accelerator(cpu=True),
        cfg=cfg,
        policy=policy,
        optimizer=opt,
        scheduler=torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0),
        tokenizer=load_tokenizer(str(setup.policy)),
        num_updates=8,
        trainer_state=lambda u: {"update": u, "num_updates": 8},
        deepspeed=deepspeed,
        comm=comm,
    )


def _as_if_deepspeed(path: Path, ranks: int, *, zero3: bool = False) -> Path:
    """``path`` (a plain checkpoint) laid out as a DeepSpeed one of ``ranks`` processes: no optimizer.pt, the
    engine's files instead (placeholders: ZeRO-3's module shards per rank, else the module once), sealed
    again."""
    (path / "optimizer.pt").unlink()
    engine = path / ENGINE_DIR / ENGINE_TAG
    engine.mkdir(parents=True)
    modules = (
        [f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(ranks)]
        if zero3
        else ["mp_rank_00_model_states.pt"]
    )
    for name in modules:
        torch.save({"module": {}}, engine / name)
    for r in range(ranks):
        torch.save({"optimizer_state_dict": {}}, engine / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt")
    write_manifest(path)
    assert checkpoint_problem(path) is None
    return path


def test_a_plain_checkpoint_has_no_engine_files(setup: Any, tmp_path: Path) -> None:
    path = _manager(setup, deepspeed=False).save(tmp_path, 2)
    assert (path / "optimizer.pt").is_file() and not (path / ENGINE_DIR).exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2"]


def test_checkpoints_with_and_without_deepspeed_are_not_mixed_up(setup: Any, tmp_path: Path) -> None:
    plain = _manager(setup, deepspeed=False).save(tmp_path / "plain", 2)
    with pytest.raises(UserError) as info:
        _manager(setup, deepspeed=True).resume(tmp_path / "plain")
    assert str(info.value) == (
        f"cannot resume from {plain}: it was written without DeepSpeed (its optimizer state is in optimizer.pt), "
        "which a run under DeepSpeed cannot read; resume it without DeepSpeed, or pass --resume_from_checkpoint "
        "none to start over."
    )
    ds = _as_if_deepspeed(_manager(setup, deepspeed=False).save(tmp_path / "ds", 2), ranks=1)
    with pytest.raises(UserError) as info:
        _manager(setup, deepspeed=False).resume(tmp_path / "ds")
    assert str(info.value) == (
        f"cannot resume from {ds}: it was written under DeepSpeed (its optimizer state is in deepspeed/, split "
        "between the processes), which a run without DeepSpeed cannot read; resume it with the same DeepSpeed "
        "config, or pass --resume_from_checkpoint none to start over."
    )


def test_zero_partitions_for_another_process_count_are_refused_in_one_line(
    setup: Any, tmp_path: Path
) -> None:
    path = _as_if_deepspeed(_manager(setup, deepspeed=False).save(tmp_path, 4), ranks=2)
    with pytest.raises(UserError) as info:
        _manager(setup, deepspeed=True).resume(tmp_path)  # one process
    assert str(info.value) == (
        f"cannot resume from {path}: it was written by a DeepSpeed run of 2 processes, whose ZeRO optimizer state "
        "is split 2 ways, and DeepSpeed cannot split it anew for 1; resume on 2 processes, or pass "
        "--resume_from_checkpoint none to start over."
    )


def test_a_planted_pickle_among_the_engine_files_never_runs(setup: Any, tmp_path: Path) -> None:
    pytest.importorskip("deepspeed")  # its classes are what the engine's files may name
    path = _as_if_deepspeed(_manager(setup, deepspeed=False).save(tmp_path / "out", 2), ranks=1)
    marker = tmp_path / "marker"
    plant(path, f"{ENGINE_DIR}/{ENGINE_TAG}/mp_rank_00_model_states.pt", marker)
    with pytest.raises(UserError) as info:  # refused before the engine's load: none is needed here
        _manager(setup, deepspeed=True).resume(tmp_path / "out")
    msg = str(info.value)
    assert msg.startswith(
        f"cannot resume from {path}: deepspeed/engine/mp_rank_00_model_states.pt holds more than tensors"
    ), msg
    assert "(it names getattr)" in msg and "\n" not in msg
    assert not marker.exists()


class _ElsewhereComm(Collectives):
    """Two processes, the other on a node of its own: what it reads from the output directory is not what
    the main process wrote there."""

    def __init__(self, accelerator: Any) -> None:
        super().__init__(accelerator)
        self.world = 2

    def broadcast(self, obj: Any) -> Any:
        return f"{obj}, as the other node sees it" if isinstance(obj, str) else obj

    def any(self, flag: bool, device: torch.device) -> bool:
        return True  # the other rank did not see the main process's token


def test_deepspeed_save_stops_in_one_line_when_a_rank_cannot_see_the_directory(
    setup: Any, tmp_path: Path
) -> None:
    from accelerate import Accelerator

    manager = _manager(setup, deepspeed=True, comm=_ElsewhereComm(Accelerator(cpu=True)))
    with pytest.raises(UserError) as info:  # before the engine writes: none is needed here
        manager.save(tmp_path, 2)
    assert str(info.value) == (
        f"checkpoint checkpoint-2: under DeepSpeed every process writes its part of the optimizer state into "
        f"{tmp_path}, and some processes do not see what the main process writes there (a disk of each node's "
        "own?): give --output_dir (or --local_dir) a filesystem that every node shares, or run on one node."
    )
    assert list(tmp_path.iterdir()) == [] and list_checkpoints(tmp_path) == []


def test_a_zero3_checkpoint_is_not_resumed_under_another_stage(setup: Any, tmp_path: Path) -> None:
    # this manager's accelerator has no DeepSpeed plugin (stage 0), as a ZeRO-2 run reads ZeRO-3's shards no
    # better: the module is split per rank there
    path = _as_if_deepspeed(_manager(setup, deepspeed=False).save(tmp_path, 2), ranks=1, zero3=True)
    with pytest.raises(UserError) as info:
        _manager(setup, deepspeed=True).resume(tmp_path)
    assert str(info.value) == (
        f"cannot resume from {path}: it was written under ZeRO-3, and this run uses ZeRO-0, whose checkpoint "
        "holds the weights another way; resume with the config it was written with, or pass "
        "--resume_from_checkpoint none to start over."
    )
