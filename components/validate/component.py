"""First step: build every stage's config from the pipeline parameters, on a CPU pod, before any GPU."""

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
    registered_model_name: str,
    hub_repo_id: str,
) -> str:
    """Returns the ``rloo train`` flags (a JSON list) built from the validated parameters."""
    import json
    import sys

    from rloo.errors import UserError
    from rloo.pipeline.steps import TrainParams, train_args
    from rloo.pipeline.steps import validate_params as check

    train = TrainParams(
        dataset_name=dataset_name,
        dataset_train_split=dataset_train_split,
        reward_model_path=reward_model_path,
        learning_rate=learning_rate,
        total_episodes=total_episodes,
        rloo_k=rloo_k,
        kl_coef=kl_coef,
        per_device_train_batch_size=per_device_train_batch_size,
        gradient_accumulation_steps=gradient_accumulation_steps,
        response_length=response_length,
        seed=seed,
        extra_train_args=extra_train_args,
    )
    try:
        # the model is looked up here (directory, s3:// upload or Hub repo), before any GPU is requested
        check(
            model=model,
            train=train,
            eval_dataset_name=eval_dataset_name,
            eval_max_new_tokens=eval_max_new_tokens,
            judge_base_url=judge_base_url,
            judge_model=judge_model,
            gpu_count=gpu_count,
            num_nodes=num_nodes,
            output_uri=output_uri,
            promotion_margin=promotion_margin,
            registered_model_name=registered_model_name,
            hub_repo_id=hub_repo_id,
            check_hub=True,
        )
    except UserError as e:
        print(f"invalid pipeline parameters: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    return json.dumps(train_args(train))
