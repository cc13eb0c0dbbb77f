"""Exit handler: close the MLflow parent run of this pipeline run, FAILED if any step failed."""

from kfp import dsl

from rloo.pipeline.images import SLIM_IMAGE


@dsl.component(base_image=SLIM_IMAGE, install_kfp_package=False)
def finish_run(
    status: dsl.PipelineTaskFinalStatus, kfp_run_id: str, kfp_run_name: str, mlflow_experiment: str
) -> str:
    from rloo.stages import finish

    return finish.run(
        status.state,
        run_id=kfp_run_id,
        run_name=kfp_run_name,
        experiment=mlflow_experiment,
        error=status.error_message,
    )
