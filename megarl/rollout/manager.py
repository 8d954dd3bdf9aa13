"""Spread a batch of prompts over N rollout servers and collect n samples per prompt.

Requests are batched, in SGLang's batch form (one ``/generate`` with a list of ``input_ids`` and
one ``sampling_params`` per item; responses are prompt-major), because per-sample requests cost a
fixed overhead each -- HTTP, JSON, a scheduler admission -- which dominated the in-loop rollout.
The prompts are cut into chunks of whole groups (every sample of a prompt in the same
request, so the server prefills the prompt once and shares it); each chunk goes to the live
server with the fewest samples in flight, all chunks are in flight at once, and each chunk's
outputs are handed back (:meth:`RolloutManager.stream`) as soon as it completes, so the caller
scores early groups while later ones still generate.

Seeds: with a ``seed``, sample ``k`` of prompt ``p`` is sampled with ``sampling_seed = seed +
(p * n + k) * 7919`` (the seed the per-sample requests of earlier versions used), so a run is
reproducible whatever the batching. Seeded samples are sent as separate items (``n = 1`` each):
SGLang copies one item's ``sampling_seed`` to all of its ``n`` samples, which under its
deterministic mode would make them identical. Without a seed a prompt is one item with ``n``.

A request that fails (connection refused, timeout, 5xx) is sent again, to the next live server,
and counted in ``retried``. Whether the server that failed stays in use is decided by its
``/health`` endpoint, probed on a connection of its own (the server's request slots may all be
taken by the requests that hang): a server that answers is kept (one slow generation must not cost
a server for the rest of the run), a server that does not is marked dead for the run. A request
that fails ``request_retries + 1`` times on servers that stay healthy ends the step with
:class:`GenerationFailed`; when no server is left ``generate`` raises :class:`NoServerLeft`. Each
request is tried at most ``len(servers) + request_retries + 1`` times.

With a ``healer`` (servers megarl started: :mod:`megarl.rollout.healing`) a server that does not
answer ``/health`` is restarted instead of dropped: its requests go on elsewhere meanwhile (or wait
for it when no server is left), it comes back at its new URL with the current weights, and
``restarted`` counts it. ``generate`` returns only when every restart it started is over (so no
weight push overlaps one), and raises the healer's error when a server cannot be restarted.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import queue
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence

import aiohttp

from megarl.rollout.client import GenerateOutput, LoopThread, RequestFailed, SGLangClient, ServerError
from megarl.rollout.coalesce import coalescer
from megarl.wire.protocol import ENDPOINTS

log = logging.getLogger("megarl.rollout.manager")

SEED_STRIDE = 7919


class NoServerLeft(RuntimeError):
    """Every rollout server failed."""


class GenerationFailed(RuntimeError):
    """One request kept failing on servers that still answer /health."""


def sample_seed(seed: int, job: int) -> int:
    """The ``sampling_seed`` of sample number ``job`` (= prompt * n + k) of a seeded batch: what
    :meth:`RolloutManager.generate` sends, and what an off-policy source sends for the same
    sample, so both draw the same tokens."""
    return (seed + job * SEED_STRIDE) & 0x7FFFFFFF



@dataclass
class _Chunk:
    """One ``/generate`` request: prompts ``first .. first + count - 1``, all their samples."""

    first: int
    count: int
    samples: int

    def describe(self) -> str:
        last = self.first + self.count - 1
        what = f"prompt {self.first}" if self.count == 1 else f"prompts {self.first}-{last}"
        return f"{what} ({self.samples} sample{'s' if self.samples != 1 else ''})"


def plan_chunks(num_prompts: int, n: int, servers: int, chunks_per_server: int, min_chunk_samples: int) -> list[_Chunk]:
    """Contiguous runs of whole groups: at least one per server (when there are prompts enough),
    at most ``chunks_per_server`` per server, none smaller than ``min_chunk_samples`` unless that
    would leave a server idle."""
    if num_prompts == 0:
        return []
    by_size = max(1, (num_prompts * n) // max(1, min_chunk_samples))
    count = max(min(servers, num_prompts), min(num_prompts, servers * chunks_per_server, by_size))
    size = math.ceil(num_prompts / count)
    return [_Chunk(p, min(size, num_prompts - p), min(size, num_prompts - p) * n) for p in range(0, num_prompts, size)]


class RolloutManager:
    """Batched generation over a fleet of servers, with retries and healing (module doc)."""

    def __init__(self, urls: Sequence[str], max_concurrency: int = 64, timeout_s: float = 600.0,
                 request_retries: int = 2, health_timeout_s: float = 10.0, api_key: Optional[str] = None,
                 healer: Optional[Any] = None, chunks_per_server: int = 4, min_chunk_samples: int = 16,
                 lora_name: Callable[[], Optional[str]] = lambda: None, coalesce_max_samples: int = 64):
        if not urls:
            raise ValueError("RolloutManager needs at least one server URL")
        if request_retries < 0:
            raise ValueError(f"request_retries must be >= 0, got {request_retries}")
        self.urls = list(urls)
        self.io = LoopThread()
        # retries=0: this manager retries a failed request itself (on another server, or after a
        # health probe); the client's own retries would make one hung request cost
        # (1 + retries) * timeout_s before anyone looks at the server
        self._client_kw = dict(max_concurrency=max_concurrency, timeout_s=timeout_s, api_key=api_key, retries=0)
        self.clients = [SGLangClient(u, **self._client_kw) for u in self.urls]
        self.request_retries = request_retries
        self.health_timeout_s = health_timeout_s
        self.chunks_per_server = chunks_per_server
        self.min_chunk_samples = min_chunk_samples
        self.dead: set[int] = set()
        self.failures: list[str] = []
        self.outstanding: list[int] = [0] * len(self.urls)   # samples in flight per server
        self.retried = 0                                      # requests sent again after a failure (whole run)
        self.requests = 0                                     # /generate requests sent (whole run)
        self._probes: dict[int, asyncio.Task] = {}
        self._probe_session: Optional[aiohttp.ClientSession] = None
        self.lora_name = lora_name                            # the served LoRA adapter each request names
        self.healer = healer                                  # revive(i) -> new url; max_restarts
        self.restarted = 0                                    # servers restarted (whole run)
        self.fatal: Optional[BaseException] = None            # a server that could not be restarted
        self._revivals: dict[int, asyncio.Task] = {}
        self._healing_pool = (concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="megarl-healer")
                              if healer is not None else None)
        # a group's single-sample requests of one loop turn go out as one batched /generate (coalesce.py)
        self._coalescer = coalescer(self._send_items, coalesce_max_samples)

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

    async def generate_one(self, input_ids: list[int], params: dict[str, Any], job_index: int = 0,
                           routes_start: Optional[int] = None, batch_key: Optional[Any] = None) -> GenerateOutput:
        """One request (``params`` with its own ``n = 1`` and seed), with the retries of
        :meth:`generate`, on the least loaded server (ties from ``job_index`` round-robin); an
        answer that finished with ``abort`` (a pause) is returned like any other. ``routes_start``
        (MoE routing replay): also return the routed experts of positions from there on. Without
        routes, requests of one ``batch_key`` (a group) issued in the same loop turn share one batched
        request (coalesce.py)."""
        if self._coalescer is not None and routes_start is None and batch_key is not None:
            return await self._coalescer.submit(batch_key, input_ids, params, job_index)
        outs = await self._send(job_index, _Chunk(0, 1, 1), input_ids, params, f"request {job_index}",
                                routes_start is not None, routes_start or 0)
        return outs[0] if isinstance(outs, list) else outs

    def generate(self, prompts: list[list[int]], n: int, sampling: dict[str, Any],
                 seed: Optional[int] = None, return_routed_experts: bool = False) -> list[list[GenerateOutput]]:
        """``n`` outputs per prompt, in prompt order, each with per-token rollout logprobs (and the
        routed experts of every position when asked: MoE routing replay)."""
        groups: list[list[GenerateOutput]] = [[] for _ in prompts]
        for p, outs in self.stream(prompts, n, sampling, seed, return_routed_experts):
            groups[p] = outs
        return groups

    def stream(self, prompts: list[list[int]], n: int, sampling: dict[str, Any],
               seed: Optional[int] = None, return_routed_experts: bool = False
               ) -> Iterator[tuple[int, list[GenerateOutput]]]:
        """Yield ``(prompt index, its n outputs)`` as the requests that carry them complete (every
        prompt exactly once; order of completion). An error is raised once the requests in flight
        have finished or failed."""
        box: "queue.Queue[Any]" = queue.Queue()
        done = object()
        fut = self.io.submit(self._generate(prompts, n, sampling, seed, box.put, return_routed_experts))
        fut.add_done_callback(lambda _f: box.put(done))
        while True:
            item = box.get()
            if item is done:
                break
            yield item
        fut.result()

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

    def _revive(self, server: int) -> None:
        """Start restarting ``server`` (once, however many requests saw it die)."""
        if server not in self._revivals and self.fatal is None:
            self._revivals[server] = asyncio.ensure_future(self._do_revive(server))

    async def _do_revive(self, server: int) -> None:
        loop = asyncio.get_running_loop()
        try:
            url = await loop.run_in_executor(self._healing_pool, self.healer.revive, server)
        except Exception as e:  # noqa: BLE001 - the healer's error ends the step (and the run)
            self.fatal = e
            self.failures.append(f"rollout server {self.urls[server]}: {e}")
            log.error("%s", e)
            self._revivals.pop(server, None)
            return
        old, self.clients[server] = self.clients[server], SGLangClient(url, **self._client_kw)
        self.urls[server] = url
        self.restarted += 1
        self.dead.discard(server)
        self._revivals.pop(server, None)
        await old.close()

    async def _until_revived(self) -> None:
        """Wait until every restart under way is over."""
        while self._revivals:
            await asyncio.wait(list(self._revivals.values()))

    def _least_loaded(self, order: int) -> int:
        live = [s for s in range(len(self.urls)) if s not in self.dead]
        if not live:
            return -1
        return min(live, key=lambda s: (self.outstanding[s], (s - order) % len(self.urls)))

    async def _generate(self, prompts, n, sampling, seed, emit: Callable[[tuple[int, list[GenerateOutput]]], None],
                        routes: bool = False):
        try:
            await self._generate_all(prompts, n, sampling, seed, emit, routes)
        finally:
            await self._until_revived()   # a step ends with its restarts done (none overlaps a weight push)
        if self.fatal is not None:
            raise self.fatal

    async def _generate_all(self, prompts, n, sampling, seed, emit, routes):
        live = len(self.urls) - len(self.dead)
        chunks = plan_chunks(len(prompts), n, max(1, live), self.chunks_per_server, self.min_chunk_samples)

        async def one_chunk(i: int, c: _Chunk):
            ids = prompts[c.first:c.first + c.count]
            if seed is not None:   # one item per sample, each with its own seed
                ids = [p for p in ids for _ in range(n)]
                params: Any = [dict(sampling, n=1, sampling_seed=sample_seed(seed, c.first * n + j))
                               for j in range(c.samples)]
            else:
                params = [dict(sampling, n=n) for _ in ids]
            outs = await self._send(i, c, ids, params, c.describe(), routes)
            if len(outs) != c.samples:
                raise GenerationFailed(f"{c.describe()}: the server answered {len(outs)} outputs for {c.samples} "
                                       f"samples")
            for j in range(c.count):
                emit((c.first + j, outs[j * n:(j + 1) * n]))
        await self._gather(one_chunk(i, c) for i, c in enumerate(chunks))

    async def _send_items(self, input_ids: list[list[int]], params: list[dict[str, Any]],
                          order: int) -> list[GenerateOutput]:
        """Coalesced single-sample requests (``n = 1`` each) as one batched request."""
        count = len(input_ids)
        return await self._send(order, _Chunk(0, count, count), input_ids, params, f"{count} coalesced request(s)")

    @staticmethod
    async def _gather(coros) -> None:
        """Run all; on the first error let the others finish (their outputs still stream back),
        then raise it."""
        results = await asyncio.gather(*coros, return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r

    async def _send(self, order: int, c: _Chunk, input_ids: Any, params: Any, what: str,
                    routes: bool = False, routes_start: int = 0) -> list[GenerateOutput]:
        """One request (a chunk, or one sample), with the retry / health-probe / restart policy."""
        count = len(self.clients)
        comebacks = count * self.healer.max_restarts if self.healer is not None else 0
        max_attempts = count + comebacks + self.request_retries + 1
        retries_left = self.request_retries
        server = -1
        failed: Optional[BaseException] = None
        attempt = 0
        while attempt < max_attempts:
            if self.fatal is not None:
                raise self.fatal
            if attempt == 0:
                server = self._least_loaded(order)
            else:
                live = [s for s in ((server + i) % count for i in range(1, count + 1)) if s not in self.dead]
                server = live[0] if live else -1
            if server < 0:
                if not self._revivals:
                    break
                await self._until_revived()   # no server left but one is being restarted: wait for it
                server = order % count
                continue
            if attempt:
                self.retried += 1
            attempt += 1
            self.outstanding[server] += c.samples
            self.requests += 1
            try:
                return await self.clients[server].generate(input_ids, params, return_logprob=True,
                                                           return_routed_experts=routes,
                                                           routed_experts_start_len=routes_start,
                                                           lora_path=self.lora_name())
            except ServerError as err:
                if isinstance(err, RequestFailed) and err.status < 500:
                    raise  # our request is wrong; another server would refuse it too
                failed = err
            finally:
                self.outstanding[server] -= c.samples
            if server not in self.dead and not await self.healthy(server):
                if server in self.dead:  # another request saw it die while this one probed
                    continue
                self.dead.add(server)
                then = "restarting it" if self.healer is not None else "retrying its requests elsewhere"
                message = (f"rollout server {self.urls[server]} failed: {failed}; it does not answer /health: {then}")
                self.failures.append(message)
                log.warning(message)
                if self.healer is not None:
                    self._revive(server)
            elif server not in self.dead:
                if retries_left == 0:
                    raise GenerationFailed(
                        f"{what}: failed {self.request_retries + 1} time(s) on rollout servers that "
                        f"answer /health (rollout.request_retries = {self.request_retries}); last: {failed}")
                retries_left -= 1
                log.warning(f"rollout server {self.urls[server]}: {failed}; it answers /health: kept, "
                            f"request sent again")
        if self.fatal is not None:
            raise self.fatal
        if len(self.dead) < count:
            raise GenerationFailed(f"{what}: gave up after {max_attempts} attempts; last: {failed}")
        raise NoServerLeft(f"no rollout server left for {what}: {'; '.join(self.failures)}")

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
            if self._healing_pool is not None:
                self._healing_pool.shutdown(wait=False)
