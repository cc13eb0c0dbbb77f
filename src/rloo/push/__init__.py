"""The push stage: publish a trained model (object storage, MLflow Model Registry, Hugging Face Hub) and
promote it only when the evaluation says it beats the SFT model. See :mod:`rloo.push.runner`."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# The names below, by the module that defines them, are imported on first use (PEP 562), not with the
# package: the pipeline's parameters read rloo.push.config, and a client install ('rloo pipeline
# compile/submit' without torch) must get it without the push stage, whose model checks import torch.
_EXPORTS = {
    "card": ("CardInputs", "CurveSummary", "render_model_card", "summarize_curves"),
    "config": ("PushConfig",),
    "gate": ("CANDIDATE", "CHAMPION", "Decision", "EvalResults", "Interval", "decide", "parse_eval_results"),
    "runner": ("RESULT_FILE", "run_push"),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = [
    "CANDIDATE",
    "CHAMPION",
    "RESULT_FILE",
    "CardInputs",
    "CurveSummary",
    "Decision",
    "EvalResults",
    "Interval",
    "PushConfig",
    "decide",
    "parse_eval_results",
    "render_model_card",
    "run_push",
    "summarize_curves",
]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    globals()[name] = value  # once: later lookups find it without this function
    return value


if TYPE_CHECKING:  # what the names are, for the type checker
    from .card import CardInputs, CurveSummary, render_model_card, summarize_curves
    from .config import PushConfig
    from .gate import CANDIDATE, CHAMPION, Decision, EvalResults, Interval, decide, parse_eval_results
    from .runner import RESULT_FILE, run_push
