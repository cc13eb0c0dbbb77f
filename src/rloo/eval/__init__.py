"""Evaluation stage: generate with the trained and the baseline (SFT) model, judge each output against the
dataset's reference with an LLM judge in both orders, and report win rates with 95% intervals."""

from rloo.eval.config import DEFAULT_TEMPLATE, EvalConfig
from rloo.eval.judge import Judgement, JudgeSettings, PairwiseJudge, parse_answer
from rloo.eval.runner import run_eval
from rloo.eval.stats import pair_score, paired_difference, rate_interval, summarize_scores

__all__ = [
    "DEFAULT_TEMPLATE",
    "EvalConfig",
    "JudgeSettings",
    "Judgement",
    "PairwiseJudge",
    "pair_score",
    "paired_difference",
    "parse_answer",
    "rate_interval",
    "run_eval",
    "summarize_scores",
]
