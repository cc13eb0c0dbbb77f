"""The order prompts are trained in: a seeded permutation per epoch, consumed across epoch boundaries.

Every rank draws the same global order and takes its own slice of it, so the order does not depend on the
process count; its position is two integers, saved in checkpoints for an exact resume.
"""

from __future__ import annotations

import torch


class PromptSampler:
    """Prompt indices in a per-epoch permutation seeded by ``seed``; ``next(n)`` continues into the next
    epoch when one runs out. ``state_dict()`` / ``load_state_dict()`` hold its position."""

    def __init__(self, num_prompts: int, seed: int) -> None:
        if num_prompts < 1:
            raise ValueError("PromptSampler needs at least one prompt")
        self.num_prompts = num_prompts
        self.seed = seed
        self.epoch = -1  # no epoch drawn yet: the first next() draws epoch 0
        self.cursor = 0
        self._order: list[int] = []

    def epoch_order(self, epoch: int) -> list[int]:
        """The permutation of one epoch: a function of (seed, epoch) only."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.num_prompts, generator=g).tolist()

    def next(self, n: int) -> list[int]:
        """The next ``n`` prompt indices of the global order."""
        out: list[int] = []
        while len(out) < n:
            if self.cursor >= len(self._order):
                self.epoch += 1
                self._order = self.epoch_order(self.epoch)
                self.cursor = 0
            take = min(n - len(out), len(self._order) - self.cursor)
            out += self._order[self.cursor : self.cursor + take]
            self.cursor += take
        return out

    def state_dict(self) -> dict[str, int]:
        """The position, under the names checkpoints have always stored it with."""
        return {"data_epoch": self.epoch, "data_cursor": self.cursor}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.cursor = int(state["data_epoch"]), int(state["data_cursor"])
        self._order = self.epoch_order(self.epoch) if self.epoch >= 0 else []
