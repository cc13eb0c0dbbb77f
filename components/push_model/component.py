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
    """Returns the gate's decision: champion or candidate."""
    from rloo.pipeline.reports import push_markdown, stage_run_link
    from rloo.stages import push
    from rloo.stages.context import step

    with step("push", kfp_run_id, plan=plan, run_name=kfp_run_name) as s:
        sft = dict(sft_model.metadata)
        done = push.run(
            s.plan, kfp_run_id, trained_uri=trained_model_uri, eval_results_uri=eval_results, sft=sft
        )
    text = push_markdown(done.record, stage_run_link("push", kfp_run_id))
    return done.write(summary=summary, markdown=text)
