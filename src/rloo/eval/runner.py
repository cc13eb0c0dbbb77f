"""The evaluation stage: generate with both models on the same prompts, judge against the references in
both orders, compute win rates with 95% intervals, write results, report to MLflow."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from rloo.algo.eval_results import EvalResults
from rloo.algo.intervals import Interval
from rloo.errors import ServiceUnavailable, UserError
from rloo.eval.config import EvalConfig
from rloo.eval.data import load_eval_rows
from rloo.eval.generation import GenerationEngine, make_engine
from rloo.eval.report import flat_metrics, kfp_metrics, render_html
from rloo.eval.reward_model import REFERENCE, score_pairs
from rloo.eval.stats import (
    pair_score,
    paired_difference,
    rm_agreement_record,
    summarize_reward_model,
    summarize_scores,
)
from rloo.judging.client import BUDGET, ERROR, INVALID, OK, settings_from, transient
from rloo.judging.pairwise import Judgement, PairwiseJudge, render_prompt

log = logging.getLogger(__name__)

RESULTS_FILE = "eval_results.json"
JUDGEMENTS_FILE = "judgements.jsonl"
REPORT_FILE = "eval_report.html"
KFP_METRICS_FILE = "kfp_metrics.json"


def make_judge(cfg: EvalConfig) -> PairwiseJudge:
    return PairwiseJudge(settings_from(cfg, cfg.template_text()))


def usable_verdicts_problem(label: str, judged: list[tuple[Judgement, Judgement]]) -> UserError | None:
    """Why the pairs of one model cannot measure anything, or None. The rule: at least half of the pairs
    must have two usable verdicts (both orders answered with A or B); below that the win rate says more about
    the judge than about the model. The error names the commonest judge failure, the server's own words, and
    is a temporary one (exit 75) when that failure may heal by itself."""
    n = len(judged)
    usable = sum(1 for a, b in judged if a.status == OK and b.status == OK)
    if n == 0 or 2 * usable >= n:
        return None
    errors: dict[str, int] = {}
    invalid = unasked = 0
    example = ""
    for pair in judged:
        for j in pair:
            if j.status == ERROR:
                errors[j.error or "error"] = errors.get(j.error or "error", 0) + 1
            if j.status == INVALID:
                invalid += 1
                example = example or " ".join((j.answer or "").split())[:80]
            unasked += j.status == BUDGET
    parts = [
        f"{count} request(s) failed with {error!r}"
        for error, count in sorted(errors.items(), key=lambda kv: -kv[1])[:2]
    ]
    if invalid:
        parts.append(f"{invalid} answer(s) were not a single A or B (e.g. {example!r})")
    if unasked:
        parts.append(f"{unasked} request(s) not sent: --judge_request_budget ran out")
    message = (
        f"only {usable} of {n} {label} pairs got two usable verdicts, fewer than half, so no win rate is "
        f"measured: {'; '.join(parts)}; fix the judge (--judge_base_url, --judge_model, its context length, "
        "--judge_template) and run the evaluation again."
    )
    top = max(errors, key=lambda k: errors[k]) if errors else None
    if top is not None and transient(top) and errors[top] >= invalid + unasked:
        return ServiceUnavailable(message)
    return UserError(message)


def run_eval(
    cfg: EvalConfig, *, engine: GenerationEngine | None = None, sources: dict[str, str] | None = None
) -> dict[str, Any]:
    """Run the whole stage; returns the contents of ``eval_results.json``.

    ``sources``: durable names to record instead of the local paths (``trained``, ``baseline``: where the
    models were downloaded from; ``output``: where the output directory is published), for callers that
    evaluate temporary copies, such as the pipeline's evaluate step."""
    assert cfg.model_name_or_path and cfg.dataset_name  # validated
    from rloo.tracking.uri import check_tracking_uri

    # a tracking URI MLflow cannot use fails now, before anything loads
    check_tracking_uri(os.environ.get("MLFLOW_TRACKING_URI"))
    rows = load_eval_rows(
        cfg.dataset_name, cfg.dataset_split, config=cfg.dataset_config, num_examples=cfg.num_examples
    )
    from rloo.models import check_model_files

    # The models' files before the judge: a corrupt model is reported as such even when the judge is down.
    for flag, path in (
        ("model_name_or_path", cfg.model_name_or_path),
        ("baseline_model", cfg.baseline_model),
        ("reward_model_path", cfg.reward_model_path),
    ):
        if path:
            check_model_files(
                flag,
                path,
                trust_remote_code=cfg.trust_remote_code,
                reward_model=flag == "reward_model_path",
            )
    sinks = _sinks(cfg)  # an unreachable tracking server fails now too, not after generation
    judge = make_judge(cfg)
    # seconds, before minutes of generation: a wrong URL/key/model, or a context too short for the largest
    # request (its prompt and reference in the template, the reference standing in for the model's output)
    judge.preflight(largest_request(cfg, rows))
    engine = engine or make_engine(cfg)
    out = Path(cfg.output_dir)
    existed = out.exists()
    out.mkdir(parents=True, exist_ok=True)
    # The run starts now, so that its duration in MLflow is the stage's (generation and judging), not the
    # moment of logging at the end.
    try:
        _open(sinks, cfg, sources, out)
        try:
            results = _evaluate(cfg, rows, judge, engine, sources, out)
        except BaseException:
            for sink in sinks:
                sink.finish("FAILED")
            raise
    except BaseException:
        if not existed:  # nothing half-written is left: results are written only at the end
            shutil.rmtree(out, ignore_errors=True)
        raise
    _report(sinks, results, out)
    return results


def largest_request(cfg: EvalConfig, rows: Any) -> str:
    """The judge prompt of the evaluation's largest example, with its reference in both response slots (a
    model output is at most ``max_new_tokens``; the reference is what there is before generation)."""
    i = max(range(len(rows)), key=lambda k: len(rows.judge_prompts[k]) + 2 * len(rows.references[k]))
    return render_prompt(cfg.template_text(), rows.judge_prompts[i], rows.references[i], rows.references[i])


def example_key(judge_prompt: str, reference: str) -> str:
    """An example's identity across evaluations: a digest of what the judge sees besides the model's output
    (the push gate pairs a challenger's scores with the champion's by it)."""
    return hashlib.sha256(f"{judge_prompt}\0{reference}".encode()).hexdigest()[:16]


def _evaluate(
    cfg: EvalConfig,
    rows: Any,
    judge: Any,
    engine: GenerationEngine,
    sources: dict[str, str] | None,
    out: Path,
) -> dict[str, Any]:
    assert cfg.model_name_or_path is not None  # EvalConfig.validate() requires it
    models = {"trained": cfg.model_name_or_path}
    if cfg.baseline_model:
        models["baseline"] = cfg.baseline_model
    outputs: dict[str, list[str]] = {}
    for label, path in models.items():
        log.info("generating %d completions with %s (%s engine)", len(rows), path, engine.name)
        outputs[label] = engine.generate(path, list(rows.prompts), rows.rows)
    rm_scores = None
    if cfg.reward_model_path:  # before the judge: a reward model that fails to load costs no judge requests
        device = getattr(engine, "device", None) or torch.device(
            "cuda" if torch.cuda.is_available() else "cpu"
        )
        rm_scores = score_pairs(cfg, list(rows.prompts), list(rows.references), outputs, device)

    labels = list(models)
    log.info("judging %d pairs in both orders with %s", len(rows) * len(labels), cfg.judge_model)
    flat = judge.judge(
        rows.judge_prompts * len(labels),
        [o for label in labels for o in outputs[label]],
        rows.references * len(labels),
    )
    n = len(rows)
    judged = {label: flat[i * n : (i + 1) * n] for i, label in enumerate(labels)}
    for label in labels:  # a judge that refused or garbled most requests measured nothing: fail, say why
        problem = usable_verdicts_problem(label, judged[label])
        if problem is not None:
            raise problem

    summaries: dict[str, dict[str, Any]] = {}
    scores: dict[str, list[float | None]] = {}
    for label in labels:
        verdicts = [(a.verdict, b.verdict) for a, b in judged[label]]
        scores[label] = [pair_score(a, b) for a, b in verdicts]
        summaries[label] = {
            "path": (sources or {}).get(label, models[label]),
            **summarize_scores(verdicts),
        }
    agreement = None
    if rm_scores is not None:
        for label in labels:
            summaries[label].update(
                summarize_reward_model(scores[label], rm_scores[label], rm_scores[REFERENCE])
            )
        agreement = {
            "reward_model": cfg.reward_model_path,
            **rm_agreement_record(
                {label: (scores[label], rm_scores[label]) for label in labels}, rm_scores[REFERENCE]
            ),
        }
    diff = None
    if "baseline" in scores:
        diff = paired_difference(scores["trained"], scores["baseline"])
    evaluation = EvalResults(
        # the win rates the push stage's promotion gate reads (rloo.algo.eval_results), as summarised
        trained=_rate(summaries["trained"]),
        baseline=_rate(summaries["baseline"]) if "baseline" in summaries else None,
        paired_difference=diff,
        judge_model=str(cfg.judge_model),
        judge_base_url=str(cfg.judge_base_url),
        judge_template_sha256=hashlib.sha256(cfg.template_text().encode()).hexdigest(),
        judge_extra=judge.stats.as_dict(),
        num_examples=n,
        invalid=sum(m["num_invalid"] for m in summaries.values()),
        ties=sum(m["num_ties"] for m in summaries.values()),
        # the trained model's score per example, for the push gate's champion-against-challenger comparison
        per_example=tuple(
            (example_key(p, r), score)
            for p, r, score in zip(rows.judge_prompts, rows.references, scores["trained"], strict=True)
        ),
        extra={
            "engine": engine.name,
            "models": summaries,
            "settings": recorded_settings(cfg, sources),
            # how often the reward model prefers the side the judge picked: the reward-hacking monitor
            **({"judge_rm_agreement": agreement} if agreement is not None else {}),
        },
    )
    results = evaluation.to_dict()
    examples = [
        {
            "index": i,
            "prompt": rows.judge_prompts[i],
            "reference": rows.references[i],
            "outputs": {label: outputs[label][i] for label in labels},
            "scores": {label: scores[label][i] for label in labels},
            "judgements": {label: [j.as_dict() for j in judged[label][i]] for label in labels},
            # the reward model's score of each side: the reference and each model's output
            **({"rm_scores": {side: v[i] for side, v in rm_scores.items()}} if rm_scores else {}),
        }
        for i in range(n)
    ]
    (out / RESULTS_FILE).write_text(evaluation.to_json())
    with open(out / JUDGEMENTS_FILE, "w") as f:
        for ex in examples:
            f.write(strict_json(ex, ensure_ascii=False) + "\n")
    (out / REPORT_FILE).write_text(render_html(results, examples, cfg.report_examples))
    (out / KFP_METRICS_FILE).write_text(strict_json(kfp_metrics(results), indent=2, sort_keys=True) + "\n")
    return results


def _rate(summary: dict[str, Any]) -> Interval:
    """A model's win rate against the references and its 95% interval, from its summary."""
    return Interval(summary["win_rate"], summary["win_rate_ci_low"], summary["win_rate_ci_high"])


def strict_json(value: Any, **kw: Any) -> str:
    """JSON that every parser reads: Python's default writes NaN and Infinity, which are not JSON (RFC 8259;
    JavaScript's JSON.parse, which the KFP and MLflow UIs use, refuses them). Non-finite numbers are refused
    where they come in (the config, the reward model's scores), so one here is a bug to surface, not to write."""
    return json.dumps(value, allow_nan=False, **kw)


def recorded_settings(cfg: EvalConfig, sources: dict[str, str] | None) -> dict[str, Any]:
    """The config as recorded (results, MLflow params): model and output locations replaced by ``sources``."""
    settings = cfg.to_dict()
    for key, field in (
        ("trained", "model_name_or_path"),
        ("baseline", "baseline_model"),
        ("output", "output_dir"),
    ):
        if (sources or {}).get(key) and settings.get(field):
            settings[field] = sources[key]  # type: ignore[index]
    return settings


def _sinks(cfg: EvalConfig) -> list[Any]:
    from rloo.tracking import sinks_from_env

    return sinks_from_env(cfg.report_to, stage="eval", system_metrics_interval=None)


def _open(sinks: list[Any], cfg: EvalConfig, sources: dict[str, str] | None, out: Path) -> None:
    from rloo.tracking import flatten_params
    from rloo.tracking.tags import TAG_OUTPUT_DIR

    for sink in sinks:
        if (sources or {}).get("output"):  # out is a temporary copy; the results are published there
            sink.tags[TAG_OUTPUT_DIR] = sources["output"]  # type: ignore[index]
        sink.open(out)
        sink.log_params(flatten_params(recorded_settings(cfg, sources)))


def _report(sinks: list[Any], results: dict[str, Any], out: Path) -> None:
    for sink in sinks:
        status = "FAILED"
        try:
            sink.log_metrics(flat_metrics(results), step=0)
            for name in (RESULTS_FILE, JUDGEMENTS_FILE, REPORT_FILE):
                sink.log_artifact(out / name, "eval")
            status = "FINISHED"
        finally:
            sink.finish(status)
