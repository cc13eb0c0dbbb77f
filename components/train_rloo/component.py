"""RLOO training: on this pod's GPUs (one node) or as a multi-node job (Kubeflow Trainer TrainJob, or a
training-operator PyTorchJob) launched from a CPU pod."""

from kfp import dsl
from kfp.dsl import Input, Markdown, Metrics, Model, Output

from rloo.pipeline.images import SLIM_IMAGE, TRAIN_IMAGE


@dsl.component(base_image=TRAIN_IMAGE, install_kfp_package=False)
def train_rloo(
    sft_model: Input[Model],
    train_config_json: str,
    gpu_limit: str,
    gpu_resource: str,
    cpu: str,
    memory: str,
    output_uri: str,
    kfp_run_id: str,
    kfp_run_name: str,
    mlflow_experiment: str,
    trained_model: Output[Model],
    metrics: Output[Metrics],
    summary: Output[Markdown],
) -> str:
    """Returns the trained model's URI (a parameter, so the pipeline can pick it with dsl.OneOf in every
    runner; the Model artifact records it for lineage).

    ``gpu_limit``, ``gpu_resource``, ``cpu`` and ``memory`` are what this pod's spec requests (the pipeline
    sets them from the same values); the step checks it got the GPUs. As inputs they also reach the condition
    DAG the step runs in, which KFP's compiler does not do for values only a pod-spec field uses."""
    import json
    import os
    import shutil
    import sys
    import tempfile
    from pathlib import Path

    import torch

    from rloo.errors import UserError
    from rloo.pipeline import reports
    from rloo.pipeline.layout import RunLayout
    from rloo.pipeline.node import main as node_main
    from rloo.pipeline.resources import gpus_granted
    from rloo.pipeline.retry import give_up_on_user_errors

    try:
        gpu_count = gpus_granted(gpu_limit, gpu_resource, torch.cuda.device_count())
    except UserError as e:
        print(f"[rloo] {e}", file=sys.stderr)
        raise SystemExit(1) from None  # retryable: the retried pod may land on a node that grants them
    print(f"[rloo] pod: {gpu_count} x {gpu_resource}, cpu {cpu}, memory {memory}", flush=True)

    os.environ.update(
        KFP_RUN_ID=kfp_run_id, KFP_RUN_NAME=kfp_run_name, MLFLOW_EXPERIMENT_NAME=mlflow_experiment
    )
    layout = RunLayout(output_uri, kfp_run_id)
    # a retried attempt resumes from the run's checkpoints; one after a failure for good stops at once
    with give_up_on_user_errors(layout.root, "train"):
        argv = ["--sft_uri", sft_model.metadata["uri"], "--model_uri", layout.model]
        argv += [
            "--checkpoint_uri",
            layout.checkpoints,
            "--nproc_per_node",
            str(gpu_count),
            "--num_nodes",
            "1",
        ]
        work = os.environ.get("RLOO_WORK_DIR") or tempfile.mkdtemp(prefix="rloo-train-")
        argv += ["--work_dir", work]
        try:
            rc = node_main([*argv, "--train_config", train_config_json])
            if rc != 0:
                raise SystemExit(rc)
            trained_model.metadata.update(
                {"uri": layout.model, "sft_manifest_digest": sft_model.metadata.get("manifest_digest", "")}
            )
            with open(trained_model.path, "w") as f:
                json.dump(dict(trained_model.metadata), f)
            out = Path(work) / "output"
            headline = reports.train_headline(reports.read_history(out))
            for name, value in headline.items():
                metrics.log_metric(name, value)
            link = reports.stage_run_link("train", kfp_run_id)
            with open(summary.path, "w") as f:
                f.write(reports.train_markdown(headline, layout.model, link, reports.latest_samples(out)))
        finally:
            if not os.environ.get(
                "RLOO_WORK_DIR"
            ):  # a temporary copy: the model and checkpoints are in the store
                shutil.rmtree(work, ignore_errors=True)
    return trained_model.metadata["uri"]


@dsl.component(base_image=SLIM_IMAGE, install_kfp_package=False)
def train_rloo_multinode(
    sft_model: Input[Model],
    train_config_json: str,
    gpu_count: int,
    num_nodes: int,
    gpu_resource: str,
    node_selector: dict,
    output_uri: str,
    namespace: str,
    train_image: str,
    s3_secret: str,
    mlflow_secret: str,
    hf_secret: str,
    cpu: str,
    memory: str,
    service_account: str,
    multinode_backend: str,
    training_runtime: str,
    queue_name: str,
    priority_class: str,
    istio_sidecar: bool,
    scratch_size: str,
    kfp_run_id: str,
    kfp_run_name: str,
    mlflow_experiment: str,
    trained_model: Output[Model],
) -> str:
    """Returns the trained model's URI (a parameter, so the pipeline can pick it with dsl.OneOf in every
    runner; the Model artifact records it for lineage). The job is owned by this step's pod (the downward API
    gives its name and uid), so deleting the pod deletes the job."""
    import json
    import os
    from pathlib import Path

    from rloo.pipeline.jobs import run_multi_node
    from rloo.pipeline.layout import RunLayout
    from rloo.pipeline.retry import give_up_on_user_errors
    from rloo.pipeline.steps import multinode_spec
    from rloo.pipeline.trainjob import build_job, owner_from_env

    spec = multinode_spec(
        run_id=kfp_run_id,
        run_name=kfp_run_name,
        sft_uri=sft_model.metadata["uri"],
        train_config=json.loads(train_config_json),
        output_uri=output_uri,
        namespace=namespace
        or Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace").read_text().strip(),
        image=train_image,  # the compile-time train image: the same one the single-node step uses
        gpu_count=gpu_count,
        num_nodes=num_nodes,
        gpu_resource=gpu_resource,
        node_selector=node_selector,
        cpu=cpu,
        memory=memory,
        service_account=service_account,
        s3_secret=s3_secret,
        mlflow_secret=mlflow_secret,
        hf_secret=hf_secret,
        mlflow_experiment=mlflow_experiment,
        queue_name=queue_name,
        priority_class=priority_class,
        istio_sidecar=istio_sidecar,
        owner=owner_from_env(os.environ),
        scratch_size=scratch_size,
    )
    # a retried launcher adopts the job if it still runs; one after a failure for good stops at once
    with give_up_on_user_errors(RunLayout(output_uri, kfp_run_id).root, "train-multinode"):
        run_multi_node(build_job(spec, multinode_backend, training_runtime))
    trained_model.metadata.update({"uri": spec.model_uri, "num_nodes": num_nodes})
    with open(trained_model.path, "w") as f:
        json.dump(dict(trained_model.metadata), f)
    return trained_model.metadata["uri"]
