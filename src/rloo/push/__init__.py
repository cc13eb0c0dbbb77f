"""The push stage: publish a trained model (object storage, MLflow Model Registry, Hugging Face Hub) and
promote it only when the evaluation says it beats the SFT model. See :mod:`rloo.push.stage`."""

from rloo.push.card import CardInputs, CurveSummary, render_model_card, summarize_curves
from rloo.push.config import PushConfig
from rloo.push.gate import CANDIDATE, CHAMPION, Decision, EvalResults, Interval, decide, parse_eval_results
from rloo.push.stage import RESULT_FILE, run_push

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
