"""Human- and machine-readable results: flat metric dicts (MLflow, KFP ``Metrics``) and the HTML report."""

from __future__ import annotations

import html
from typing import Any

SUMMARY_KEYS = (
    "win_rate",
    "win_rate_ci_low",
    "win_rate_ci_high",
    "order_agreement",
    "num_valid",
    "num_wins",
    "num_losses",
    "num_ties",
    "num_invalid",
    # with --reward_model_path only (absent keys are not logged)
    "judge_rm_agreement",
    "judge_rm_agreement_ci_low",
    "judge_rm_agreement_ci_high",
    "judge_rm_agreement_n",
    "rm_win_rate",
    "rm_score_mean",
)
# the judge/reward-model agreement over every model's decided pairs (eval_results.json judge_rm_agreement)
AGREEMENT_KEYS = ("estimate", "low", "high", "n", "num_skipped", "reference_rm_score_mean")


def flat_metrics(results: dict[str, Any], sep: str = "/") -> dict[str, float]:
    """Numeric results as one flat dict: ``trained/win_rate``, ``baseline/num_ties``, ``diff/estimate``...
    Missing values (no valid pair) are left out rather than logged as 0."""
    out: dict[str, float] = {}
    for label, summary in results["models"].items():
        for key in SUMMARY_KEYS:
            if summary.get(key) is not None:
                out[f"{label}{sep}{key}"] = float(summary[key])
    diff = results.get("paired_difference")
    if diff:
        for key in ("estimate", "low", "high", "n"):
            if diff.get(key) is not None:
                out[f"diff_trained_minus_baseline{sep}{key}"] = float(diff[key])
    agreement = results.get("judge_rm_agreement")
    if agreement:
        for key in AGREEMENT_KEYS:
            if agreement.get(key) is not None:
                out[f"judge_rm_agreement{sep}{key}"] = float(agreement[key])
    judge = results["judge"]
    out[f"judge{sep}requests"] = float(judge["requests"])
    out[f"judge{sep}retries"] = float(judge["retries"])
    for status, count in judge["statuses"].items():
        out[f"judge{sep}{status}"] = float(count)
    return out


def kfp_metrics(results: dict[str, Any]) -> dict[str, float]:
    """Names for a KFP ``Metrics`` artifact (``metrics.log_metric(name, value)`` for each item)."""
    return flat_metrics(results, sep="_")


def _pct(v: Any) -> str:
    return "–" if v is None else f"{100 * v:.1f}%"


def _e(v: Any) -> str:
    return html.escape("" if v is None else str(v))


def render_html(results: dict[str, Any], examples: list[dict[str, Any]], max_examples: int = 50) -> str:
    rows = []
    for label, s in results["models"].items():
        rows.append(
            f"<tr><td>{_e(label)}</td><td>{_e(s.get('path'))}</td><td><b>{_pct(s['win_rate'])}</b></td>"
            f"<td>{_pct(s['win_rate_ci_low'])} – {_pct(s['win_rate_ci_high'])}</td>"
            f"<td>{s['num_wins']} / {s['num_ties']} / {s['num_losses']}</td><td>{s['num_invalid']}</td>"
            f"<td>{_pct(s['order_agreement'])}</td></tr>"
        )
    diff = results.get("paired_difference")
    diff_html = ""
    if diff and diff.get("estimate") is not None:
        diff_html = (
            f"<p>Trained − baseline (paired, {diff['n']} examples): <b>{100 * diff['estimate']:+.1f} points</b>, "
            f"95% CI {100 * diff['low']:+.1f} to {100 * diff['high']:+.1f}.</p>"
        )
    agreement_html = _agreement_html(results)
    judge = results["judge"]
    ex_html = []
    for ex in examples[:max_examples]:
        rm = ex.get("rm_scores") or {}
        outs = "".join(
            f"<h4>{_e(label)} (score {_e(ex['scores'].get(label))}{_rm(rm.get(label))})</h4><pre>{_e(text)}</pre>"
            + "".join(
                f"<div class='v'>{_e(j['order'])}: {_e(j['status'])} → {_e(j['verdict'])} "
                f"(answer {_e(j['answer'])!s})</div>"
                for j in ex["judgements"][label]
            )
            for label, text in ex["outputs"].items()
        )
        ex_html.append(
            f"<details><summary>#{ex['index']}: {_e(ex['prompt'][:120])}</summary>"
            f"<h4>prompt</h4><pre>{_e(ex['prompt'])}</pre><h4>reference{_rm(rm.get('reference'))}</h4>"
            f"<pre>{_e(ex['reference'])}</pre>"
            f"{outs}</details>"
        )
    settings = results["settings"]
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>rloo eval</title>
<style>body{{font-family:sans-serif;max-width:1100px;margin:2em auto}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:4px 8px}}pre{{white-space:pre-wrap;background:#f6f6f6;padding:6px}}
.v{{font-size:90%;color:#444}}details{{margin:6px 0;border-bottom:1px solid #eee}}</style></head><body>
<h1>Win rate against the dataset's references</h1>
<p>{results["num_examples"]} examples of {_e(settings["dataset_name"])} ({_e(settings["dataset_split"])}),
judge {_e(settings["judge_model"])}, each pair judged in both orders (1 = both prefer the model, 0.5 = the orders
disagree, 0 = both prefer the reference). Invalid pairs (an unparseable or failed judgement) are left out.</p>
<table><tr><th>model</th><th>path</th><th>win rate</th><th>95% CI</th><th>wins / ties / losses</th>
<th>invalid</th><th>order agreement</th></tr>{"".join(rows)}</table>
{diff_html}{agreement_html}
<p>Judge requests: {judge["requests"]} ({judge["retries"]} retries, plus {judge.get("preflight_requests", 0)} connectivity check); judgements by status: {_e(", ".join(f"{k} {v}" for k, v in judge["statuses"].items()))}.
Engine: {_e(results["engine"])}, max_new_tokens {settings["max_new_tokens"]}, temperature {settings["temperature"]}.</p>
<h2>Examples ({min(len(examples), max_examples)} of {len(examples)})</h2>
{"".join(ex_html)}
</body></html>
"""


def _rm(score: Any) -> str:
    return "" if score is None else f", reward model {score:.4g}"


def agreement_line(results: dict[str, Any]) -> str | None:
    """The judge/reward-model agreement as plain text for the HTML report (the pipeline's Markdown summary
    writes its own from the KFP metrics), with what a low value means; None without ``--reward_model_path``."""
    a = results.get("judge_rm_agreement")
    if not a:
        return None
    if a.get("estimate") is None:
        head = f"Judge/reward-model agreement: no decided pair ({a['num_skipped']} ties or invalid pairs)."
    else:
        head = (
            f"Judge/reward-model agreement: the reward model scores the judge's pick higher in "
            f"{_pct(a['estimate'])} (95% CI {_pct(a['low'])} to {_pct(a['high'])}) of the {a['n']} pairs the "
            f"judge decided (both orders picked the same side; {a['num_skipped']} ties or invalid pairs left "
            "out)."
        )
    per_model = []
    for label, m in results["models"].items():
        if m.get("rm_score_mean") is None:
            continue
        per_model.append(
            f"{label}: agreement {_pct(m.get('judge_rm_agreement'))} of {m.get('judge_rm_agreement_n', 0)}, "
            f"reward-model win rate against the references {_pct(m.get('rm_win_rate'))} (judge: "
            f"{_pct(m.get('win_rate'))}), mean reward-model score {m['rm_score_mean']:.4g}"
        )
    ref = a.get("reference_rm_score_mean")
    if ref is not None:
        per_model.append(f"references: mean reward-model score {ref:.4g}")
    return (
        f"{head} {'; '.join(per_model)}. A low agreement while the reward model scores the trained model above "
        "the baseline is the reward-hacking signal: the policy learned what the reward model rewards, not what "
        "the judge prefers."
    )


def _agreement_html(results: dict[str, Any]) -> str:
    line = agreement_line(results)
    if line is None:
        return ""
    path = results["judge_rm_agreement"].get("reward_model")
    return f"<p>{_e(line)} Reward model: {_e(path)}.</p>"
