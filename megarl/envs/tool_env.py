"""A tool-using environment: the model calls tools until it answers; the answer is scored.

Subclasses give the tools, the opening messages and the scorer; this class runs the turns:

* a turn with tool calls -> each call runs in the pool under its deadline; each result is one
  ``tool`` message (unknown tools, bad arguments and tool exceptions become error text for the
  model, counted as ``tool_errors``); a call past its deadline ends the trajectory (truncated);
  a tool whose own machinery fails (an error declaring a failure reason, e.g. the sandbox crashed:
  ``megarl.errors.failure_reason``) is not the model's error: it propagates, and the agent loop
  marks the trajectory failed (no reward, never 0);
* a turn the parser could not read -> one error observation per problem; the model may retry;
* a turn without tool calls -> the final answer: reward = ``score(text, record)``, done.
"""
from __future__ import annotations

from typing import Any

from megarl.envs.base import Action, EnvContext, Message, StepResult, ToolSchema
from megarl.envs.tools import Tool, ToolTimeout
from megarl.errors import failure_reason

MAX_OBSERVATION_CHARS = 4000   # a tool's text beyond this is cut (the token budget is the model's)


class ToolEnv:
    """Base class of the built-in environments (one instance per trajectory)."""

    tools: list[Tool] = []

    def __init__(self, ctx: EnvContext):
        self.ctx = ctx
        self.record: Any = None
        self.by_name = {t.name: t for t in self.make_tools()}

    # -------------------------------------------------------------- to override
    def make_tools(self) -> list[Tool]:
        return list(self.tools)

    def opening(self, record: Any) -> list[Message]:
        """The conversation the model starts from (system prompt describing the tools + question)."""
        raise NotImplementedError

    def score(self, text: str, record: Any) -> float:
        raise NotImplementedError

    # -------------------------------------------------------------- Env
    async def reset(self, record: Any) -> tuple[list[Message], list[ToolSchema]]:
        self.record = record
        return self.opening(record), [t.schema for t in self.by_name.values()]

    async def step(self, action: Action) -> StepResult:
        if not action.tool_calls and not action.parse_errors:
            return StepResult([], reward=self.score(action.text, self.record), done=True)
        obs: list[Message] = [{"role": "tool", "content": f"Error: {e}"} for e in action.parse_errors]
        info = {"tool_calls": len(action.tool_calls), "tool_errors": len(action.parse_errors), "call_errors": 0,
                "tool_timeouts": 0}
        for call in action.tool_calls:
            tool = self.by_name.get(call.name)
            if tool is None:
                obs.append({"role": "tool", "name": call.name,
                            "content": f"Error: unknown tool {call.name!r}; tools: {sorted(self.by_name)}"})
                info["tool_errors"] += 1
                info["call_errors"] += 1
                continue
            try:
                out = await self.ctx.pool.call(tool.fn, call.arguments, self.ctx.tool_timeout_s)
            except ToolTimeout as e:
                info["tool_timeouts"] += 1
                info["call_errors"] += 1
                obs.append({"role": "tool", "name": call.name, "content": f"Error: {call.name} timed out ({e})"})
                return StepResult(obs, done=True, truncated=True, info=info)
            except TypeError as e:          # wrong or missing arguments
                out = f"Error: bad arguments for {call.name}: {e}"
                info["tool_errors"] += 1
                info["call_errors"] += 1
            except Exception as e:  # noqa: BLE001 - any tool failure is text for the model, never a crash
                if failure_reason(e):       # the tool's machinery failed (a sandbox crash): no reward, not text
                    raise
                out = f"Error: {type(e).__name__}: {e}"
                info["tool_errors"] += 1
                info["call_errors"] += 1
            obs.append({"role": "tool", "name": call.name, "content": str(out)[:MAX_OBSERVATION_CHARS]})
        return StepResult(obs, info=info)

    async def close(self) -> None:
        pass


def tool_prompt(tools: list[Tool], intro: str) -> str:
    """A system prompt that shows the tools and the Hermes call format, for chat templates that do
    not render ``tools`` themselves (SmolLM2's does not; Qwen's does, and then this only repeats it)."""
    import json

    lines = [intro, "", "Tools (call one by writing <tool_call>{\"name\": NAME, \"arguments\": {...}}</tool_call>):"]
    for t in tools:
        lines.append(json.dumps(t.schema["function"]))
    lines.append("When you know the answer, reply with the answer only, without a tool call.")
    return "\n".join(lines)
