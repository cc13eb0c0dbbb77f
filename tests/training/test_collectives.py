"""The collectives on one process are the identity (no process group is needed); several processes are
covered by the two-rank runs in tests/integration/test_resume_and_scale.py (and ``smallest`` by
tests/training/test_micro_batch.py)."""

from __future__ import annotations

import torch
from accelerate import Accelerator

from rloo.training.collectives import Collectives


def test_one_process_is_the_identity() -> None:
    comm = Collectives(Accelerator(cpu=True))
    assert (comm.world, comm.rank) == (1, 0)
    t = torch.arange(6.0).view(2, 3)
    assert comm.gather(t) is t and comm.local(t) is t and comm.sum(t) is t
    assert comm.mean(2.5, torch.device("cpu")) == 2.5
    assert comm.any(True, torch.device("cpu")) and not comm.any(False, torch.device("cpu"))
    assert comm.broadcast({"a": 1}) == {"a": 1}
    assert comm.smallest(3, torch.device("cpu")) == 3
    model = torch.nn.Linear(2, 2)
    model(torch.ones(1, 2)).sum().backward()
    before = model.weight.grad.clone()
    comm.average_gradients(model)
    torch.testing.assert_close(model.weight.grad, before)
