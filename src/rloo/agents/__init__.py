"""Agents: multi-turn rollouts with tools and environments (TRL's ``tools=`` and ``environment_factory=``).

:mod:`rloo.agents.tools` turns functions into tools the chat template describes, reads the model's tool calls
and runs them; :mod:`rloo.agents.environments` loads environments with TRL's contract (``reset(**row)``, public
methods as tools, ``get_reward()``). The multi-turn episode loop that uses both is not built yet.
"""
