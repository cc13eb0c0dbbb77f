"""What each step shows in the KFP UI: headline metrics and a Markdown summary with its MLflow run link.

Pure functions over files the stages already write (``metrics.jsonl``, ``samples/update_*.json``, the push
result) plus one MLflow query to find a stage's run; the components only write the returned text.
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rloo.stages.plan import PipelinePlan

log = logging.getLogger(__name__)

# metrics.jsonl key -> KFP metric name (KFP UI sorts by name; no '/' so the names read the same everywhere)
TRAIN_HEADLINE = {
    "objective/scores": "final_score",
    "objective/rlhf_reward": "final_rlhf_reward",
    "objective/kl": "final_kl",
    "objective/entropy": "final_entropy",
}
LAST_N = 3  # final values are means over the last updates: one update's batch is noisy


def train_headline(history: list[dict[str, Any]]) -> dict[str, float]:
    """Final-value metrics of a training run (mean of the last ``LAST_N`` updates), its first score for
    comparison, episodes and wall time."""
    if not history:
        return {}
    out: dict[str, float] = {}
    tail = history[-LAST_N:]
    for key, name in TRAIN_HEADLINE.items():
        vals = [float(h[key]) for h in tail if isinstance(h.get(key), (int, float)) and math.isfinite(h[key])]
        if vals:
            out[name] = sum(vals) / len(vals)
    first = [float(h["objective/scores"]) for h in history[:LAST_N] if "objective/scores" in h]
    if first:
        out["initial_score"] = sum(first) / len(first)
    out["updates"] = float(history[-1].get("update", len(history)))
    out["episodes"] = float(history[-1].get("episode", 0))
    out["train_seconds"] = float(sum(h.get("time/update_s", 0.0) for h in history))
    return out


def read_history(output_dir: Path) -> list[dict[str, Any]]:
    path = output_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def latest_samples(output_dir: Path) -> tuple[int, list[dict[str, Any]]] | None:
    files = sorted((output_dir / "samples").glob("update_*.json"))
    if not files:
        return None
    data = json.loads(files[-1].read_text())
    return int(data.get("update", 0)), list(data.get("rows") or [])


def _cell(text: Any, limit: int = 200) -> str:
    s = " ".join(str(text if text is not None else "").split())
    s = s if len(s) <= limit else s[: limit - 1] + "…"
    return s.replace("|", "\\|").replace("<", "&lt;") or " "


def _num(v: Any) -> str:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return _cell(v)
    return str(v) if isinstance(v, int) else f"{v:.4g}"


def table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_num(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def stage_run_link(
    stage: str, kfp_run_id: str, tracking_uri: str | None = None, experiment: str | None = None
) -> str:
    """A Markdown line pointing at the MLflow run of ``stage`` in this pipeline run (or saying why not).

    The run is looked for in the stages' experiment: ``experiment``, else ``MLFLOW_EXPERIMENT_NAME`` (which
    the components set), else the default one, as :func:`rloo.tracking.lifecycle.start_stage_run` chooses it.
    """
    uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        return "MLflow: not configured for this run (no MLFLOW_TRACKING_URI)."
    from rloo.storage.redact import redact
    from rloo.tracking.experiment import DEFAULT_EXPERIMENT, EXPERIMENT_ENV
    from rloo.tracking.tags import TAG_PIPELINE_RUN_ID, TAG_STAGE, filter_value

    try:
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=uri)
        exp = client.get_experiment_by_name(
            experiment or os.environ.get(EXPERIMENT_ENV) or DEFAULT_EXPERIMENT
        )
        filt = f"tags.`{TAG_PIPELINE_RUN_ID}` = '{filter_value(kfp_run_id)}' and tags.`{TAG_STAGE}` = '{filter_value(stage)}'"
        runs = (
            client.search_runs(
                [exp.experiment_id],
                filter_string=filt,
                order_by=["attributes.start_time DESC"],
                max_results=1,
            )
            if exp is not None
            else []
        )
    except Exception as e:  # a summary must never fail the step whose work is done
        log.warning("could not look up the MLflow run of stage %s: %s", stage, e)
        return f"MLflow: run of stage `{stage}` not found ({type(e).__name__})."
    if not runs:
        return f"MLflow: no run of stage `{stage}` for pipeline run `{kfp_run_id}`."
    info = runs[0].info
    shown = redact(uri)
    if shown.startswith(("http://", "https://")):
        url = f"{shown.rstrip('/')}/#/experiments/{info.experiment_id}/runs/{info.run_id}"
        return f"MLflow run: [{info.run_id}]({url})"
    return f"MLflow run `{info.run_id}` (experiment {info.experiment_id}) in `{shown}`: `mlflow ui --backend-store-uri {shown}`"


def plan_markdown(plan: PipelinePlan) -> str:
    """The validate step's summary: what each later step will do, part by part (a training flag by its
    'rloo train' name, as ``extra_train_args`` would set it)."""
    import dataclasses

    c = plan.cluster
    if c.multinode:
        where = f"{c.num_nodes} nodes x {c.gpu_count} {c.gpu_resource} ({c.multinode_backend})"
    else:
        where = f"1 node, {c.gpu_count} x {c.gpu_resource}"
    parts = [
        "## Run plan",
        "",
        f"SFT model `{plan.run.model}`{f' at `{plan.run.model_revision}`' if plan.run.model_revision else ''}; "
        f"writes under `{plan.run.output_uri}`; MLflow experiment `{plan.run.mlflow_experiment}`; "
        f"training on {where}.",
    ]
    sections = {
        "Training (rloo train)": plan.train,
        "Evaluation (rloo eval)": plan.eval,
        "Push (rloo push)": plan.push,
        "Pods": dataclasses.asdict(c),
    }
    for title, values in sections.items():
        rows = [[f"`{k}`", "(unset)" if v is None else v] for k, v in sorted(values.items())]
        parts += ["", f"### {title}", "", table(["setting", "value"], rows)]
    return "\n".join(parts) + "\n"


def fetch_markdown(meta: dict[str, Any]) -> str:
    rows = [
        [k, meta.get(k)] for k in ("source", "revision", "uri", "manifest_digest", "num_files", "total_bytes")
    ]
    return "## SFT model\n\n" + table(["field", "value"], rows) + "\n"


def train_markdown(headline: dict[str, float], model_uri: str, link: str, samples: Any) -> str:
    parts = ["## RLOO training", "", link, "", f"Trained model: `{model_uri}`", ""]
    if headline:
        parts += [table(["metric", "value"], [[k, v] for k, v in headline.items()]), ""]
    if samples:
        update, rows = samples
        parts += [f"### Sample generations (update {update})", ""]
        parts += [
            table(
                ["query", "response", "score"],
                [[r.get("query"), r.get("response"), r.get("score")] for r in rows[:10]],
            )
        ]
    return "\n".join(parts) + "\n"


def eval_markdown(values: dict[str, float], results_uri: str, link: str) -> str:
    """Win rates against the references, with 95% intervals, for the trained and the SFT model."""
    rows = []
    for who, label in (("trained", "trained"), ("baseline", "SFT")):
        if f"{who}_win_rate" in values:
            ci = f"[{values.get(f'{who}_win_rate_ci_low', math.nan):.3f}, {values.get(f'{who}_win_rate_ci_high', math.nan):.3f}]"
            n = values.get(f"{who}_num_valid")
            rows.append([label, values[f"{who}_win_rate"], ci, n])
    parts = ["## Evaluation (LLM judge)", "", link, "", f"Results: `{results_uri}`", ""]
    parts.append(table(["model", "win rate vs reference", "95% CI", "judged pairs"], rows))
    if "diff_trained_minus_baseline_estimate" in values:
        d = values["diff_trained_minus_baseline_estimate"]
        lo, hi = (
            values.get("diff_trained_minus_baseline_low", math.nan),
            values.get("diff_trained_minus_baseline_high", math.nan),
        )
        parts += ["", f"Trained minus SFT: {d:+.3f} (95% CI [{lo:+.3f}, {hi:+.3f}])"]
    if "judge_rm_agreement_estimate" in values:  # the evaluation scored the pairs with the reward model
        a = values["judge_rm_agreement_estimate"]
        lo, hi = (
            values.get("judge_rm_agreement_low", math.nan),
            values.get("judge_rm_agreement_high", math.nan),
        )
        n, skipped = values.get("judge_rm_agreement_n", 0), values.get("judge_rm_agreement_num_skipped", 0)
        means = ", ".join(
            f"{label} {values[f'{who}_rm_score_mean']:.4g}"
            for who, label in (("trained", "trained"), ("baseline", "SFT"))
            if f"{who}_rm_score_mean" in values
        )
        parts += [
            "",
            f"Judge/reward-model agreement: {a:.3f} (95% CI [{lo:.3f}, {hi:.3f}]) of {int(n)} pairs the judge "
            f"decided ({int(skipped)} ties or invalid pairs left out); mean reward-model score: {means}. A low "
            "agreement while the reward model scores the trained model above the SFT model is the "
            "reward-hacking signal.",
        ]
    return "\n".join(parts) + "\n"


def push_markdown(result: dict[str, Any], link: str) -> str:
    parts = ["## Push", "", link, "", f"Decision: **{result.get('decision', '?')}**"]
    reason = result.get("reason")
    if reason:
        parts += ["", f"Reason: {_cell(reason, 1000)}"]
    vs = result.get("against_champion")
    if vs:
        lo, hi = vs["ci95"]
        parts += [
            "",
            f"Against the champion, {_cell(str(vs['champion']), 200)}: {vs['estimate']:+.3f} "
            f"(95% CI [{lo:+.3f}, {hi:+.3f}])",
        ]
    # one line per target, in full: a table cell is cut at 200 characters, mid-way through an MLflow record
    lines = []
    for target in ("storage", "production", "mlflow", "hub"):
        value = result.get(target)
        if value:
            text = (
                "; ".join(f"{k}: {v}" for k, v in sorted(value.items())) if isinstance(value, dict) else value
            )
            lines.append(f"- **{target}**: {_cell(text, 2000)}")
    if lines:
        parts += ["", *lines]
    return "\n".join(parts) + "\n"
