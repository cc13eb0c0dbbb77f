"""Run an ``rloo`` command that presses Ctrl-C on itself (SIGINT, ``TIMES`` times in a row) at one phase of
one update:

    python tests/training/interrupt_at.py UPDATE:PHASE:TIMES <rloo command> ...   (e.g. 3:optimization:2)

Two signals sent from outside can reach the process as one (pending signals of a kind merge); sent from
inside, each is handled before the next. Like tests/fixtures/kill_at.py, it adds a trainer PHASE_HOOK.
"""

import os
import signal
import sys

from rloo.training import trainer


def interrupt_at(spec: str) -> None:
    update, phase, times = spec.split(":")

    def hook(at_update: int, at_phase: str) -> None:
        if at_update == int(update) and at_phase == phase:
            for _ in range(int(times)):
                os.kill(os.getpid(), signal.SIGINT)

    trainer.PHASE_HOOKS.append(hook)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even where this runs with SIGINT ignored
    interrupt_at(sys.argv[1])
    from rloo.cli import main

    sys.exit(main(sys.argv[2:]))
