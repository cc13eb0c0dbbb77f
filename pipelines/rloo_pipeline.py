"""The RLOO RLHF pipeline: validate -> fetch SFT -> train (1 node, or a multi-node TrainJob/PyTorchJob) -> evaluate -> push,
inside an exit handler that closes the MLflow parent run (FAILED when a step failed).

Wiring only: the parameters are declared on the config fields they set (``option(..., pipeline=...)``, see
:mod:`rloo.stages.plan`), the validate step turns them into the run's plan, and every later step reads its
part of the plan; each step's work is one ``run(...)`` in :mod:`rloo.stages`.

Compile with ``rloo pipeline compile`` (writes ``pipelines/rloo_pipeline.yaml``, which is committed).
"""

# no "from __future__ import annotations": KFP reads the parameter annotations as types

from typing import Any

from kfp import dsl, kubernetes

from components.evaluate.component import evaluate
from components.fetch_sft.component import fetch_sft
from components.finish_run.component import finish_run
from components.push_model.component import push_model
from components.train_rloo.component import train_rloo
from components.train_rloo_multinode.component import train_rloo_multinode
from components.validate.component import validate_params
from rloo.k8s.resources import StepResources
from rloo.pipeline import images
from rloo.pipeline.compile import PIPELINE_NAME
from rloo.pipeline.params import pipeline_signature
from rloo.stages import constants as C

RUN_ID = dsl.PIPELINE_JOB_ID_PLACEHOLDER
RUN_NAME = dsl.PIPELINE_JOB_NAME_PLACEHOLDER


def _secrets(task: dsl.PipelineTask, name: str, keys: dict[str, str], optional: bool = False) -> None:
    kubernetes.use_secret_as_env(task, secret_name=name, secret_key_to_env=keys, optional=optional)


def _retried(task: dsl.PipelineTask, policy: C.RetryPolicy) -> dsl.PipelineTask:
    """Retries and each attempt's deadline from one policy, whose window (Argo's ``backoff.maxDuration``, counted
    from the first attempt's start) covers every attempt at its full deadline and every backoff. A retried
    train step resumes from the run's checkpoints, a retried launcher adopts its job; a failure no retry heals
    stops every later attempt at once (rloo.stages.retry)."""
    task.set_retry(
        num_retries=policy.retries,
        backoff_duration=f"{policy.backoff_s}s",
        backoff_factor=float(policy.factor),
        backoff_max_duration=f"{policy.max_duration_s}s",
    )
    kubernetes.set_timeout(task, policy.timeout_s)
    return task


def _pod_fields(task: dsl.PipelineTask) -> None:
    """This pod's name, uid and namespace from the downward API (the multi-node job's owner and namespace)."""
    for env, field_path in C.POD_FIELD_ENV.items():
        kubernetes.use_field_path_as_env(task, env_name=env, field_path=field_path)


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
    tolerations: Any,
    cpu: Any,
    memory: Any,
) -> None:
    # gpu_*/node_selector/tolerations/cpu/memory: pipeline parameters (channels) or validate step outputs
    """GPU pods: GPUs, CPU and memory requested, the GPU pools' taints tolerated and their nodes selected, no
    caching (a cached 'training' would silently reuse another run's model).

    The step's container asks requests == limits, but the pod is Burstable, not Guaranteed: KFP's launcher
    init container asks 0.1 CPU with a 0.5 CPU / 256Mi limit and no memory request (KFP
    backend/src/v2/compiler/argocompiler/argo.go, launcherResources). Under node pressure the kubelet evicts
    pods using more than they requested first; these never do, so BestEffort pods and pods over their requests
    go before them. The in-memory /dev/shm counts against the memory limit."""
    task.set_accelerator_type(gpu_resource).set_accelerator_limit(gpu_count)
    task.set_cpu_request(cpu).set_cpu_limit(cpu).set_memory_request(memory).set_memory_limit(memory)
    task.set_caching_options(enable_caching=False)
    kubernetes.add_toleration(task, **C.GPU_TOLERATION)
    kubernetes.add_toleration_json(task, toleration_json=tolerations)  # the pools' own taints
    kubernetes.add_node_selector_json(task, node_selector_json=node_selector)
    kubernetes.empty_dir_mount(
        task, volume_name=C.SHM_VOLUME, mount_path="/dev/shm", medium="Memory", size_limit=C.SHM_SIZE
    )


@dsl.pipeline(name=PIPELINE_NAME, description="RLHF with RLOO: fetch SFT, train, judge, push.")
@pipeline_signature  # the parameters: every config field declared with option(..., pipeline=...)
def rloo_pipeline(p: dict[str, Any]) -> None:
    """RLHF with RLOO: fetch the SFT model, train it, judge it against the SFT model, push it."""
    finish = finish_run(
        kfp_run_id=RUN_ID,
        kfp_run_name=RUN_NAME,
        mlflow_experiment=p["mlflow_experiment"],
        namespace=p["namespace"],
    ).set_display_name("close MLflow run")
    finish.set_caching_options(enable_caching=False)
    _secrets(finish, p["mlflow_secret"], C.MLFLOW_SECRET_KEYS, optional=True)
    _fixed_resources(finish, C.FINISH_RESOURCES)
    # the exit handler also runs when the run is terminated: it deletes the run's multi-node job, which the
    # launcher (killed with no time after SIGTERM) may have left running
    _pod_fields(finish)
    with dsl.ExitHandler(exit_task=finish, name="rloo"):
        # every parameter: a test keeps the two signatures equal
        check = validate_params(**p).set_display_name("validate parameters")
        # never cached: a resubmission must check the bucket, the model, the data and the secrets again
        check.set_caching_options(enable_caching=False)
        kubernetes.set_timeout(check, C.VALIDATE_TIMEOUT_S)
        _fixed_resources(check, C.VALIDATE_RESOURCES)
        # optional here, every secret a later step mounts: the step names what is missing in one line, before
        # any GPU is requested (a later step's missing secret is CreateContainerConfigError, which holds its
        # scheduled pod until the deadline)
        for param, (keys, _) in C.STEP_SECRETS.items():
            _secrets(check, p[param], keys, optional=True)
        # every later step reads its part of the plan the validate step built, not the raw parameters
        plan = check.outputs["plan"]
        run = dict(kfp_run_id=RUN_ID, kfp_run_name=RUN_NAME)

        fetch = fetch_sft(plan=plan, kfp_run_id=RUN_ID).set_display_name("fetch SFT model")
        _retried(fetch, C.io_retry())
        _scratch(fetch, "fetch")
        _fixed_resources(fetch, C.FETCH_RESOURCES)
        _secrets(fetch, p["s3_secret"], C.S3_SECRET_KEYS)
        _secrets(fetch, p["hf_secret"], C.HF_SECRET_KEYS, optional=True)
        sft = fetch.outputs["sft_model"]

        with dsl.If(p["num_nodes"] == 1, name="single-node"):
            # the GPU count as the validate step's text output, not the integer parameter: see validate_params
            gpu_limit = check.outputs["gpu_limit"]
            single = train_rloo(
                sft_model=sft,
                plan=plan,
                gpu_limit=gpu_limit,
                gpu_resource=p["gpu_resource"],
                cpu=p["train_cpu"],
                memory=p["train_memory"],
                **run,
            ).set_display_name("train (RLOO)")
            _gpu_step(
                single,
                p["gpu_resource"],
                gpu_limit,
                p["gpu_node_selector"],
                p["gpu_tolerations"],
                p["train_cpu"],
                p["train_memory"],
            )
            _retried(single, C.TRAIN_RETRY)
            _scratch(single, "train")
            _secrets(single, p["s3_secret"], C.S3_SECRET_KEYS)
            _secrets(single, p["mlflow_secret"], C.MLFLOW_SECRET_KEYS, optional=True)
            _secrets(single, p["hf_secret"], C.HF_SECRET_KEYS, optional=True)
            # a judge reward (--judge_reward_coef in extra_train_args) reads the judge's key; other runs do not
            _secrets(single, p["judge_secret"], C.JUDGE_SECRET_KEYS, optional=True)
        with dsl.Else(name="multi-node"):
            multi = train_rloo_multinode(
                sft_model=sft,
                plan=plan,
                train_image=images.TRAIN_IMAGE,
                scratch_size=C.scratch_size("train"),  # compiled in, like the single-node step's
                **run,
            ).set_display_name("train (RLOO, multi-node)")
            # the launcher holds no GPU; the job's own pods get the GPU settings from the plan
            multi.set_caching_options(enable_caching=False)
            # the run's store: where a failure for good is recorded, and read first by a retried launcher
            _secrets(multi, p["s3_secret"], C.S3_SECRET_KEYS)
            _fixed_resources(multi, C.LAUNCHER_RESOURCES)
            _retried(multi, C.LAUNCHER_RETRY)
            _pod_fields(multi)  # the job's owner: this pod
        # a parameter, not the Model artifacts: kfp.local (rloo pipeline run --local) selects only parameters
        trained = dsl.OneOf(single.outputs["Output"], multi.outputs["Output"])

        judge = evaluate(trained_model_uri=trained, sft_model=sft, plan=plan, **run)
        judge.set_display_name("evaluate (LLM judge)")
        _gpu_step(
            judge,
            p["gpu_resource"],
            check.outputs["eval_gpu_limit"],  # one GPU, none on a CPU cluster (gpu_count 0)
            p["gpu_node_selector"],
            p["gpu_tolerations"],
            p["eval_cpu"],
            p["eval_memory"],
        )
        _retried(judge, C.EVAL_RETRY)
        _scratch(judge, "eval")
        _secrets(judge, p["s3_secret"], C.S3_SECRET_KEYS)
        _secrets(judge, p["mlflow_secret"], C.MLFLOW_SECRET_KEYS, optional=True)
        _secrets(judge, p["judge_secret"], C.JUDGE_SECRET_KEYS)
        # the training reward model scores the judged pairs (the judge/reward-model agreement): a private or
        # gated Hub id needs the token training read it with
        _secrets(judge, p["hf_secret"], C.HF_SECRET_KEYS, optional=True)

        push = push_model(
            trained_model_uri=trained, sft_model=sft, eval_results=judge.outputs["Output"], plan=plan, **run
        ).set_display_name("push")
        _retried(push, C.io_retry())
        _scratch(push, "push")
        _fixed_resources(push, C.PUSH_RESOURCES)
        _secrets(push, p["s3_secret"], C.S3_SECRET_KEYS)
        _secrets(push, p["mlflow_secret"], C.MLFLOW_SECRET_KEYS, optional=True)
        _secrets(push, p["hf_secret"], C.HF_SECRET_KEYS, optional=True)
