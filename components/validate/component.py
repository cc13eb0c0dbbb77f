"""First step: the run's plan (every stage's part) from the pipeline parameters, on a CPU pod, before any GPU.

Written by ``rloo pipeline compile`` (rloo.pipeline.validate_component) from the parameters the config fields
declare: edit those, not this file. KFP runs this function's own source, so every parameter is listed here;
each one is checked here, and the later steps read the plan instead."""

from typing import NamedTuple

from kfp import dsl
from kfp.dsl import Markdown, Output

from rloo.pipeline.images import SLIM_IMAGE


@dsl.component(base_image=SLIM_IMAGE, install_kfp_package=False)
def validate_params(
    model: str,
    output_uri: str,
    dataset_name: str,
    eval_dataset_name: str,
    judge_base_url: str,
    judge_model: str,
    model_revision: str,
    mlflow_experiment: str,
    extra_train_args: str,
    judge_check: bool,
    reward_model_path: str,
    dataset_train_split: str,
    seed: int,
    per_device_train_batch_size: int,
    gradient_accumulation_steps: int,
    total_episodes: int,
    rloo_k: int,
    kl_coef: float,
    response_length: int,
    learning_rate: float,
    eval_dataset_split: str,
    eval_num_examples: int,
    eval_max_new_tokens: int,
    production_uri: str,
    registered_model_name: str,
    register_model: bool,
    hub_repo_id: str,
    promotion_margin: float,
    compare_to_champion: bool,
    gpu_resource: str,
    gpu_count: int,
    num_nodes: int,
    multinode_backend: str,
    training_runtime: str,
    queue_name: str,
    priority_class: str,
    admission_timeout_s: int,
    istio_sidecar: bool,
    gpu_node_selector: dict,
    gpu_tolerations: list,
    train_cpu: str,
    train_memory: str,
    eval_cpu: str,
    eval_memory: str,
    train_service_account: str,
    namespace: str,
    s3_secret: str,
    mlflow_secret: str,
    hf_secret: str,
    judge_secret: str,
    summary: Output[Markdown],
) -> NamedTuple("Validated", [("plan", str), ("gpu_limit", str), ("eval_gpu_limit", str)]):
    """Returns the plan (:class:`rloo.stages.plan.PipelinePlan` as JSON) and the training and evaluation pods'
    GPU counts as text: KFP's driver reads a pod-spec placeholder as a string (``GetStringValue``), so an
    integer pipeline parameter there would resolve to nothing and the pod would get no GPU."""
    params = {k: v for k, v in locals().items() if k != "summary"}  # first statement: the parameters
    from rloo.pipeline.reports import plan_markdown
    from rloo.stages import validate
    from rloo.stages.context import step

    # the model is looked up here (directory, s3:// upload or Hub repo), before any GPU is requested
    with step("validate", says="invalid pipeline parameters:"):
        done = validate.run(params)
    done.write(summary=summary, markdown=plan_markdown(done.record))
    return (done.output, *done.outputs)  # the annotation's order
