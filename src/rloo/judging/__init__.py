"""An LLM judge over any OpenAI-compatible chat API, shared by the evaluation (win rates against references,
:mod:`rloo.eval`) and training (the judge as a reward source, :mod:`rloo.training.judge_reward`).

- :mod:`~rloo.judging.client`: concurrency, retries with backoff, the request budget, the preflight request;
- :mod:`~rloo.judging.pairwise`: which of two responses is better, asked in both orders;
- :mod:`~rloo.judging.pointwise`: a score from 0 to 10 for one response;
- :mod:`~rloo.judging.templates`: the judge prompts, prompts and references as plain text;
- :mod:`~rloo.judging.endpoint`: a base URL's form and a server's check with the standard library only.

No module imports torch or the OpenAI client at import time: the pipeline's parameters read the eval config,
which reads these, on a client install.
"""
