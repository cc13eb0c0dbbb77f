"""The process group a torchrun rank joins is destroyed before the interpreter exits, on every path.

A rank that leaves its gloo process groups (the default one, and those DeepSpeed and accelerate form beside
it) to the interpreter's finalization aborts there about every second time: "terminate called without an
active exception", SIGABRT, after a run that succeeded or a refusal that exited 2. gloo's worker threads
still hold work whose tensors need the interpreter while it is torn down (pytorch/pytorch#190489; the
atexit handler proposed inside torch, pytorch/pytorch#179291, was abandoned). The launcher then reports the
signal instead of the rank's own exit: a finished run fails its pipeline step. Destroyed while the
interpreter is alive (an atexit handler runs before finalization), the groups end cleanly.
"""

from __future__ import annotations

import atexit


def release() -> None:
    """Destroy every process group this process joined (gloo's is local: no rank waits for another); a
    no-op where none is."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def release_at_exit() -> None:
    """Have :func:`release` run when the interpreter exits, however it exits (once, however often this is
    called)."""
    atexit.unregister(release)
    atexit.register(release)
