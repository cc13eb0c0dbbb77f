"""Exit handler: close the MLflow parent run of this pipeline run, FAILED if any step failed."""

from kfp import dsl

from rloo.pipeline.images import SLIM_IMAGE


@dsl.component(base_image=SLIM_IMAGE, install_kfp_package=False)
def finish_run(
    status: dsl.PipelineTaskFinalStatus, kfp_run_id: str, kfp_run_name: str, mlflow_experiment: str
) -> str:
    import os

    os.environ["MLFLOW_EXPERIMENT_NAME"] = mlflow_experiment
    if not os.environ.get("MLFLOW_TRACKING_URI"):
        return "no tracking server"  # nothing was tracked, nothing to close
    from rloo.tracking import finish_pipeline_run

    state = "FINISHED" if status.state == "SUCCEEDED" else "FAILED"
    finish_pipeline_run(
        state,
        pipeline_run_id=kfp_run_id,
        pipeline_run_name=kfp_run_name,
        experiment=mlflow_experiment,
        error=status.error_message if state == "FAILED" else None,
    )
    return state
