"""The environment interface of agentic RL (ARCHITECTURE.md, ``envs/``).

An environment holds the state of ONE trajectory: the agent loop makes a fresh instance per
trajectory, calls ``reset(record)`` once for the opening conversation and the tool schemas, then
``step(action)`` after every model turn until it answers ``done``. Both are coroutines so an
environment may wait on I/O (a sandbox, a search index, an API) without blocking the other
trajectories of the batch, which run concurrently on one event loop.

The loop, not the environment, owns tokens: an environment sees and returns *text* (chat
messages), and the loop tokenises only what the environment wrote -- never the model's text.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

Message = dict[str, Any]          # a chat message: {"role": ..., "content": ..., optional "name"/"tool_call_id"}
ToolSchema = dict[str, Any]       # OpenAI-style {"type": "function", "function": {"name", "description", "parameters"}}


@dataclass
class ToolCall:
    """One parsed call: a tool name and its JSON arguments."""

    name: str
    arguments: dict[str, Any]


@dataclass
class Action:
    """One model turn as the environment sees it: the decoded text, the tool calls the parser
    found in it and what it could not parse (each a one-line reason, shown to the model)."""

    text: str
    tool_calls: list[ToolCall] = field(default_factory=list)
    parse_errors: list[str] = field(default_factory=list)
    finish_reason: str = "stop"


@dataclass
class StepResult:
    """What one ``step`` returns: observation messages (appended to the conversation and
    tokenised), the reward of this step (summed over the trajectory), whether the trajectory is
    over, and counters the loop aggregates into metrics (``tool_calls``, ``tool_errors``,
    ``tool_timeouts``)."""

    observations: list[Message]
    reward: float = 0.0
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)
    truncated: bool = False           # ended by a limit (a tool past its deadline), not by the model


class Env(Protocol):
    """A multi-turn environment (one instance per trajectory)."""

    async def reset(self, record: Any) -> tuple[list[Message], list[ToolSchema]]: ...

    async def step(self, action: Action) -> StepResult: ...

    async def close(self) -> None: ...


@dataclass
class EnvContext:
    """What the agent loop hands every environment it builds: the tool pool (per-call deadlines)
    and the environment's own options (``agent.env_args``)."""

    pool: Any
    args: dict[str, Any] = field(default_factory=dict)
    tool_timeout_s: float = 10.0
    final_reward: Optional[float] = None
