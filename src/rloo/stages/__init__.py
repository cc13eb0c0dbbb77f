"""The pipeline's steps as library code: one module per step (:mod:`~rloo.stages.validate`,
:mod:`~rloo.stages.fetch`, :mod:`~rloo.stages.train`, :mod:`~rloo.stages.evaluate`, :mod:`~rloo.stages.push`,
:mod:`~rloo.stages.finish`), each with one ``run(...)`` that returns a :class:`~rloo.stages.context.StepResult`,
and the :class:`~rloo.stages.plan.PipelinePlan` that the validate step builds once and every later step reads.

The step modules do not import each other: what they share is a module of its own (the plan, the run's
layout, :mod:`~rloo.stages.sft` for the SFT model, :mod:`~rloo.stages.context` for what every step does
around its work: the run's environment, giving up after a failure for good, one line per user error).

Nothing here imports KFP: the components in ``components/`` only unpack KFP's types, and :mod:`rloo.pipeline`
holds what faces KFP (compile, submit, local runs, the parameter table, the UI's reports).
"""
