"""``rloo eval``: win rates of a trained model (and its SFT baseline) against a dataset's references."""

from __future__ import annotations

import json

from rloo.cli.output import setup_logging
from rloo.eval.config import EvalConfig
from rloo.parsing import parse_config

DESCRIPTION = (
    "Generate with --model_name_or_path (and --baseline_model) on --num_examples prompts of a dataset split, "
    "judge each output against the reference completion with an OpenAI-compatible judge in both orders, and "
    "write eval_results.json, judgements.jsonl and eval_report.html to --output_dir."
)


def main(argv: list[str]) -> int:
    """Entry point of ``rloo eval``; UserErrors propagate to the ``rloo`` dispatcher (one line, exit 2)."""
    cfg = parse_config(EvalConfig, argv, prog="rloo eval", description=DESCRIPTION)
    # progress on stdout: stderr is kept for the one-line error of a failed run
    setup_logging()
    from rloo.eval.runner import RESULTS_FILE, run_eval

    results = run_eval(cfg)
    for label, s in results["models"].items():
        wr = "n/a" if s["win_rate"] is None else f"{100 * s['win_rate']:.1f}%"
        ci = (
            ""
            if s["win_rate"] is None
            else f" [{100 * s['win_rate_ci_low']:.1f}, {100 * s['win_rate_ci_high']:.1f}]"
        )
        print(f"{label}: win rate {wr}{ci}, ties {s['num_ties']}, invalid {s['num_invalid']}")
    agreement = results.get("judge_rm_agreement")
    if agreement is not None and agreement.get("estimate") is not None:
        print(
            f"judge/reward-model agreement {100 * agreement['estimate']:.1f}% "
            f"[{100 * agreement['low']:.1f}, {100 * agreement['high']:.1f}] over {agreement['n']} decided pairs "
            "(low while the reward model prefers the trained model: reward hacking)"
        )
    print(json.dumps({"results": f"{cfg.output_dir}/{RESULTS_FILE}"}))
    return 0
