"""The evaluate step: both models (the trained one and its SFT baseline) downloaded, judged with ``rloo eval``
on the plan's eval settings, its output directory published to the run's ``eval/`` prefix.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from rloo.stages.context import StepResult
from rloo.stages.layout import RunLayout
from rloo.stages.plan import PipelinePlan
from rloo.stages.sft import durable_model_name


def evaluate(
    plan: PipelinePlan, *, trained_uri: str, sft_uri: str, results_uri: str, work: str, sft_name: str = ""
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


def run(plan: PipelinePlan, run_id: str, *, trained_uri: str, sft: dict[str, str]) -> StepResult:
    """The step: judge the run's model against the SFT model ``sft`` (the fetch step's record); both
    downloads are removed after. The result: the URI of ``eval_results.json`` (which the push step reads) as
    its output, the KFP metrics, the HTML report, and the run's ``eval/`` prefix as its record."""
    layout = RunLayout(plan.run.output_uri, run_id)
    with tempfile.TemporaryDirectory(prefix="rloo-eval-") as work:
        values, html = evaluate(
            plan,
            trained_uri=trained_uri,
            sft_uri=sft["uri"],
            sft_name=durable_model_name(sft),
            results_uri=layout.eval,
            work=work,
        )
        report = html.read_text()
    return StepResult(output=layout.eval_results, metrics=values, report_html=report, record=layout.eval)
