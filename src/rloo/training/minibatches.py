"""Which completions go into which optimizer step: mini-batches drawn from *global* positions.

The rollout batch of an update is a global list of completions, prompt-major (row ``p * K + k``), and rank
``r`` holds the contiguous block ``[r * L, (r + 1) * L)`` of it (``L`` = local batch size). A shuffle of
each rank's own rows, the obvious choice, makes the optimizer steps depend on the number of processes:
one process x 16 and two processes x 8 would take different mini-batches from the same 16 completions.

Here the mini-batches are a function of the global positions and the seed alone. The global batch is cut
into *units* (a prompt's whole group of K completions when possible, so each prompt is still computed
once per micro-batch) and the units into consecutive *chunks* of ``num_mini_batches`` units. Each chunk
sends exactly one unit to each mini-batch, by a random permutation per chunk and PPO epoch. Every rank's
block is a union of whole chunks, so:

- each rank contributes the same number of completions to every mini-batch (equal micro-batch counts,
  which DeepSpeed's gradient-accumulation boundary needs), and
- the union over ranks of mini-batch ``m`` is the same set of completions for every number of processes,
  so 1 x 16 and 2 x 8 take the same optimizer steps over the same completions.

The unit size is chosen from the local batch size; two layouts take identical steps when they choose the
same unit, which they do whenever both hold a multiple of ``num_mini_batches`` prompts per rank.
"""

from __future__ import annotations

import torch

__all__ = ["minibatch_rows", "unit_size"]


def unit_size(local_batch_size: int, rloo_k: int, num_mini_batches: int) -> int:
    """Completions per shuffling unit: the largest divisor of ``rloo_k`` that splits evenly.

    ``rloo_k`` (whole prompt groups) when each rank holds a multiple of ``num_mini_batches`` prompts;
    otherwise a group is split into equal parts, down to single completions (``local_batch_size`` is
    always a multiple of ``num_mini_batches``, so 1 always works).
    """
    for u in range(rloo_k, 0, -1):
        if rloo_k % u == 0 and (local_batch_size // u) % num_mini_batches == 0:
            return u
    raise AssertionError("unreachable: u=1 always divides")  # pragma: no cover


def minibatch_rows(
    *,
    local_batch_size: int,
    world_size: int,
    rank: int,
    rloo_k: int,
    num_mini_batches: int,
    generator: torch.Generator,
) -> list[torch.Tensor]:
    """One PPO epoch's mini-batches for ``rank``, as row indices into its local batch.

    Draws the same random numbers on every rank (sizes are global), so ranks agree without talking.
    Returns ``num_mini_batches`` 1-D tensors of ``local_batch_size // num_mini_batches`` rows each; rows
    of one unit stay adjacent, units appear in a random order.
    """
    u = unit_size(local_batch_size, rloo_k, num_mini_batches)
    m = num_mini_batches
    units_per_rank = local_batch_size // u
    n_units = units_per_rank * world_size
    # chunk c holds units c*M .. c*M+M-1; row c of `slot` is a permutation: unit c*M+j -> mini-batch slot[c, j]
    slot = torch.rand(n_units // m, m, generator=generator).argsort(dim=1).reshape(-1)  # (U,)
    key = torch.rand(n_units, generator=generator)  # (U,) order of units inside a mini-batch
    first = rank * units_per_rank
    local_slot = slot[first : first + units_per_rank]  # (U_r,)
    local_key = key[first : first + units_per_rank]  # (U_r,)
    within = torch.arange(u)
    out = []
    for mb in range(m):
        units = (local_slot == mb).nonzero().squeeze(1)  # (U_r / M,) local unit ids
        units = units[local_key[units].argsort()]
        out.append((units[:, None] * u + within).reshape(-1))  # (U_r / M * u,)
    return out
