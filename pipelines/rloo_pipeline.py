"""The RLOO RLHF pipeline: validate -> fetch SFT -> train (1 node, or a multi-node TrainJob/PyTorchJob) -> evaluate -> push,
inside an exit handler that closes the MLflow parent run (FAILED when a step failed).

Compile with ``rloo pipeline compile`` (writes ``pipelines/rloo_pipeline.yaml``, which is committed).
"""

# no "from __future__ import annotations": KFP reads the parameter annotations as types

from typing import Any

from kfp import dsl, kubernetes

from components.evaluate.component import evaluate
from components.fetch_sft.component import fetch_sft
from components.finish_run.component import finish_run
from components.push_model.component import push_model
from components.train_rloo.component import train_rloo, train_rloo_multinode
from components.validate.component import validate_params
from rloo.pipeline import constants as C
from rloo.pipeline import images
from rloo.pipeline.params import config_help
from rloo.pipeline.resources import StepResources

RUN_ID = dsl.PIPELINE_JOB_ID_PLACEHOLDER
RUN_NAME = dsl.PIPELINE_JOB_NAME_PLACEHOLDER


def _secrets(task: dsl.PipelineTask, name: str, keys: dict[str, str], optional: bool = False) -> None:
    kubernetes.use_secret_as_env(task, secret_name=name, secret_key_to_env=keys, optional=optional)


def _io_step(task: dsl.PipelineTask, timeout_s: int = C.IO_TIMEOUT_S) -> dsl.PipelineTask:
    """Object storage / Hub / registry traffic: transient failures are retried with exponential backoff."""
    task.set_retry(
        num_retries=C.IO_RETRIES,
        backoff_duration=C.IO_BACKOFF,
        backoff_factor=C.IO_BACKOFF_FACTOR,
        backoff_max_duration=C.IO_BACKOFF_MAX,
    )
    kubernetes.set_timeout(task, timeout_s)
    return task


def _retried(task: dsl.PipelineTask) -> dsl.PipelineTask:
    """A GPU step or the multi-node launcher: retried (a train step resumes from the run's checkpoints, the
    launcher adopts its job), except after a failure no retry heals (rloo.pipeline.retry)."""
    return task.set_retry(
        num_retries=C.GPU_RETRIES,
        backoff_duration=C.GPU_BACKOFF,
        backoff_factor=C.GPU_BACKOFF_FACTOR,
        backoff_max_duration=C.GPU_BACKOFF_MAX,
    )


def _scratch(task: dsl.PipelineTask, step: str) -> dsl.PipelineTask:
    """Scratch space on the node's disk for a step that stages models: /tmp is an emptyDir (see constants)."""
    return kubernetes.empty_dir_mount(
        task, volume_name=C.SCRATCH_VOLUME, mount_path=C.SCRATCH_PATH, size_limit=C.scratch_size(step)
    )


def _fixed_resources(task: dsl.PipelineTask, r: StepResources) -> dsl.PipelineTask:
    """CPU and memory requests and limits of a CPU step (constants: they do not grow with the model)."""
    task.set_cpu_request(r.cpu_request).set_cpu_limit(r.cpu_limit)
    task.set_memory_request(r.memory_request).set_memory_limit(r.memory_limit)
    return task


def _gpu_step(
    task: dsl.PipelineTask,
    gpu_resource: Any,
    gpu_count: Any,
    node_selector: Any,
    cpu: Any,
    memory: Any,
    timeout_s: int,
) -> None:
    # gpu_*/node_selector/cpu/memory: pipeline parameters (channels) or constants
    """GPU pods: GPUs, CPU and memory requested (requests == limits: Guaranteed QoS, the last pods evicted under
    node pressure; the in-memory /dev/shm counts against the memory limit), GPU taint tolerated, GPU nodes
    selected, no caching (a cached 'training' would silently reuse another run's model), a hard timeout."""
    task.set_accelerator_type(gpu_resource).set_accelerator_limit(gpu_count)
    task.set_cpu_request(cpu).set_cpu_limit(cpu).set_memory_request(memory).set_memory_limit(memory)
    task.set_caching_options(enable_caching=False)
    kubernetes.add_toleration(task, **C.GPU_TOLERATION)
    kubernetes.add_node_selector_json(task, node_selector_json=node_selector)
    kubernetes.empty_dir_mount(
        task, volume_name=C.SHM_VOLUME, mount_path="/dev/shm", medium="Memory", size_limit=C.SHM_SIZE
    )
    kubernetes.set_timeout(task, timeout_s)


@dsl.pipeline(name=C.PIPELINE_NAME, description="RLHF with RLOO: fetch SFT, train, judge, push.")
@config_help  # {stage.field} in the docstring: that config field's help (written once, in the config)
def rloo_pipeline(
    model: str,
    dataset_name: str,
    eval_dataset_name: str,
    judge_base_url: str,
    judge_model: str,
    output_uri: str,
    dataset_train_split: str = "train",
    model_revision: str = "",
    eval_dataset_split: str = "test",
    eval_num_examples: int = 0,
    eval_max_new_tokens: int = 200,
    reward_model_path: str = "",
    learning_rate: float = 3e-6,
    total_episodes: int = 10000,
    rloo_k: int = 2,
    kl_coef: float = 0.05,
    per_device_train_batch_size: int = 8,
    gradient_accumulation_steps: int = 1,
    response_length: int = 53,
    seed: int = 42,
    extra_train_args: str = "",
    gpu_resource: str = "nvidia.com/gpu",
    gpu_count: int = 1,
    num_nodes: int = 1,
    multinode_backend: str = "trainjob",
    training_runtime: str = "torch-distributed",
    queue_name: str = "",
    priority_class: str = "",
    istio_sidecar: bool = False,
    gpu_node_selector: dict = {},  # noqa: B006 - KFP reads the default, it is never mutated
    train_cpu: str = "16",
    train_memory: str = "128Gi",
    eval_cpu: str = "8",
    eval_memory: str = "64Gi",
    train_service_account: str = "default",
    namespace: str = "",
    mlflow_experiment: str = "rloo",
    production_uri: str = "",
    registered_model_name: str = "",
    register_model: bool = True,
    hub_repo_id: str = "",
    promotion_margin: float = 0.0,
    compare_to_champion: bool = True,
    s3_secret: str = "rloo-s3",
    mlflow_secret: str = "rloo-mlflow",
    hf_secret: str = "rloo-hf",
    judge_secret: str = "rloo-judge",
) -> None:
    """RLHF with RLOO: fetch the SFT model, train it, judge it against the SFT model, push it.

    Args:
        model: SFT checkpoint: Hub id, s3://bucket/prefix (an rloo upload with its manifest) or a directory.
        model_revision: Hub branch, tag or commit of a Hub id model (empty: main); the fetch resolves it to a commit and records it.
        dataset_name: Training prompts: Hub id (name or org/name), directory in the 'rloo train' layout, or s3://bucket/prefix holding one uploaded with rloo.storage.upload_dir (its manifest's SHA-256s are checked). Recorded as the train run's MLflow dataset.
        eval_dataset_name: Evaluation prompts with reference completions: Hub id, directory, or s3://bucket/prefix upload of one (rloo.storage.upload_dir). Recorded as the eval run's MLflow dataset.
        judge_base_url: OpenAI-compatible endpoint of the judge; its API key is in judge_secret.
        judge_model: {eval.judge_model}
        output_uri: s3://bucket/prefix; this run writes under <output_uri>/<run id>/ (sft, model, checkpoints, eval).
        dataset_train_split: {train.dataset_train_split}
        eval_dataset_split: {eval.dataset_split}
        eval_num_examples: Judge the first N rows only (0 = all rows).
        eval_max_new_tokens: {eval.max_new_tokens}
        reward_model_path: Reward model (Hub id or directory); or give --reward_funcs in extra_train_args.
        learning_rate: {train.learning_rate}
        total_episodes: Completions to train on in total.
        rloo_k: {train.rloo_k}
        kl_coef: {train.kl_coef}
        per_device_train_batch_size: {train.per_device_train_batch_size}
        gradient_accumulation_steps: {train.gradient_accumulation_steps}
        response_length: {train.response_length}
        seed: {train.seed}
        extra_train_args: Any other 'rloo train' flags, shell-quoted (e.g. "--bf16 --gradient_checkpointing").
        gpu_resource: Kubernetes resource name of the GPUs.
        gpu_count: GPUs per training node (>= 0); evaluation uses one.
        num_nodes: Training nodes; more than one runs a multi-node job (multinode_backend).
        multinode_backend: The multi-node job: trainjob (Kubeflow Trainer v2 TrainJob) or pytorchjob (Training Operator v1 PyTorchJob, for older clusters).
        training_runtime: Runtime a TrainJob references: NAME of a ClusterTrainingRuntime (Trainer installs torch-distributed) or TrainingRuntime/NAME in the job's namespace.
        queue_name: Kueue LocalQueue of the multi-node job (empty: not queued); the job is created suspended and Kueue starts it once admitted.
        priority_class: Priority of the multi-node job: a Kueue WorkloadPriorityClass for a TrainJob (needs queue_name), a PriorityClass for a PyTorchJob.
        istio_sidecar: Let Istio inject its sidecar into the multi-node job's pods (Kubeflow profiles do by default; it breaks rendezvous and keeps Jobs from completing).
        gpu_node_selector: Node labels GPU pods must match, e.g. {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}.
        train_cpu: CPU request and limit of each training pod (e.g. "16", "500m").
        train_memory: Memory request and limit of each training pod (e.g. "128Gi"); more than the 16Gi in-memory /dev/shm, which counts against it.
        eval_cpu: CPU request and limit of the evaluation pod.
        eval_memory: Memory request and limit of the evaluation pod; more than the 16Gi in-memory /dev/shm.
        train_service_account: Service account of the multi-node job's pods (they get no API token); create a dedicated one without permissions.
        namespace: Namespace of the multi-node job (default: the pipeline's own).
        mlflow_experiment: MLflow experiment of the pipeline (parent) run and the stage runs.
        production_uri: Where a promoted model is copied (empty: nowhere).
        registered_model_name: MLflow Model Registry name (empty: named after mlflow_experiment).
        register_model: Register a version when the MLflow secret names a tracking server (False: do not).
        hub_repo_id: Hugging Face Hub repo 'owner/name' for a promoted model (empty: not uploaded).
        promotion_margin: {push.promotion_margin}
        compare_to_champion: {push.compare_to_champion}
        s3_secret: Kubernetes secret with AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, S3_ENDPOINT_URL.
        mlflow_secret: Kubernetes secret with MLFLOW_TRACKING_URI (optional).
        hf_secret: Kubernetes secret with HF_TOKEN (optional).
        judge_secret: Kubernetes secret with OPENAI_API_KEY, the judge's API key.
    """
    params = dict(locals())  # first statement: every parameter, by name, for the validate step
    finish = finish_run(
        kfp_run_id=RUN_ID, kfp_run_name=RUN_NAME, mlflow_experiment=mlflow_experiment
    ).set_display_name("close MLflow run")
    finish.set_caching_options(enable_caching=False)
    _secrets(finish, mlflow_secret, C.MLFLOW_SECRET_KEYS, optional=True)
    _fixed_resources(finish, C.FINISH_RESOURCES)
    with dsl.ExitHandler(exit_task=finish, name="rloo"):
        # every parameter: a test keeps the two signatures equal
        check = validate_params(**params).set_display_name("validate parameters")
        kubernetes.set_timeout(check, C.VALIDATE_TIMEOUT_S)
        _fixed_resources(check, C.VALIDATE_RESOURCES)
        # optional here: a missing secret should fail as "cannot read the model", not as a pod that never starts
        _secrets(check, s3_secret, C.S3_SECRET_KEYS, optional=True)
        _secrets(check, hf_secret, C.HF_SECRET_KEYS, optional=True)

        fetch = fetch_sft(
            model=model, model_revision=model_revision, output_uri=output_uri, kfp_run_id=RUN_ID
        ).after(check)
        fetch.set_display_name("fetch SFT model")
        _io_step(fetch)
        _scratch(fetch, "fetch")
        _fixed_resources(fetch, C.FETCH_RESOURCES)
        _secrets(fetch, s3_secret, C.S3_SECRET_KEYS)
        _secrets(fetch, hf_secret, C.HF_SECRET_KEYS, optional=True)

        common = dict(kfp_run_id=RUN_ID, kfp_run_name=RUN_NAME, mlflow_experiment=mlflow_experiment)
        with dsl.If(num_nodes == 1, name="single-node"):
            # the GPU count as the validate step's text output, not the integer parameter: see validate_params
            gpu_limit = check.outputs["gpu_limit"]
            single = train_rloo(
                sft_model=fetch.outputs["sft_model"],
                train_config_json=check.outputs["train_config"],
                gpu_limit=gpu_limit,
                gpu_resource=gpu_resource,
                cpu=train_cpu,
                memory=train_memory,
                output_uri=output_uri,
                **common,
            ).set_display_name("train (RLOO)")
            _gpu_step(
                single, gpu_resource, gpu_limit, gpu_node_selector, train_cpu, train_memory, C.TRAIN_TIMEOUT_S
            )
            _retried(single)
            _scratch(single, "train")
            for task_secrets in (
                (s3_secret, C.S3_SECRET_KEYS, False),
                (mlflow_secret, C.MLFLOW_SECRET_KEYS, True),
            ):
                _secrets(single, *task_secrets)
            _secrets(single, hf_secret, C.HF_SECRET_KEYS, optional=True)
        with dsl.Else(name="multi-node"):
            multi = train_rloo_multinode(
                sft_model=fetch.outputs["sft_model"],
                train_config_json=check.outputs["train_config"],
                gpu_count=gpu_count,
                num_nodes=num_nodes,
                gpu_resource=gpu_resource,
                node_selector=gpu_node_selector,
                output_uri=output_uri,
                namespace=namespace,
                train_image=images.TRAIN_IMAGE,
                s3_secret=s3_secret,
                mlflow_secret=mlflow_secret,
                hf_secret=hf_secret,
                cpu=train_cpu,
                memory=train_memory,
                service_account=train_service_account,
                multinode_backend=multinode_backend,
                training_runtime=training_runtime,
                queue_name=queue_name,
                priority_class=priority_class,
                istio_sidecar=istio_sidecar,
                scratch_size=C.scratch_size("train"),  # compiled in, like the single-node step's
                **common,
            ).set_display_name("train (RLOO, multi-node)")
            # the launcher holds no GPU; the job's own pods get the GPU settings from the manifest
            multi.set_caching_options(enable_caching=False)
            _fixed_resources(multi, C.LAUNCHER_RESOURCES)
            kubernetes.set_timeout(multi, C.TRAIN_TIMEOUT_S)
            _retried(multi)
            for env, field_path in C.POD_FIELD_ENV.items():  # the job's owner: this pod
                kubernetes.use_field_path_as_env(multi, env_name=env, field_path=field_path)
        # a parameter, not the Model artifacts: kfp.local (rloo pipeline run --local) selects only parameters
        trained = dsl.OneOf(single.outputs["Output"], multi.outputs["Output"])

        judge = evaluate(
            trained_model_uri=trained,
            sft_model=fetch.outputs["sft_model"],
            dataset_name=eval_dataset_name,
            dataset_split=eval_dataset_split,
            num_examples=eval_num_examples,
            max_new_tokens=eval_max_new_tokens,
            judge_base_url=judge_base_url,
            judge_model=judge_model,
            output_uri=output_uri,
            **common,
        ).set_display_name("evaluate (LLM judge)")
        _gpu_step(judge, gpu_resource, 1, gpu_node_selector, eval_cpu, eval_memory, C.EVAL_TIMEOUT_S)
        _retried(judge)
        _scratch(judge, "eval")
        _secrets(judge, s3_secret, C.S3_SECRET_KEYS)
        _secrets(judge, mlflow_secret, C.MLFLOW_SECRET_KEYS, optional=True)
        _secrets(judge, judge_secret, C.JUDGE_SECRET_KEYS)

        push = push_model(
            trained_model_uri=trained,
            sft_model=fetch.outputs["sft_model"],
            eval_results=judge.outputs["Output"],
            output_uri=output_uri,
            production_uri=production_uri,
            registered_model_name=registered_model_name,
            register_model=register_model,
            hub_repo_id=hub_repo_id,
            promotion_margin=promotion_margin,
            compare_to_champion=compare_to_champion,
            **common,
        ).set_display_name("push")
        _io_step(push)
        _scratch(push, "push")
        _fixed_resources(push, C.PUSH_RESOURCES)
        _secrets(push, s3_secret, C.S3_SECRET_KEYS)
        _secrets(push, mlflow_secret, C.MLFLOW_SECRET_KEYS, optional=True)
        _secrets(push, hf_secret, C.HF_SECRET_KEYS, optional=True)
