"""Every collective the trainer uses, in one place; on one process each is the identity (no communication).

Batch statistics (reward normalisation, advantage whitening, metrics) are taken over the global batch, so
results do not depend on the process count; decisions (stop, preempt, already complete) are agreed by all
ranks, so none is left waiting at a barrier the others skipped.
"""

from __future__ import annotations

from typing import Any, TypeVar

import torch

T = TypeVar("T")


class Collectives:
    """Collectives over the processes of an ``accelerate.Accelerator``."""

    def __init__(self, accelerator: Any) -> None:
        self.accelerator = accelerator
        self.world: int = accelerator.num_processes
        self.rank: int = accelerator.process_index

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """Concatenate a per-rank tensor over ranks (dim 0, rank order); pads dim 1 if widths differ."""
        if self.world == 1:
            return t
        if t.dim() == 2:
            t = self.accelerator.pad_across_processes(t, dim=1, pad_index=0)
        return self.accelerator.gather(t)

    def local(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a gathered tensor."""
        if self.world == 1:
            return t
        n = t.size(0) // self.world
        return t[self.rank * n : (self.rank + 1) * n]

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """Elementwise sum over ranks."""
        return t if self.world == 1 else self.accelerator.reduce(t, reduction="sum")

    def mean(self, value: float, device: torch.device) -> float:
        """A per-rank number averaged over ranks."""
        if self.world == 1:
            return value
        return float(self.accelerator.reduce(torch.tensor(value, device=device), reduction="mean"))

    def any(self, flag: bool, device: torch.device) -> bool:
        """True on every rank when it is true on one."""
        if self.world == 1:
            return flag
        return bool(self.sum(torch.tensor(float(flag), device=device)) > 0)

    def smallest(self, value: int, device: torch.device) -> int:
        """The smallest of a per-rank whole number over ranks (accelerate's reduce has no minimum)."""
        if self.world == 1:
            return value
        import torch.distributed as dist

        t = torch.tensor([value], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def broadcast(self, obj: T) -> T:
        """The main process's ``obj`` (any picklable value) on every rank."""
        if self.world == 1:
            return obj
        from accelerate.utils import broadcast_object_list

        return broadcast_object_list([obj])[0]

    def gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (any picklable value), in rank order, on every rank."""
        if self.world == 1:
            return [obj]
        from accelerate.utils import gather_object

        return list(gather_object([obj]))

    def average_gradients(self, model: torch.nn.Module) -> None:
        """Average the trainable parameters' gradients over ranks in one flat all-reduce (for a model not
        wrapped in DDP, whose hooks do not allow the two forward calls of a shared-prefix pass before one
        backward). A parameter without a gradient counts as a zero gradient."""
        if self.world == 1:
            return
        import torch.distributed as dist

        params = [q for q in model.parameters() if q.requires_grad]
        for q in params:
            if q.grad is None:
                q.grad = torch.zeros_like(q)
        grads = [q.grad for q in params if q.grad is not None]
        flat = torch._utils._flatten_dense_tensors(grads)
        dist.all_reduce(flat)
        flat /= self.world
        for g, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads), strict=True):
            g.copy_(synced)
