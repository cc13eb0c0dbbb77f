"""Judge the trained model and its SFT baseline; KFP metrics and the HTML report as artifacts."""

from kfp import dsl
from kfp.dsl import HTML, Input, Markdown, Metrics, Model, Output

from rloo.pipeline.images import EVAL_IMAGE


@dsl.component(base_image=EVAL_IMAGE, install_kfp_package=False)
def evaluate(
    trained_model_uri: str,
    sft_model: Input[Model],
    plan: str,
    kfp_run_id: str,
    kfp_run_name: str,
    metrics: Output[Metrics],
    report: Output[HTML],
    summary: Output[Markdown],
) -> str:
    """Returns the URI of eval_results.json, which the push step reads."""
    import os

    from rloo.pipeline.reports import eval_markdown, stage_run_link
    from rloo.stages import evaluate
    from rloo.stages.plan import StagePlan

    stage_plan = StagePlan.from_json(plan)
    os.environ.update(stage_plan.run_env(kfp_run_id, kfp_run_name))
    done = evaluate.run(stage_plan, kfp_run_id, trained_uri=trained_model_uri, sft=dict(sft_model.metadata))
    with open(report.path, "w") as f:
        f.write(done.report_html)
    for name, value in done.metrics.items():
        metrics.log_metric(name, value)
    with open(summary.path, "w") as f:
        f.write(eval_markdown(done.metrics, done.results_uri, stage_run_link("eval", kfp_run_id)))
    return done.results_file
