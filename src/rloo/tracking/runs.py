"""Nothing of its own: MLflow's runs are recorded by :mod:`rloo.tracking.server` (where, and whether the store
can be used), :mod:`rloo.tracking.lifecycle` (start, take over, close), :mod:`rloo.tracking.tags`,
:mod:`rloo.tracking.descriptions`, :mod:`rloo.tracking.summary` and :mod:`rloo.tracking.experiment`."""

# importers in rloo.stages move at integration (rloo.stages.finish; rloo.training.trainer too)
from rloo.tracking.server import configure_mlflow_http
from rloo.tracking.tags import TAG_OUTPUT_DIR

__all__ = ["TAG_OUTPUT_DIR", "configure_mlflow_http"]
