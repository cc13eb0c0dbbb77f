"""The evaluate step: both models (the trained one and its SFT baseline) downloaded, judged with ``rloo eval``
on the plan's eval settings, its output directory published to the run's ``eval/`` prefix.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

from rloo.stages.layout import RunLayout
from rloo.stages.plan import StagePlan
from rloo.stages.retry import give_up_on_user_errors


@dataclass(frozen=True)
class Evaluated:
    """What the step shows in KFP: the headline metrics, the HTML report and where the results went."""

    metrics: dict[str, float]  # kfp_metrics.json
    report_html: str
    results_uri: str  # the run's eval/ prefix
    results_file: str  # eval_results.json in it, which the push step reads


def evaluate(
    plan: StagePlan, *, trained_uri: str, sft_uri: str, results_uri: str, work: str, sft_name: str = ""
) -> tuple[dict[str, float], Path]:
    """Download both models under ``work``, run ``rloo eval``, publish its output directory to
    ``results_uri``. The results name the models by ``trained_uri`` and ``sft_name`` (default ``sft_uri``),
    not by their downloads. Returns the KFP metrics and the local path of the HTML report."""
    from rloo.eval.config import EvalConfig
    from rloo.eval.runner import KFP_METRICS_FILE, REPORT_FILE, run_eval
    from rloo.storage import download_dir, upload_dir

    root = Path(work)
    models = {}
    for label, uri in (("trained", trained_uri), ("sft", sft_uri)):
        models[label] = root / label
        download_dir(uri, models[label], progress=False, overwrite=True)
    out = root / "eval"
    cfg = EvalConfig(
        **plan.eval,
        model_name_or_path=str(models["trained"]),
        baseline_model=str(models["sft"]),
        output_dir=str(out),
    )
    run_eval(cfg, sources={"trained": trained_uri, "baseline": sft_name or sft_uri, "output": results_uri})
    upload_dir(out, results_uri, progress=False)
    return json.loads((out / KFP_METRICS_FILE).read_text()), out / REPORT_FILE


def run(plan: StagePlan, run_id: str, *, trained_uri: str, sft: dict[str, str]) -> Evaluated:
    """The step: judge the run's model against the SFT model ``sft`` (the fetch step's record); both
    downloads are removed after. A retry after a failure for good stops at once."""
    from rloo.stages.fetch import durable_model_name

    layout = RunLayout(plan.run.output_uri, run_id)
    with (
        give_up_on_user_errors(layout.root, "evaluate"),
        tempfile.TemporaryDirectory(prefix="rloo-eval-") as work,
    ):
        values, html = evaluate(
            plan,
            trained_uri=trained_uri,
            sft_uri=sft["uri"],
            sft_name=durable_model_name(sft),
            results_uri=layout.eval,
            work=work,
        )
        report = html.read_text()
    return Evaluated(values, report, layout.eval, layout.eval_results)
