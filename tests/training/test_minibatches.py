"""Mini-batches come from global positions: the same optimizer steps on 1 or N processes."""

from __future__ import annotations

import pytest
import torch

from rloo.training.minibatches import minibatch_rows, unit_size


def _global_minibatches(
    batch: int, world: int, k: int, m: int, seed: int = 3, epochs: int = 2
) -> list[list[set[int]]]:
    """Per epoch, per mini-batch: the set of *global* rows all ranks take together."""
    local = batch // world
    per_rank = []
    for rank in range(world):
        g = torch.Generator().manual_seed(seed)  # every rank seeds the same generator
        per_rank.append(
            [
                minibatch_rows(
                    local_batch_size=local,
                    world_size=world,
                    rank=rank,
                    rloo_k=k,
                    num_mini_batches=m,
                    generator=g,
                )
                for _ in range(epochs)
            ]
        )
    return [
        [{int(i) + rank * local for rank in range(world) for i in per_rank[rank][e][mb]} for mb in range(m)]
        for e in range(epochs)
    ]


@pytest.mark.parametrize(
    ("batch", "k", "m", "worlds"),
    [
        (16, 4, 1, (1, 2, 4)),  # one mini-batch: trivially the whole batch
        (16, 4, 2, (1, 2)),  # 4 prompts: 2 per mini-batch; 2 ranks hold 2 prompts each
        (64, 4, 4, (1, 2, 4)),  # 16 prompts, 4 mini-batches of 4 prompts
        (48, 2, 3, (1, 2)),  # 24 prompts of k=2, 3 mini-batches
    ],
)
def test_every_layout_takes_the_same_minibatches(batch: int, k: int, m: int, worlds: tuple[int, ...]) -> None:
    reference = _global_minibatches(batch, 1, k, m)
    for world in worlds[1:]:
        assert _global_minibatches(batch, world, k, m) == reference, world


def test_minibatches_partition_the_batch_into_whole_groups_and_reshuffle_per_epoch() -> None:
    batch, k, m = 32, 4, 2  # 8 prompts, 2 mini-batches of 4 prompts
    epochs = _global_minibatches(batch, 2, k, m, epochs=3)
    for mbs in epochs:
        assert sorted(r for mb in mbs for r in mb) == list(range(batch))  # each row exactly once
        for mb in mbs:
            assert len(mb) == batch // m
            groups = {r // k for r in mb}
            assert all({g * k + j for j in range(k)} <= mb for g in groups)  # whole groups
    # epochs are drawn anew: some epoch groups prompts differently from the first
    assert any(e != epochs[0] for e in epochs[1:])


def test_each_rank_gives_every_minibatch_the_same_number_of_rows() -> None:
    # DeepSpeed counts micro-batches to find the step boundary: ranks must agree on the count.
    for rank in range(4):
        g = torch.Generator().manual_seed(0)
        rows = minibatch_rows(
            local_batch_size=16, world_size=4, rank=rank, rloo_k=4, num_mini_batches=4, generator=g
        )
        assert [len(r) for r in rows] == [4, 4, 4, 4]
        assert sorted(torch.cat(rows).tolist()) == list(range(16))


def test_unit_size_keeps_groups_whole_when_it_can() -> None:
    # 16 local rows, k=4 -> 4 prompts; 2 or 4 mini-batches take whole prompts (4 rows)
    assert unit_size(16, 4, 2) == 4
    assert unit_size(16, 4, 4) == 4
    # 8 local rows = 2 prompts, 4 mini-batches: a prompt must be split; 8 / 2 = 4 halves of 2 rows
    assert unit_size(8, 4, 4) == 2
    # 4 local rows = 1 prompt of k=4, 4 mini-batches: single completions
    assert unit_size(4, 4, 4) == 1
    # k=3, 12 rows = 4 prompts, 4 mini-batches: one whole prompt each
    assert unit_size(12, 3, 4) == 3
