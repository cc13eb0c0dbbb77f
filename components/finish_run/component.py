"""Exit handler: delete the run's multi-node job if the run left it behind (KFP terminating the run kills the
train step before its own clean-up), and close the MLflow parent run of this pipeline run, FAILED unless the
run succeeded."""

from kfp import dsl

from rloo.pipeline.images import SLIM_IMAGE


@dsl.component(base_image=SLIM_IMAGE, install_kfp_package=False)
def finish_run(
    status: dsl.PipelineTaskFinalStatus,
    kfp_run_id: str,
    kfp_run_name: str,
    mlflow_experiment: str,
    namespace: str,
) -> str:
    """``namespace``: the multi-node job's (the pipeline's ``namespace`` parameter; empty: this pod's own,
    which the downward API gives it). Returns what the MLflow run was closed as."""
    from rloo.stages import finish
    from rloo.stages.context import step

    with step("finish", kfp_run_id):  # it runs whether or not validate did: no plan, nothing to give up
        done = finish.run(
            status.state,
            run_id=kfp_run_id,
            run_name=kfp_run_name,
            experiment=mlflow_experiment,
            error=status.error_message,
            namespace=namespace,
        )
    return done.write()
