"""Micro-batches apart from the batch arithmetic: the memory estimate on hand-computed values, the choice
``--micro_batch_size auto`` makes from it, and the plan the trainer follows."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from rloo.errors import UserError
from rloo.training.micro_batch import (
    MEMORY_HEADROOM,
    AutoChoice,
    activation_bytes,
    auto_micro_batch,
    choose_micro_batch,
    divisors,
    plan_micro_batches,
    training_state_bytes,
)


def test_divisors() -> None:
    assert divisors(12) == [1, 2, 3, 4, 6, 12]
    assert divisors(1) == [1]
    assert divisors(49) == [1, 7, 49]


def test_activation_bytes_by_hand() -> None:
    # hidden 4, intermediate 8, bf16: (8 x 4 + 4 x 8) x 2 = 128 bytes per token and layer; 3 tokens x 2
    # layers = 768; logits of 2 response tokens x 10 entries x (2 x 2 + 4) = 160
    shape = dict(hidden=4, layers=2, intermediate=8, vocab=10, tokens=3, response_tokens=2, dtype_bytes=2)
    assert activation_bytes(**shape, checkpointing=False) == 768 + 160
    # checkpointing keeps one hidden state per layer (2 x 4 x 2 = 16) and one whole layer (128) per token
    assert activation_bytes(**shape, checkpointing=True) == 3 * (16 + 128) + 160


def test_training_state_bytes_by_hand() -> None:
    assert training_state_bytes(10, frozen_bytes=5) == 10 * 16 + 5
    # ZeRO-2 splits the gradient and the moments (12 of the 16 bytes) over the ranks
    assert training_state_bytes(10, zero_stage=2, shards=2) == 10 * 4 + 10 * 12 / 2
    assert training_state_bytes(10, zero_stage=3, shards=4) == 10 * 16 / 4


def test_the_choice_prefers_whole_groups_then_any_divisor_then_the_smallest() -> None:
    # budget 0.7 x 1000 = 700: 4 completions (400) fit, 8 (800) do not
    assert choose_micro_batch(16, 4, per_completion=100, free=1000 / MEMORY_HEADROOM * 0.7) == 4
    # no whole group (4 x 100) fits 350: the largest divisor that does
    assert choose_micro_batch(16, 4, per_completion=100, free=350 / MEMORY_HEADROOM) == 2
    # nothing fits: the smallest footprint
    assert choose_micro_batch(16, 4, per_completion=100, free=10) == 1
    # everything fits: the whole mini-batch in one pass
    assert choose_micro_batch(16, 4, per_completion=100, free=1e12) == 16


def test_auto_grows_with_free_memory_and_shrinks_with_the_state() -> None:
    from transformers import Qwen2Config

    config = Qwen2Config(
        hidden_size=64, num_hidden_layers=2, intermediate_size=128, vocab_size=1000, num_attention_heads=4
    )
    shape = dict(mini_batch=64, rloo_k=4, prompt_tokens=40, response_tokens=20, frozen_bytes=0.0)
    common = dict(compute_bytes=2, checkpointing=False, zero_stage=0, shards=1)
    per_completion = activation_bytes(
        hidden=64,
        layers=2,
        intermediate=128,
        vocab=1000,
        tokens=40 / 4 + 20,
        response_tokens=20,
        dtype_bytes=2,
        checkpointing=False,
    )
    state = training_state_bytes(1_000_000)
    for fits in (1, 4, 16, 64):  # room for exactly this many completions beside the state
        free = state + fits * per_completion / MEMORY_HEADROOM * 1.0001
        got = auto_micro_batch(config, **shape, trained_params=1_000_000, free_bytes=free, **common)
        assert got.size == fits
        assert (got.free, got.state, got.per_completion) == (free, state, per_completion)
    # the same memory with a state twice as large leaves room for fewer
    free = state + 16 * per_completion / MEMORY_HEADROOM
    smaller = auto_micro_batch(config, **shape, trained_params=2_000_000, free_bytes=free, **common)
    assert smaller.size < 16


def test_the_plan() -> None:
    classic = plan_micro_batches(mini_batch=16, per_device=8, setting=None)
    assert (classic.size, classic.accumulation_steps) == (8, 2)
    set_size = plan_micro_batches(mini_batch=16, per_device=8, setting="4")
    assert (set_size.size, set_size.accumulation_steps, set_size.chosen_by) == (4, 4, "micro_batch_size")
    assert "micro-batches of 4 completions, 4 per optimizer step" in set_size.describe()
    # auto without a GPU to measure keeps the classic layout, and says so
    no_gpu = plan_micro_batches(mini_batch=16, per_device=8, setting="auto")
    assert (no_gpu.size, no_gpu.accumulation_steps) == (8, 2)
    assert no_gpu.chosen_by == "auto: no GPU memory to measure, per_device_train_batch_size 8 kept"
    measured = plan_micro_batches(
        mini_batch=16, per_device=8, setting="auto", auto=AutoChoice(16, 40 * 2**30, 8 * 2**30, 2**30)
    )
    assert (measured.size, measured.accumulation_steps) == (16, 1)
    # the log says what auto measured and estimated
    assert measured.chosen_by == (
        "auto: 40.0 GiB free, ~8.0 GiB for the training state, ~1024 MiB per completion, 70% of the rest used"
    )
    with pytest.raises(UserError, match="does not divide the 16 completions"):
        plan_micro_batches(mini_batch=16, per_device=8, setting="3")


def _rank_agrees(rank: int, port: int, out: str) -> None:
    from types import SimpleNamespace

    import torch.distributed as dist

    from rloo.training.collectives import Collectives

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        comm = Collectives(SimpleNamespace(num_processes=2, process_index=rank))  # the accelerator's ranks
        got = comm.smallest([16, 4][rank], torch.device("cpu"))  # each rank measured its own GPU
        with open(f"{out}.{rank}", "w") as f:
            f.write(str(got))
    finally:
        dist.destroy_process_group()


def test_the_ranks_take_the_smallest_auto_size(tmp_path) -> None:
    """Each rank measures its own GPU's free memory; they must cut the mini-batch alike (DeepSpeed's
    boundary, the gradient average), so every rank takes the smallest choice."""
    import torch.multiprocessing as mp

    from tests.fixtures.servers import free_port

    mp.spawn(_rank_agrees, args=(free_port(), str(tmp_path / "size")), nprocs=2, join=True)
    assert [(tmp_path / f"size.{r}").read_text() for r in (0, 1)] == ["4", "4"]


def test_the_frozen_copies_are_counted_in_the_dtypes_the_run_holds_them() -> None:
    """The reference and the rollout copy take the dtypes rloo.training.precision gives them: on a GPU in
    bf16, 2 bytes each; a moving reference (--sync_ref_model) keeps the policy's fp32; LoRA holds no
    separate reference, --offload_ref_model none on the GPU, vLLM no rollout copy."""
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    from rloo.config import RLOOConfig
    from rloo.training.micro_batch import frozen_bytes

    policy = torch.nn.Linear(10, 10)  # fp32, 110 parameters
    acc = SimpleNamespace(
        mixed_precision="bf16", device=torch.device("cuda"), distributed_type=DistributedType.NO
    )
    base = dict(model_name_or_path="m", dataset_name="d", reward_funcs=["m:f"], bf16=True)

    def count(**kw: Any) -> float:
        return frozen_bytes(RLOOConfig(**{**base, **kw}), acc, policy, 110)

    assert count() == 110 * 2 + 110 * 2  # bf16 reference, bf16 rollout copy
    assert count(sync_ref_model=True) == 110 * 4 + 110 * 2
    assert count(offload_ref_model=True) == 110 * 2
    assert count(use_vllm=True) == 110 * 2  # vLLM holds its own weights: no rollout copy here
    fp32 = SimpleNamespace(
        mixed_precision="no", device=torch.device("cuda"), distributed_type=DistributedType.NO
    )
    assert frozen_bytes(RLOOConfig(**{**base, "bf16": False}), fp32, policy, 110) == 110 * 4  # no copy
