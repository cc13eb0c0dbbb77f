"""RLOO training as a multi-node job (Kubeflow Trainer TrainJob, or a training-operator PyTorchJob) launched
from a CPU pod, which follows it to the end."""

from kfp import dsl
from kfp.dsl import Input, Model, Output

from rloo.pipeline.images import SLIM_IMAGE


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
    from rloo.stages import train
    from rloo.stages.context import step

    with step("train-multinode", kfp_run_id, plan=plan) as s:
        sft = dict(sft_model.metadata)
        done = train.train_on_cluster(
            s.plan, kfp_run_id, kfp_run_name, sft=sft, image=train_image, scratch_size=scratch_size
        )
    return done.write(model=trained_model)
