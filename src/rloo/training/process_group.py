"""A torchrun rank ends with its own exit code, never with gloo's abort in the interpreter's teardown.

A rank that leaves its gloo process groups (the default one, and those DeepSpeed and accelerate form beside
it) to the interpreter's finalization aborts there about every second time: "terminate called without an
active exception", SIGABRT, after a run that succeeded or a refusal that exited 2. gloo's worker threads
still hold work whose tensors need the interpreter while it is torn down (pytorch/pytorch#190489; the
atexit handler proposed inside torch, pytorch/pytorch#179291, was abandoned). The launcher then reports the
signal instead of the rank's own exit: a finished run fails its pipeline step.

Two layers. :func:`release_at_exit` destroys the groups from an atexit handler, which runs while the
interpreter is still whole: that ends the abort wherever destroying frees the groups (measured: 0 of 10
launches against 5 of 10), the layer a user's own script that drives the trainer gets. It is not always
enough: after ``rloo train`` has destroyed every group (accelerate's ``end_training``), the default group's
gloo threads still run (something torch-side keeps it), and a loaded CI machine saw a rank abort. So the
``rloo`` command ends a rank with :func:`end_rank`: no teardown at all, as ``multiprocessing`` ends its
children.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading


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


def is_rank() -> bool:
    """Whether this process is one rank of several: ``WORLD_SIZE`` > 1, as torchrun, ``accelerate launch``
    and the Kubeflow Trainer's pods set it."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1")) > 1
    except ValueError:
        return False


def end_rank(code: int) -> int:
    """In a rank (:func:`is_rank`): end the process now with ``code``, without the interpreter's teardown.
    Everything an ordinary exit does before the teardown is done first, in its order: the other non-daemon
    threads joined (``threading._shutdown``), the atexit handlers run (MLflow's, :func:`release`,
    logging's flush), the standard streams flushed; then ``os._exit``. That is how ``multiprocessing``
    ends a child (multiprocessing/process.py, ``BaseProcess._bootstrap``, then ``os._exit``).
    Elsewhere (one process, a caller in the same interpreter): returns ``code``."""
    if not is_rank():
        return code
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        # closed, or its reader gone: nothing more can be said there
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)
