"""Demo fixtures: everything a run needs built locally, nothing downloaded, for ``rloo demo``, ``rloo pipeline
run --local``, the tests and the benchmarks.

- :mod:`rloo.demo.tiny`: tiny random-initialised models of real architectures and their tokenizer;
- :mod:`rloo.demo.toy`: the toy prompt dataset, evaluation set and reward functions (``rloo.demo.toy:letter_reward``);
- :mod:`rloo.demo.judge`: a local OpenAI-compatible judge for the toy task;
- :mod:`rloo.demo.pipeline`: the embedded defaults of ``rloo pipeline run --local``;
- :mod:`rloo.demo.cli`: the ``rloo demo`` command.

Nothing in the production layers imports this package (the import-linter contracts in pyproject.toml): the CLI
hands the local-run defaults to :func:`rloo.pipeline.local.run_pipeline_locally`.
"""
