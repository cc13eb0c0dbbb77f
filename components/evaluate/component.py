"""Judge the trained model and its SFT baseline; KFP metrics and the HTML report as artifacts."""

from kfp import dsl
from kfp.dsl import HTML, Input, Markdown, Metrics, Model, Output

from rloo.pipeline.images import EVAL_IMAGE


@dsl.component(base_image=EVAL_IMAGE, install_kfp_package=False)
def evaluate(
    trained_model_uri: str,
    sft_model: Input[Model],
    dataset_name: str,
    dataset_split: str,
    num_examples: int,
    max_new_tokens: int,
    judge_base_url: str,
    judge_model: str,
    output_uri: str,
    kfp_run_id: str,
    kfp_run_name: str,
    mlflow_experiment: str,
    metrics: Output[Metrics],
    report: Output[HTML],
    summary: Output[Markdown],
) -> str:
    import os
    import shutil
    import tempfile

    from rloo.pipeline.layout import RunLayout
    from rloo.pipeline.reports import eval_markdown, stage_run_link
    from rloo.pipeline.retry import give_up_on_user_errors
    from rloo.pipeline.steps import durable_model_name, evaluate_stage

    os.environ.update(
        KFP_RUN_ID=kfp_run_id, KFP_RUN_NAME=kfp_run_name, MLFLOW_EXPERIMENT_NAME=mlflow_experiment
    )
    layout = RunLayout(output_uri, kfp_run_id)
    results_uri = layout.eval
    # both models' downloads are removed after; a retry after a failure for good stops at once
    with (
        give_up_on_user_errors(layout.root, "evaluate"),
        tempfile.TemporaryDirectory(prefix="rloo-eval-") as work,
    ):
        values, html = evaluate_stage(
            trained_uri=trained_model_uri,
            sft_uri=sft_model.metadata["uri"],
            sft_name=durable_model_name(dict(sft_model.metadata)),
            results_uri=results_uri,
            dataset_name=dataset_name,
            dataset_split=dataset_split,
            num_examples=num_examples,
            max_new_tokens=max_new_tokens,
            judge_base_url=judge_base_url,
            judge_model=judge_model,
            work=work,
        )
        shutil.copyfile(html, report.path)
    for name, value in values.items():
        metrics.log_metric(name, value)
    with open(summary.path, "w") as f:
        f.write(eval_markdown(values, results_uri, stage_run_link("eval", kfp_run_id)))
    return layout.eval_results
