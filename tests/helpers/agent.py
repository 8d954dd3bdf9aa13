"""Scripted pieces for agent-loop tests: a fake rollout server (records every request), parsers
and environments that force multi-turn structure on random tiny models."""
from __future__ import annotations

import asyncio
import zlib
import time
from typing import Any

from megarl.envs.base import ToolCall
from megarl.envs.calculator import CalculatorEnv
from megarl.envs.tool_env import ToolEnv
from megarl.envs.tools import Tool
from megarl.rollout.client import GenerateOutput
from megarl.wire.versions import version_tag


def mostly_call(text: str) -> tuple[list[ToolCall], list[str]]:
    """Three model turns in four call the calculator (random models never write a call
    themselves), the rest are answers, chosen by a checksum of the text so a run is reproducible;
    the expression depends on the turn's text, so observations vary with what the model produced."""
    if zlib.crc32(text.encode()) % 4 == 0:
        return [], []
    return [ToolCall("calculator", {"expression": f"{len(text)} * 7"})], []


class ScriptedServer:
    """Stands in for ``RolloutManager``: answers each request from a per-trajectory script of
    token lists and logs (input ids, output ids, logprobs) per trajectory (job index)."""

    def __init__(self, scripts: dict[int, list[tuple[list[int], str]]], delay_s: float = 0.0):
        self.scripts = scripts
        self.turn: dict[int, int] = {}
        self.log: dict[int, list[tuple[list[int], list[int], list[float]]]] = {}
        self.delay_s = delay_s
        self.io = self

    def run(self, coro: Any) -> Any:
        return asyncio.run(coro)

    async def generate_one(self, input_ids: list[int], params: dict[str, Any], job_index: int = 0) -> GenerateOutput:
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        k = self.turn.get(job_index, 0)
        self.turn[job_index] = k + 1
        ids, finish = self.scripts[job_index][k]
        ids = ids[: params["max_new_tokens"]]
        lps = [-(0.01 + 0.001 * ((i * 31 + k) % 97)) for i in range(len(ids))]
        self.log.setdefault(job_index, []).append((list(input_ids), list(ids), lps))
        return GenerateOutput(ids, lps, finish, meta_info={"weight_version": version_tag(0)})


def _sleep(seconds: float) -> str:
    time.sleep(float(seconds))
    return "slept"


class SleepyEnv(CalculatorEnv):
    """The calculator plus a ``sleep`` tool (for deadline tests)."""

    tools = CalculatorEnv.tools + [Tool("sleep", "sleep", {"type": "object"}, _sleep)]


class CountingEnv(ToolEnv):
    """Never done by itself: the loop's turn and token limits end it."""

    tools = [Tool("noop", "noop", {"type": "object"}, lambda **kw: "ok")]

    def opening(self, record: Any) -> list[dict]:
        return [{"role": "user", "content": str(record)}]

    def score(self, text: str, record: Any) -> float:
        return 1.0


class DistinctCalcEnv(CalculatorEnv):
    """The calculator with a non-constant reward for random tiny models (which never answer right)."""

    def score(self, text: str, record: Any) -> float:
        return len(set(text)) / 10.0


def _crashed_sandbox(**arguments: Any) -> str:
    from megarl.envs.sandbox import SandboxCrashed

    raise SandboxCrashed("sandbox did not start: FileNotFoundError: bwrap")


class CrashingSandboxEnv(CalculatorEnv):
    """The calculator whose tool's sandbox cannot start (infrastructure, not the model's call)."""

    tools = [Tool("calculator", "calculator", {"type": "object"}, _crashed_sandbox)]


class ScoreRaisesEnv(CalculatorEnv):
    """The calculator whose answer checker raises."""

    def score(self, text: str, record: Any) -> float:
        raise ConnectionError("answer checker unreachable")
