"""Tools and the pool that runs them with per-call deadlines.

A tool is a plain (blocking) Python function of keyword arguments returning text. The pool runs
it in a worker thread and stops *waiting* at its deadline: the trajectory that called it is then
truncated (flagged, counted) while the other trajectories go on. Python cannot kill a thread, so a
tool that never returns keeps its worker: tools that run untrusted or unbounded work (code) must
bound themselves -- the sandbox kills its process at a wall-clock limit below the deadline -- and
the pool has more workers than trajectories usually need.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from megarl.envs.base import ToolSchema


class ToolTimeout(Exception):
    """A tool call ran past its deadline."""


@dataclass
class Tool:
    """A callable with the schema the chat template shows the model."""

    name: str
    description: str
    parameters: dict[str, Any]
    fn: Callable[..., str]

    @property
    def schema(self) -> ToolSchema:
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


@dataclass
class ToolPool:
    """Worker threads for tool calls; ``seconds`` accumulates time spent in tools (benchmark)."""

    workers: int = 16
    seconds: float = 0.0
    calls: int = 0
    timeouts: int = 0
    _pool: concurrent.futures.ThreadPoolExecutor = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(self.workers, thread_name_prefix="megarl-tool")

    async def call(self, fn: Callable[..., str], kwargs: dict[str, Any], deadline_s: float) -> str:
        """``fn(**kwargs)`` in a worker, or :class:`ToolTimeout` after ``deadline_s`` seconds."""
        loop = asyncio.get_running_loop()
        t = time.perf_counter()
        fut = loop.run_in_executor(self._pool, functools.partial(fn, **kwargs))
        try:
            return await asyncio.wait_for(fut, deadline_s)
        except asyncio.TimeoutError:
            self.timeouts += 1
            raise ToolTimeout(f"no answer within {deadline_s:g}s") from None
        finally:
            self.calls += 1
            self.seconds += time.perf_counter() - t

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
