"""RLOO training: on this pod's GPUs (one node) or as a multi-node job (Kubeflow Trainer TrainJob, or a
training-operator PyTorchJob) launched from a CPU pod."""

from kfp import dsl
from kfp.dsl import Input, Markdown, Metrics, Model, Output

from rloo.pipeline.images import SLIM_IMAGE, TRAIN_IMAGE


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
    from rloo.k8s.resources import gpus_granted
    from rloo.pipeline import reports
    from rloo.stages import train
    from rloo.stages.plan import StagePlan

    try:
        gpu_count = gpus_granted(gpu_limit, gpu_resource, torch.cuda.device_count())
    except UserError as e:
        print(f"[rloo] {e}", file=sys.stderr)
        raise SystemExit(1) from None  # retryable: the retried pod may land on a node that grants them
    print(f"[rloo] pod: {gpu_count} x {gpu_resource}, cpu {cpu}, memory {memory}", flush=True)

    stage_plan = StagePlan.from_json(plan)
    os.environ.update(stage_plan.run_env(kfp_run_id, kfp_run_name))
    # RLOO_WORK_DIR: a directory kept after the step (local runs); else a temporary copy, removed after
    work = os.environ.get("RLOO_WORK_DIR") or tempfile.mkdtemp(prefix="rloo-train-")
    try:
        model_uri = train.run_single_node(
            stage_plan, kfp_run_id, sft_uri=sft_model.metadata["uri"], gpu_count=gpu_count, work=work
        )
        trained_model.metadata.update(
            {"uri": model_uri, "sft_manifest_digest": sft_model.metadata.get("manifest_digest", "")}
        )
        with open(trained_model.path, "w") as f:
            json.dump(dict(trained_model.metadata), f)
        out = Path(work) / "output"
        headline = reports.train_headline(reports.read_history(out))
        for name, value in headline.items():
            metrics.log_metric(name, value)
        link = reports.stage_run_link("train", kfp_run_id)
        with open(summary.path, "w") as f:
            f.write(reports.train_markdown(headline, model_uri, link, reports.latest_samples(out)))
    finally:
        if not os.environ.get("RLOO_WORK_DIR"):
            shutil.rmtree(work, ignore_errors=True)
    return model_uri


@dsl.component(base_image=SLIM_IMAGE, install_kfp_package=False)
def train_rloo_multinode(
    sft_model: Input[Model],
    plan: str,
    train_image: str,
    scratch_size: str,
    kfp_run_id: str,
    kfp_run_name: str,
    trained_model: Output[Model],
) -> str:
    """Returns the trained model's URI (a parameter, so the pipeline can pick it with dsl.OneOf in every
    runner; the Model artifact records it for lineage). ``train_image`` and ``scratch_size`` are fixed when
    the pipeline is compiled (the upload's platform may set the image): the job's pods get the single-node
    step's."""
    import json

    from rloo.stages import train
    from rloo.stages.plan import StagePlan

    stage_plan = StagePlan.from_json(plan)
    model_uri = train.run_multi_node(
        stage_plan,
        kfp_run_id,
        kfp_run_name,
        sft_uri=sft_model.metadata["uri"],
        image=train_image,
        scratch_size=scratch_size,
    )
    trained_model.metadata.update({"uri": model_uri, "num_nodes": stage_plan.cluster.num_nodes})
    with open(trained_model.path, "w") as f:
        json.dump(dict(trained_model.metadata), f)
    return model_uri
