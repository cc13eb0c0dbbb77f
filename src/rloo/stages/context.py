"""What every KFP step does around its own work, in one place: :func:`step` sets the run's environment,
stops a retried attempt at once after a failure no retry heals, and turns a :class:`rloo.errors.UserError`
into one line and its exit status (2, or 75 for a service out of reach: KFP's retry may heal that); the
step's ``run`` returns a :class:`StepResult`, which :meth:`StepResult.write` copies into the component's KFP
outputs. A component is then its signature, the step's call and the summary it shows.

Nothing here imports KFP: the components pass their ``dsl.Output`` objects in as they are.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from rloo.errors import UserError
from rloo.stages.layout import RunLayout
from rloo.stages.plan import PipelinePlan
from rloo.stages.retry import give_up_on_user_errors


@dataclass(frozen=True)
class StepResult:
    """What a step hands its component, whichever step it is."""

    output: str = ""  # the component's return value (a KFP parameter)
    outputs: tuple[str, ...] = ()  # further return values, in the component's NamedTuple order
    model: dict[str, Any] | None = None  # the metadata of the step's Model artifact, also its file
    metrics: dict[str, float] = field(default_factory=dict)  # the step's KFP metrics
    report_html: str = ""  # the step's HTML report
    record: Any = None  # what the step's summary is made from (its plan, fetch record, push result)

    def write(self, *, model: Any = None, metrics: Any = None, report: Any = None, summary: Any = None,
              markdown: str = "") -> str:  # fmt: skip
        """Copy the result into the component's outputs (``dsl.Output`` artifacts: a ``Model``, ``Metrics``,
        ``HTML`` and the ``Markdown`` ``summary``, which gets ``markdown``); returns :attr:`output`."""
        if model is not None and self.model is not None:
            # the files stay in our bucket (metadata "uri"): the KFP artifact is only this small record, so
            # KFP's launcher never copies gigabytes between its own store and ours
            model.metadata.update(self.model)
            _write(model.path, json.dumps(dict(model.metadata)))
        for name, value in self.metrics.items() if metrics is not None else ():
            metrics.log_metric(name, value)
        if report is not None:
            _write(report.path, self.report_html)
        if summary is not None:
            _write(summary.path, markdown)
        return self.output


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


@dataclass(frozen=True)
class Step:
    """The step being run: its name, the KFP run and, for the steps after validate, the run's plan."""

    name: str
    run_id: str
    plan: PipelinePlan | None

    @property
    def layout(self) -> RunLayout:
        assert self.plan is not None  # only the steps that read a plan have a layout
        return RunLayout(self.plan.run.output_uri, self.run_id)


@contextlib.contextmanager
def step(
    name: str,
    run_id: str = "",
    *,
    plan: str = "",
    run_name: str | None = None,
    give_up: bool = True,
    says: str = "[rloo]",
) -> Iterator[Step]:
    """Run the body of step ``name`` of KFP run ``run_id``; ``plan``: the validate step's plan (JSON), for
    every later step.

    - The environment: ``KFP_RUN_ID``, and with ``run_name`` what the step's MLflow tracking reads
      (:meth:`PipelinePlan.run_env`).
    - ``give_up`` (a step with a plan, which KFP retries): an attempt after one that failed for good stops
      at once, and a failure for good is recorded for the next (:mod:`rloo.stages.retry`).
    - A UserError: the line ``<says> <message>`` on stderr and its exit status, never a traceback (KFP would
      retry a traceback's exit 1 as if a retry could heal a bad value).
    """
    try:
        with contextlib.ExitStack() as stack:
            parsed = PipelinePlan.from_json(plan) if plan else None
            if run_id:
                os.environ["KFP_RUN_ID"] = run_id
            if parsed is not None and run_name is not None:
                os.environ.update(parsed.run_env(run_id, run_name))
            current = Step(name, run_id, parsed)
            if parsed is not None and give_up:
                stack.enter_context(give_up_on_user_errors(current.layout.root, name))
            yield current
    except UserError as e:
        print(f"{says} {e}", file=sys.stderr, flush=True)
        raise SystemExit(e.exit_code) from None
