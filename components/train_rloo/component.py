"""RLOO training on this pod's GPUs (one node); across nodes: components/train_rloo_multinode."""

from kfp import dsl
from kfp.dsl import Input, Markdown, Metrics, Model, Output

from rloo.pipeline.images import TRAIN_IMAGE


@dsl.component(base_image=TRAIN_IMAGE, install_kfp_package=False)
def train_rloo(
    sft_model: Input[Model],
    plan: str,
    gpu_limit: str,
    gpu_resource: str,
    cpu: str,
    memory: str,
    kfp_run_id: str,
    kfp_run_name: str,
    trained_model: Output[Model],
    metrics: Output[Metrics],
    summary: Output[Markdown],
) -> str:
    """Returns the trained model's URI (a parameter: the pipeline picks it with dsl.OneOf). ``gpu_limit`` to
    ``memory``: what this pod's spec requests, so the step checks it got the GPUs; as inputs they also reach the
    condition DAG, which KFP's compiler does not do for values only a pod-spec field uses."""
    from rloo.pipeline import reports as r
    from rloo.stages import train
    from rloo.stages.context import step

    gpus = train.granted_gpus(gpu_limit, gpu_resource, cpu, memory)
    with step("train", kfp_run_id, plan=plan, run_name=kfp_run_name) as s, train.work_dir() as work:
        sft = dict(sft_model.metadata)
        done = train.run_single_node(s.plan, kfp_run_id, sft=sft, gpu_count=gpus, work=work)
        out, link = done.record, r.stage_run_link("train", kfp_run_id)  # record: the output directory
        headline = r.train_headline(r.read_history(out))
        for name, value in headline.items():
            metrics.log_metric(name, value)
        text = r.train_markdown(headline, done.output, link, r.latest_samples(out))
        return done.write(model=trained_model, summary=summary, markdown=text)
