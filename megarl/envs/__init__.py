"""Multi-turn environments and tools for agentic RL (ARCHITECTURE.md ``envs/``): the interface
(``base``), registry, tool-call parsers, the tool pool with deadlines, the bubblewrap sandbox and
the built-in ``calculator``, ``python`` and ``search`` environments. The agent loop that drives
them lives on the rollout side (``megarl/rollout/agent.py``)."""
from megarl.envs.base import Action, Env, EnvContext, StepResult, ToolCall
from megarl.envs.registry import env_class, make_env, register_env

__all__ = ["Action", "Env", "EnvContext", "StepResult", "ToolCall", "env_class", "make_env", "register_env"]
