"""``rloo train`` whose vLLM engine gets the policy's weights once, at the first rollout, and never again.

The planted fault the weight-push check must see: the engine keeps sampling from the starting weights while
the policy moves, so the gap between the engine's log-probs and the trainer's grows with every update.
Run as ``python -m tests.vllm_engine.stale_engine train ...`` (the arguments of ``rloo``).
"""

from __future__ import annotations

import sys

from rloo.cli import main
from rloo.training import vllm_backend


def _push_once(self: vllm_backend.VLLMGenerator, _real=vllm_backend.VLLMGenerator.push_weights) -> None:
    if not getattr(self, "_pushed_once", False):
        _real(self)
        self._pushed_once = True  # type: ignore[attr-defined]


vllm_backend.VLLMGenerator.push_weights = _push_once  # type: ignore[method-assign]

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
