"""Spread a batch of prompts over N rollout servers and collect n samples per prompt.

Each of the ``n`` samples of a prompt is its own ``/generate`` request (with its own
``sampling_seed`` when a seed is given, so a run is reproducible whatever the batching on the
server), assigned round-robin so servers get equal work.

A request that fails (connection refused, timeout, 5xx) is sent again, to the next live server,
and counted in ``retried``. Whether the server that failed stays in use is decided by its
``/health`` endpoint, probed on a connection of its own (the server's request slots may all be
taken by the requests that hang): a server that answers is kept (one slow generation must not cost
a server for the rest of the run), a server that does not is marked dead for the run. A request
that fails ``request_retries + 1`` times on servers that stay healthy ends the step with
:class:`GenerationFailed`; when no server is left ``generate`` raises :class:`NoServerLeft`. Each
request is tried at most ``len(servers) + request_retries + 1`` times.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, Optional, Sequence

import aiohttp

from megarl.rollout.client import GenerateOutput, LoopThread, RequestFailed, SGLangClient, ServerError
from megarl.rollout.protocol import ENDPOINTS

log = logging.getLogger("megarl.rollout.manager")


def request_seed(seed: int, job_index: int) -> int:
    """``sampling_seed`` of request ``job_index`` (prompt-major, ``p * n + k``) of a batch seeded
    with ``seed``: what :meth:`RolloutManager.generate` sends, and what an off-policy source sends
    for the same sample, so both draw the same tokens."""
    return (seed + job_index * 7919) & 0x7FFFFFFF


class NoServerLeft(RuntimeError):
    """Every rollout server failed."""


class GenerationFailed(RuntimeError):
    """One request kept failing on servers that still answer /health."""


class RolloutManager:
    def __init__(self, urls: Sequence[str], max_concurrency: int = 64, timeout_s: float = 600.0,
                 request_retries: int = 2, health_timeout_s: float = 10.0, api_key: Optional[str] = None):
        if not urls:
            raise ValueError("RolloutManager needs at least one server URL")
        if request_retries < 0:
            raise ValueError(f"request_retries must be >= 0, got {request_retries}")
        self.urls = list(urls)
        self.io = LoopThread()
        self.clients = [SGLangClient(u, max_concurrency=max_concurrency, timeout_s=timeout_s, api_key=api_key)
                        for u in self.urls]
        self.request_retries = request_retries
        self.health_timeout_s = health_timeout_s
        self.dead: set[int] = set()
        self.failures: list[str] = []
        self.outstanding: list[int] = [0] * len(self.urls)   # requests in flight per server
        self.retried = 0                                      # requests sent again after a failure (whole run)
        self._probes: dict[int, asyncio.Task] = {}
        self._probe_session: Optional[aiohttp.ClientSession] = None

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

    async def generate_one(self, input_ids: list[int], params: dict[str, Any], job_index: int = 0) -> GenerateOutput:
        """One request (``params`` with its own ``n = 1`` and seed), with the retries of
        :meth:`generate`, on the servers from ``job_index`` round-robin; an answer that finished
        with ``abort`` (a pause) is returned like any other."""
        return (await self._generate([input_ids], 1, params, None, first_job=job_index))[0][0]

    def generate(self, prompts: list[list[int]], n: int, sampling: dict[str, Any],
                 seed: Optional[int] = None) -> list[list[GenerateOutput]]:
        """``n`` outputs per prompt, in prompt order, each with per-token rollout logprobs."""
        return self.io.run(self._generate(prompts, n, sampling, seed))

    async def healthy(self, server: int) -> bool:
        """Does server ``server`` answer ``/health`` within ``health_timeout_s``? Concurrent callers
        share one probe per server."""
        task = self._probes.get(server)
        if task is None:
            task = asyncio.ensure_future(self._probe(server))
            self._probes[server] = task
            task.add_done_callback(lambda _t, s=server: self._probes.pop(s, None))
        return await task

    async def _probe(self, server: int) -> bool:
        if self._probe_session is None or self._probe_session.closed:
            self._probe_session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.health_timeout_s))
        method, path = ENDPOINTS["health"]
        try:
            async with self._probe_session.request(method, self.clients[server].url + path) as r:
                await r.read()
                return r.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return False

    async def _generate(self, prompts, n, sampling, seed, first_job: int = 0):
        jobs = [(p, k) for p in range(len(prompts)) for k in range(n)]
        results: list[list[Optional[GenerateOutput]]] = [[None] * n for _ in prompts]
        count = len(self.clients)

        async def one(job_index: int, p: int, k: int):
            params = dict(sampling, n=1)
            if seed is not None:
                params["sampling_seed"] = request_seed(seed, job_index)
            start = (first_job + job_index) % count
            retries_left = self.request_retries
            for attempt in range(count + self.request_retries + 1):
                live = [s for s in ((start + attempt + i) % count for i in range(count)) if s not in self.dead]
                if not live:
                    break
                server = live[0]
                if attempt:
                    self.retried += 1
                self.outstanding[server] += 1
                try:
                    out = await self.clients[server].generate(prompts[p], params, return_logprob=True)
                    results[p][k] = out[0] if isinstance(out, list) else out
                    return
                except ServerError as err:
                    if isinstance(err, RequestFailed) and err.status < 500:
                        raise  # our request is wrong; another server would refuse it too
                    failed = err
                finally:
                    self.outstanding[server] -= 1
                if server not in self.dead and not await self.healthy(server):
                    if server in self.dead:  # another request saw it die while this one probed
                        continue
                    self.dead.add(server)
                    message = (f"rollout server {self.urls[server]} failed: {failed}; it does not answer /health: "
                               f"retrying its requests elsewhere")
                    self.failures.append(message)
                    log.warning(message)
                elif server not in self.dead:
                    if retries_left == 0:
                        raise GenerationFailed(
                            f"prompt {p} sample {k}: failed {self.request_retries + 1} time(s) on rollout servers that "
                            f"answer /health (rollout.request_retries = {self.request_retries}); last: {failed}")
                    retries_left -= 1
                    log.warning(f"rollout server {self.urls[server]}: {failed}; it answers /health: kept, "
                                f"request sent again")
            if len(self.dead) < count:
                raise GenerationFailed(f"prompt {p} sample {k}: gave up after {count + self.request_retries + 1} "
                                       f"attempts; last: {failed}")
            raise NoServerLeft(f"no rollout server left for prompt {p}: {'; '.join(self.failures)}")

        await asyncio.gather(*(one(i, p, k) for i, (p, k) in enumerate(jobs)))
        return results

    def close(self) -> None:
        async def _close():
            for c in self.clients:
                await c.close()
            if self._probe_session is not None:
                await self._probe_session.close()
        try:
            self.io.run(_close(), timeout=10)
        finally:
            self.io.close()
