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
    from rloo.pipeline.reports import eval_markdown, stage_run_link
    from rloo.stages import evaluate
    from rloo.stages.context import step

    with step("evaluate", kfp_run_id, plan=plan, run_name=kfp_run_name) as s:
        done = evaluate.run(s.plan, kfp_run_id, trained_uri=trained_model_uri, sft=dict(sft_model.metadata))
    text = eval_markdown(done.metrics, done.record, stage_run_link("eval", kfp_run_id))
    return done.write(metrics=metrics, report=report, summary=summary, markdown=text)
