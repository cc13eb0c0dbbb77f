"""``components/validate/component.py``, written from the parameter declarations.

KFP runs a component's own function source, and the validate step takes every pipeline parameter by name
and type: its signature is the parameter list, which the config fields declare
(:func:`rloo.stages.plan.pipeline_fields`). ``rloo pipeline compile`` writes the file from them (as it
writes ``pipelines/README.md``'s table), and a test keeps the committed file equal to :func:`render`'s.
"""

from __future__ import annotations

from pathlib import Path

HEAD = '''"""First step: the run's plan (every stage's part) from the pipeline parameters, on a CPU pod, before any GPU.

Written by ``rloo pipeline compile`` (rloo.pipeline.validate_component) from the parameters the config fields
declare: edit those, not this file. KFP runs this function's own source, so every parameter is listed here;
each one is checked here, and the later steps read the plan instead."""

from typing import NamedTuple

from kfp import dsl
from kfp.dsl import Markdown, Output

from rloo.pipeline.images import SLIM_IMAGE


@dsl.component(base_image=SLIM_IMAGE, install_kfp_package=False)
def validate_params(
'''

TAIL = '''    summary: Output[Markdown],
) -> NamedTuple("Validated", [("plan", str), ("gpu_limit", str), ("eval_gpu_limit", str)]):
    """Returns the plan (:class:`rloo.stages.plan.PipelinePlan` as JSON) and the training and evaluation pods'
    GPU counts as text: KFP's driver reads a pod-spec placeholder as a string (``GetStringValue``), so an
    integer pipeline parameter there would resolve to nothing and the pod would get no GPU."""
    params = {k: v for k, v in locals().items() if k != "summary"}  # first statement: the parameters
    from rloo.pipeline.reports import plan_markdown
    from rloo.stages import validate
    from rloo.stages.context import step

    # the model is looked up here (directory, s3:// upload or Hub repo), before any GPU is requested
    with step("validate", says="invalid pipeline parameters:"):
        done = validate.run(params)
    done.write(summary=summary, markdown=plan_markdown(done.record))
    return (done.output, *done.outputs)  # the annotation's order
'''


def render() -> str:
    """The component's source: one ``name: type`` parameter per pipeline parameter, in the pipeline's order."""
    from rloo.stages.plan import pipeline_fields

    params = "".join(f"    {p.name}: {p.type.__name__},\n" for p in pipeline_fields())
    return HEAD + params + TAIL


def component_path(root: Path) -> Path:
    return root / "components" / "validate" / "component.py"
