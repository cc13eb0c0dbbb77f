"""Publish the trained model behind the promotion gate; the decision is the step's output."""

from kfp import dsl
from kfp.dsl import Input, Markdown, Model, Output

from rloo.pipeline.images import SLIM_IMAGE


@dsl.component(base_image=SLIM_IMAGE, install_kfp_package=False)
def push_model(
    trained_model_uri: str,
    sft_model: Input[Model],
    eval_results: str,
    output_uri: str,
    production_uri: str,
    registered_model_name: str,
    register_model: bool,
    hub_repo_id: str,
    promotion_margin: float,
    compare_to_champion: bool,
    kfp_run_id: str,
    kfp_run_name: str,
    mlflow_experiment: str,
    summary: Output[Markdown],
) -> str:
    import os

    from rloo.pipeline.reports import push_markdown, stage_run_link
    from rloo.pipeline.steps import durable_model_name, push_stage

    os.environ.update(
        KFP_RUN_ID=kfp_run_id, KFP_RUN_NAME=kfp_run_name, MLFLOW_EXPERIMENT_NAME=mlflow_experiment
    )
    result = push_stage(
        trained_uri=trained_model_uri,
        eval_results_uri=eval_results,
        output_uri=output_uri,
        kfp_run_id=kfp_run_id,
        base_model=durable_model_name(dict(sft_model.metadata)),
        base_model_revision=str(sft_model.metadata.get("revision") or ""),
        production_uri=production_uri or None,
        registered_model_name=registered_model_name or None,
        register_model=register_model,
        hub_repo_id=hub_repo_id or None,
        promotion_margin=promotion_margin,
        compare_to_champion=compare_to_champion,
        mlflow_experiment=mlflow_experiment,
    )
    with open(summary.path, "w") as f:
        f.write(push_markdown(result, stage_run_link("push", kfp_run_id)))
    return result["decision"]
