"""The Kubeflow pipeline around the library: image names, pure builders (the multi-node training job, the
training command line, parameter validation) and compile/run helpers.

Everything here imports the standard library only at module level, so the pipeline compiles without torch;
``kfp`` is imported by :mod:`rloo.pipeline.compile` when it is used.
"""
