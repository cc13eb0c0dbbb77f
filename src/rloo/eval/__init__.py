"""Evaluation stage: generate with the trained and the baseline (SFT) model, judge each output against the
dataset's reference with an LLM judge in both orders, and report win rates with 95% intervals."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# The names below, by the module that defines them, are imported on first use (PEP 562), not with the
# package: the pipeline's parameters read rloo.eval.config, and a client install ('rloo pipeline
# compile/submit' without torch) must get it without the generation and judging modules, which import torch.
# The judge client itself is rloo.judging's (training's judge reward uses it too).
_EXPORTS = {
    "config": ("DEFAULT_TEMPLATE", "EvalConfig"),
    "runner": ("run_eval",),
    "stats": ("pair_score", "paired_difference", "rate_interval", "summarize_scores"),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = [
    "DEFAULT_TEMPLATE",
    "EvalConfig",
    "pair_score",
    "paired_difference",
    "rate_interval",
    "run_eval",
    "summarize_scores",
]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    globals()[name] = value  # once: later lookups find it without this function
    return value


if TYPE_CHECKING:  # what the names are, for the type checker
    from .config import DEFAULT_TEMPLATE, EvalConfig
    from .runner import run_eval
    from .stats import pair_score, paired_difference, rate_interval, summarize_scores
