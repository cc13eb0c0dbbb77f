"""Agents: multi-turn rollouts with tools and environments (TRL's ``tools=`` and ``environment_factory=``).

:mod:`rloo.agents.tools` turns functions into tools the chat template describes, reads the model's tool calls
and runs them.
"""
