"""First step: build every stage's config from the pipeline parameters, on a CPU pod, before any GPU.

It takes every pipeline parameter (a test keeps the two signatures equal): each one is checked here."""

from typing import NamedTuple

from kfp import dsl

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
    namespace: str,
    mlflow_experiment: str,
    production_uri: str,
    s3_secret: str,
    mlflow_secret: str,
    hf_secret: str,
    judge_secret: str,
) -> NamedTuple("Validated", [("train_config", str), ("gpu_limit", str)]):
    """Returns the training config (a JSON mapping that ``rloo train --config`` reads) the validated parameters
    give, and the training pod's GPU count as text: KFP's driver reads a pod-spec placeholder as a string
    (``GetStringValue``), so an integer pipeline parameter there would resolve to nothing and the pod would get
    no GPU."""
    params = dict(locals())  # first statement: exactly the parameters, by their pipeline names
    import json
    import sys

    from rloo.errors import UserError
    from rloo.pipeline.steps import check_pipeline_params

    try:
        # the model is looked up here (directory, s3:// upload or Hub repo), before any GPU is requested
        train_config = check_pipeline_params(params, check_hub=True)
    except UserError as e:
        print(f"invalid pipeline parameters: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    return (json.dumps(train_config, sort_keys=True), str(gpu_count))  # in the annotation's order
