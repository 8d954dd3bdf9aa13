"""Spread a batch of prompts over N rollout servers and collect n samples per prompt.

Each of the ``n`` samples of a prompt is its own ``/generate`` request (with its own
``sampling_seed`` when a seed is given, so a run is reproducible whatever the batching on the
server), assigned round-robin so servers get equal work. A server that fails (connection refused,
timeout, 5xx) is reported once, marked dead, and its requests are retried on the remaining
servers; only when no server is left does ``generate`` raise.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, Optional, Sequence

from megarl.rollout.client import GenerateOutput, LoopThread, RequestFailed, SGLangClient, ServerError

log = logging.getLogger("megarl.rollout.manager")


class NoServerLeft(RuntimeError):
    """Every rollout server failed."""


class RolloutManager:
    def __init__(self, urls: Sequence[str], max_concurrency: int = 64, timeout_s: float = 600.0,
                 api_key: Optional[str] = None):
        if not urls:
            raise ValueError("RolloutManager needs at least one server URL")
        self.urls = list(urls)
        self.io = LoopThread()
        self.clients = [SGLangClient(u, max_concurrency=max_concurrency, timeout_s=timeout_s, api_key=api_key)
                        for u in self.urls]
        self.dead: set[int] = set()
        self.failures: list[str] = []
        self.outstanding: list[int] = [0] * len(self.urls)   # requests in flight per server

    @property
    def dead_urls(self) -> list[str]:
        return [self.urls[i] for i in sorted(self.dead)]

    def live_urls(self) -> list[str]:
        return [u for i, u in enumerate(self.urls) if i not in self.dead]

    def call_all(self, method: str, *args, **kw) -> dict[str, Any]:
        """Call a client method (e.g. ``flush_cache``, ``release_memory_occupation``) on every live
        server; returns url -> answer."""
        async def go():
            outs = await asyncio.gather(*(getattr(self.clients[i], method)(*args, **kw)
                                          for i in range(len(self.urls)) if i not in self.dead))
            return dict(zip(self.live_urls(), outs))
        return self.io.run(go())

    def generate(self, prompts: list[list[int]], n: int, sampling: dict[str, Any],
                 seed: Optional[int] = None) -> list[list[GenerateOutput]]:
        """``n`` outputs per prompt, in prompt order, each with per-token rollout logprobs."""
        return self.io.run(self._generate(prompts, n, sampling, seed))

    async def _generate(self, prompts, n, sampling, seed):
        jobs = [(p, k) for p in range(len(prompts)) for k in range(n)]
        results: list[list[Optional[GenerateOutput]]] = [[None] * n for _ in prompts]

        async def one(job_index: int, p: int, k: int):
            params = dict(sampling, n=1)
            if seed is not None:
                params["sampling_seed"] = (seed + job_index * 7919) & 0x7FFFFFFF
            start = job_index % len(self.clients)
            for attempt in range(len(self.clients)):
                server = (start + attempt) % len(self.clients)
                if server in self.dead:
                    continue
                self.outstanding[server] += 1
                try:
                    out = await self.clients[server].generate(prompts[p], params, return_logprob=True)
                    results[p][k] = out[0] if isinstance(out, list) else out
                    return
                except ServerError as err:
                    if isinstance(err, RequestFailed) and err.status < 500:
                        raise  # our request is wrong; another server would refuse it too
                    if server not in self.dead:
                        self.dead.add(server)
                        message = f"rollout server {self.urls[server]} failed: {err}; retrying its requests elsewhere"
                        self.failures.append(message)
                        log.warning(message)
                finally:
                    self.outstanding[server] -= 1
            raise NoServerLeft(f"no rollout server left for prompt {p}: {'; '.join(self.failures)}")

        await asyncio.gather(*(one(i, p, k) for i, (p, k) in enumerate(jobs)))
        return results

    def close(self) -> None:
        async def _close():
            for c in self.clients:
                await c.close()
        try:
            self.io.run(_close(), timeout=10)
        finally:
            self.io.close()
