"""Publish the trained model behind the promotion gate; the decision is the step's output."""

from kfp import dsl
from kfp.dsl import Input, Markdown, Model, Output

from rloo.pipeline.images import SLIM_IMAGE


@dsl.component(base_image=SLIM_IMAGE, install_kfp_package=False)
def push_model(
    trained_model_uri: str,
    sft_model: Input[Model],
    eval_results: str,
    plan: str,
    kfp_run_id: str,
    kfp_run_name: str,
    summary: Output[Markdown],
) -> str:
    import os

    from rloo.pipeline.reports import push_markdown, stage_run_link
    from rloo.stages import push
    from rloo.stages.plan import StagePlan

    stage_plan = StagePlan.from_json(plan)
    os.environ.update(stage_plan.run_env(kfp_run_id, kfp_run_name))
    result = push.run(
        stage_plan,
        kfp_run_id,
        trained_uri=trained_model_uri,
        eval_results_uri=eval_results,
        sft=dict(sft_model.metadata),
    )
    with open(summary.path, "w") as f:
        f.write(push_markdown(result, stage_run_link("push", kfp_run_id)))
    return result["decision"]
