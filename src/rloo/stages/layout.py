"""Where one pipeline run keeps its artifacts: the one place the layout under ``output_uri`` is spelled.

::

    <output_uri>/<run id>/sft/                  the fetched SFT model (fetch_sft)
    <output_uri>/<run id>/model/                the trained model (train_rloo, single- or multi-node)
    <output_uri>/<run id>/checkpoints/          the training checkpoints, for resuming
    <output_uri>/<run id>/eval/                 rloo eval's output; eval_results.json in it (evaluate)
    <output_uri>/<run id>/push/                 push_result.json (push_model)
    <output_uri>/published/<run key>/           the versions the push publishes (its storage_uri)

Standard library only: the components import it in the slim image too.
"""

from __future__ import annotations

from dataclasses import dataclass

# rloo.eval.runner.RESULTS_FILE and rloo.push.runner.RESULT_FILE (tests/stages/test_layout.py checks they
# agree): spelled here so this module stays importable without torch.
EVAL_RESULTS_FILE = "eval_results.json"
PUSH_RESULT_FILE = "push_result.json"


@dataclass(frozen=True)
class RunLayout:
    """The artifact locations of pipeline run ``run_id`` under ``output_uri`` (an ``s3://`` prefix or a
    local directory; a trailing ``/`` is ignored)."""

    output_uri: str
    run_id: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "output_uri", self.output_uri.rstrip("/"))

    @property
    def root(self) -> str:
        return f"{self.output_uri}/{self.run_id}"

    @property
    def sft(self) -> str:
        return f"{self.root}/sft"

    @property
    def model(self) -> str:
        return f"{self.root}/model"

    @property
    def checkpoints(self) -> str:
        return f"{self.root}/checkpoints"

    @property
    def eval(self) -> str:
        return f"{self.root}/eval"

    @property
    def eval_results(self) -> str:
        return f"{self.eval}/{EVAL_RESULTS_FILE}"

    @property
    def push(self) -> str:
        return f"{self.root}/push"

    @property
    def push_result(self) -> str:
        return f"{self.push}/{PUSH_RESULT_FILE}"

    @property
    def published(self) -> str:
        """The push's ``storage_uri``: shared by every run, one ``<run key>/`` version each."""
        return f"{self.output_uri}/published"
