"""What faces Kubeflow Pipelines: the parameter table and the pipeline's signature made from it, image names,
compile / local run / upload / submit, the KFP UI's summaries, the platform applied to a compiled package.
The steps' work is :mod:`rloo.stages`; the cluster plumbing :mod:`rloo.k8s`.

Everything here imports the standard library only at module level, so the pipeline compiles without torch;
``kfp`` is imported by :mod:`rloo.pipeline.compile` when it is used.
"""
