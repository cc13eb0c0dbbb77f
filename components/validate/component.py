"""First step: the run's plan (every stage's part) from the pipeline parameters, on a CPU pod, before any GPU.

It takes every pipeline parameter (KFP runs this function's own source, so they are listed here; a test keeps
them equal to the pipeline's): each one is checked here, and the later steps read the plan instead."""

from typing import NamedTuple

from kfp import dsl
from kfp.dsl import Markdown, Output

from rloo.pipeline.images import SLIM_IMAGE


@dsl.component(base_image=SLIM_IMAGE, install_kfp_package=False)
def validate_params(
    model: str,
    dataset_name: str,
    dataset_train_split: str,
    reward_model_path: str,
    learning_rate: float,
    total_episodes: int,
    rloo_k: int,
    kl_coef: float,
    per_device_train_batch_size: int,
    gradient_accumulation_steps: int,
    response_length: int,
    seed: int,
    extra_train_args: str,
    judge_check: bool,
    eval_dataset_name: str,
    eval_max_new_tokens: int,
    judge_base_url: str,
    judge_model: str,
    gpu_count: int,
    num_nodes: int,
    output_uri: str,
    promotion_margin: float,
    compare_to_champion: bool,
    registered_model_name: str,
    register_model: bool,
    hub_repo_id: str,
    train_cpu: str,
    train_memory: str,
    eval_cpu: str,
    eval_memory: str,
    train_service_account: str,
    model_revision: str,
    multinode_backend: str,
    training_runtime: str,
    queue_name: str,
    priority_class: str,
    istio_sidecar: bool,
    eval_dataset_split: str,
    eval_num_examples: int,
    gpu_resource: str,
    gpu_node_selector: dict,
    gpu_tolerations: list,
    admission_timeout_s: int,
    namespace: str,
    mlflow_experiment: str,
    production_uri: str,
    s3_secret: str,
    mlflow_secret: str,
    hf_secret: str,
    judge_secret: str,
    summary: Output[Markdown],
) -> NamedTuple("Validated", [("plan", str), ("gpu_limit", str), ("eval_gpu_limit", str)]):
    """Returns the plan (:class:`rloo.stages.plan.StagePlan` as JSON) and the training and evaluation pods' GPU
    counts as text: KFP's driver reads a pod-spec placeholder as a string (``GetStringValue``), so an integer
    pipeline parameter there would resolve to nothing and the pod would get no GPU."""
    params = {k: v for k, v in locals().items() if k != "summary"}  # first statement: the parameters
    import sys

    from rloo.errors import UserError
    from rloo.pipeline.reports import plan_markdown
    from rloo.stages import validate

    try:
        # the model is looked up here (directory, s3:// upload or Hub repo), before any GPU is requested
        plan = validate.run(params)
    except UserError as e:
        print(f"invalid pipeline parameters: {e}", file=sys.stderr)
        raise SystemExit(e.exit_code) from None
    with open(summary.path, "w") as f:
        f.write(plan_markdown(plan))
    return (plan.to_json(), str(gpu_count), validate.eval_gpu_limit(plan.cluster))  # the annotation's order
