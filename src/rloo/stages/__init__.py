"""The pipeline's steps as library code: one module per step (:mod:`~rloo.stages.validate`,
:mod:`~rloo.stages.fetch`, :mod:`~rloo.stages.train`, :mod:`~rloo.stages.evaluate`, :mod:`~rloo.stages.push`,
:mod:`~rloo.stages.finish`), each with one ``run(...)`` that its KFP component calls, and the
:class:`~rloo.stages.plan.StagePlan` that the validate step builds once and every later step reads.

Nothing here imports KFP: the components in ``components/`` only unpack KFP's types, and :mod:`rloo.pipeline`
holds what faces KFP (compile, submit, local runs, the parameter table, the UI's reports).
"""
