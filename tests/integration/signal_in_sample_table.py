"""Run an ``rloo`` command that sends itself a signal while its first sample table is being generated, between
two decode steps, as a SIGTERM from the kubelet or a Ctrl-C would arrive there:

    python tests/integration/signal_in_sample_table.py SIGTERM <rloo command> ...
"""

import os
import signal
import sys

from rloo.generation import TransformersGenerator


def signal_in_sample_table(name: str) -> None:
    generate = TransformersGenerator.generate
    sent = []

    def wrapped(self, prompt_ids, prompt_mask, k, params, *args, **kw):  # type: ignore[no-untyped-def]
        if params.greedy and not sent:  # the sample table's near-greedy generation, not a rollout
            sent.append(True)
            os.kill(os.getpid(), getattr(signal, name))
        return generate(self, prompt_ids, prompt_mask, k, params, *args, **kw)

    TransformersGenerator.generate = wrapped  # type: ignore[method-assign]


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even where this runs with SIGINT ignored
    signal_in_sample_table(sys.argv[1])
    from rloo.cli import main

    sys.exit(main(sys.argv[2:]))
