"""``python``: ReTool-style math with code -- the model runs Python in the sandbox
(``megarl/envs/sandbox.py``) as often as it likes, then answers; reward = answer correctness.

``agent.env_args``: ``cpu_s``, ``wall_s``, ``memory_mb``, ``output_bytes``, ``nproc``, ``tmp_mb``
(sandbox limits; the wall-clock limit must stay below ``agent.tool_timeout_s`` so the sandbox,
not the pool's deadline, stops runaway code and the model gets a clear observation),
``mounts`` (absolute host paths the code may read, read-only at the same path: fixtures, never
answers; nothing else of the host's files is visible), ``python`` (the interpreter whose packages
the code may import; default: the trainer's own), ``system_prompt``.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

from megarl.envs.base import EnvContext, Message
from megarl.envs.calculator import question_messages, record_answer
from megarl.envs.sandbox import SandboxLimits, run_python
from megarl.envs.tool_env import ToolEnv, tool_prompt
from megarl.envs.tools import Tool

LIMIT_KEYS = {f.name for f in dataclasses.fields(SandboxLimits)}


def sandbox_limits(args: dict[str, Any]) -> SandboxLimits:
    return SandboxLimits(**{k: v for k, v in args.items() if k in LIMIT_KEYS})


def python_tool(limits: SandboxLimits, mounts: Sequence[str] = (), python: Optional[str] = None) -> Tool:
    def run(code: str) -> str:
        if not isinstance(code, str) or not code.strip():
            raise ValueError('"code" must be a non-empty string of Python')
        return run_python(code, limits, python, mounts).observation()
    return Tool("python", "Run Python 3 code in a sandbox (no network, no files outside /tmp) and return what it "
                "prints. Use print() to see results.",
                {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}, run)


class PythonEnv(ToolEnv):
    INTRO = "You solve math problems. You can run Python code to compute exactly."

    def __init__(self, ctx: EnvContext):
        self.limits = sandbox_limits(ctx.args)
        self.mounts = tuple(ctx.args.get("mounts") or ())
        self.python = ctx.args.get("python") or None
        super().__init__(ctx)
        self.system = ctx.args.get("system_prompt") or tool_prompt(self.make_tools(), self.INTRO)

    def make_tools(self) -> list[Tool]:
        return [python_tool(self.limits, self.mounts, self.python)]

    def opening(self, record: Any) -> list[Message]:
        return [{"role": "system", "content": self.system}] + question_messages(record)

    def score(self, text: str, record: Any) -> float:
        from megarl.rewards.rules import math_answer_reward

        return math_answer_reward(text, record_answer(record))
