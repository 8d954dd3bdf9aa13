"""Score a batch's responses in parallel workers, results in input order.

Why: the trainer used to call the reward function once per sample in its own thread, so a user
function that takes a second (a sandboxed test run, a remote judge, a slow verifier) made a
1k-sample step wait 1k seconds. ``RewardPool`` maps the function over the samples with
``workers`` threads (any callable; parallel while the function waits on I/O, a subprocess or a
sandbox, or runs C code that releases the GIL) or processes (CPU-bound pure-Python scorers; the
function and records must pickle, e.g. a module-level function). ``workers = 0`` scores inline.

A sample whose function raises (or returns nan, inf or no number) gets a
:class:`~megarl.rewards.failures.Failure` in its place, after ``retries`` more tries: one bad sample
neither stops the step nor becomes a reward of 0 (``megarl/rewards/failures.py``).

A sample whose function runs past ``timeout_s`` (a verifier in an endless loop, a remote call that
never answers) fails with reason ``timeout`` and the step goes on without it. The clock starts when
a worker takes the sample. A thread cannot be stopped: it is abandoned with its pool (a new pool
serves the next batch) and a warning says so; a process is killed with its pool once the batch's
other samples are in. ``workers = 0`` scores inline and has no deadline.
"""
from __future__ import annotations

import concurrent.futures as cf
import functools
import itertools
import logging
import multiprocessing as mp
import queue
import threading
import time
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Callable, Literal, Optional, Sequence

from megarl.rewards.failures import Failure, Score, checked_score, failure_of

RewardFn = Callable[[str, Any], float]
log = logging.getLogger(__name__)
_POLL_S = 0.05   # how often the deadline loop looks at the running samples


def score_one(fn: RewardFn, text: str, record: Any, retries: int = 0) -> Score:
    """``fn(text, record)`` as a :class:`Score`; an exception is tried again up to ``retries``
    times (a flaky verifier, a busy sandbox), then becomes the sample's failure."""
    failure: Optional[Failure] = None
    for _ in range(retries + 1):
        try:
            return checked_score(fn(text, record))
        except Exception as err:  # noqa: BLE001 - any scorer error is the sample's failure, never a 0
            failure = failure_of(err)
    assert failure is not None
    return failure


def _score_chunk(fn: RewardFn, items: list[tuple[str, Any]], retries: int = 0) -> list[Score]:
    return [score_one(fn, text, record, retries) for text, record in items]


class RewardPool:
    def __init__(self, fn: RewardFn, workers: int = 8, executor: Literal["thread", "process"] = "thread",
                 retries: int = 0, timeout_s: Optional[float] = None):
        if workers < 0:
            raise ValueError(f"reward.workers must be >= 0, got {workers}")
        if executor not in ("thread", "process"):
            raise ValueError(f"reward.executor must be 'thread' or 'process', got {executor!r}")
        if timeout_s is not None and timeout_s <= 0:
            raise ValueError(f"reward.timeout_s must be > 0 (or null: no deadline), got {timeout_s}")
        self.fn = fn
        self.workers = workers
        self.executor = executor
        self.retries = retries
        self.timeout_s = timeout_s
        self._tokens = itertools.count()   # one per submitted sample, announced when a worker starts it
        self._starts: Any = None
        self._pool: Optional[cf.Executor] = None

    def _get_pool(self) -> cf.Executor:
        if self._pool is None:
            if self.executor == "thread":
                self._starts = queue.SimpleQueue()
                self._pool = DaemonThreadPool(self.workers)
            else:
                # forkserver: the trainer holds threads (Ray, HTTP clients) that must not be forked
                ctx = mp.get_context("forkserver")
                self._starts = ctx.SimpleQueue()   # workers inherit it at start (a queue cannot be a task argument)
                self._pool = cf.ProcessPoolExecutor(self.workers, mp_context=ctx, initializer=_set_start_queue,
                                                    initargs=(self._starts,))
        return self._pool

    def _submit(self, token: int, text: str, record: Any) -> cf.Future:
        """Score one sample in the pool; the worker announces ``token`` on the start queue first."""
        pool = self._get_pool()
        starts = self._starts if self.executor == "thread" else None
        return pool.submit(_score_announced, starts, token, self.fn, text, record, self.retries)

    def score(self, texts: Sequence[str], records: Sequence[Any]) -> list[Score]:
        """``[fn(text, record) for ...]`` computed by the pool, a :class:`Failure` where it failed;
        the order of the inputs is kept."""
        if len(texts) != len(records):
            raise ValueError(f"{len(texts)} responses but {len(records)} records")
        items = list(zip(texts, records))
        # one item is scored inline with threads; processes get it too: a scorer may need a main thread
        # (math-verify's SIGALRM timeouts), which the caller's thread need not be
        if self.workers == 0 or (len(items) <= 1 and self.executor == "thread" and self.timeout_s is None):
            return _score_chunk(self.fn, items, self.retries)
        if self.timeout_s is not None:
            return self._score_with_deadline(items)
        pool = self._get_pool()
        if self.executor == "thread":
            return list(pool.map(lambda it: score_one(self.fn, *it, self.retries), items))
        # processes: a few chunks per worker bound the pickling overhead per call
        size = max(1, len(items) // (self.workers * 4))
        chunks = [items[i:i + size] for i in range(0, len(items), size)]
        futures = [pool.submit(_score_chunk, self.fn, chunk, self.retries) for chunk in chunks]
        out: list[Score] = []
        for chunk, fut in zip(chunks, futures):
            try:
                out += fut.result()
            except BrokenProcessPool as err:   # a worker died (killed, out of memory, a crash in C code)
                out += [_crashed(err)] * len(chunk)
        if any(isinstance(s, Failure) and s.reason == "worker_crashed" for s in out):
            self.close()   # a broken pool refuses every later call: the next one starts fresh workers
        return out

    def _score_with_deadline(self, items: list[tuple[str, Any]]) -> list[Score]:
        """One task per sample; a sample running longer than ``timeout_s`` since its worker started
        it (announced on the pool's start queue, seen within ``_POLL_S``) fails with reason ``timeout``.

        A sample past its deadline is tried again (in a fresh pool) up to ``retries`` times, then
        fails. A hung call holds its worker, so a timeout retires the pool: the samples it has not
        started go to a fresh pool, its running ones finish where they are, and once the batch
        is in the retired pool's processes are killed (threads are left behind: Python cannot stop
        them)."""
        token_of: dict[int, int] = {}
        futures: dict[int, cf.Future] = {}
        owner: dict[int, cf.Executor] = {}   # the pool each sample runs in
        start_queues: dict[int, Any] = {}    # every pool's start queue this batch used, retired ones too

        def submit(i: int) -> None:
            token_of[i] = next(self._tokens)
            futures[i] = self._submit(token_of[i], *items[i])
            owner[i] = self._pool
            start_queues.setdefault(id(self._starts), self._starts)

        for i in range(len(items)):
            submit(i)
        out: list[Optional[Score]] = [None] * len(items)
        started: dict[int, float] = {}   # token -> when its start was seen
        retired: list[tuple[cf.Executor, list]] = []   # (pool, its worker processes)
        timeouts: dict[int, int] = {}   # sample -> times it ran past the deadline
        hung = 0
        while futures:
            cf.wait(list(futures.values()), timeout=_POLL_S, return_when=cf.FIRST_COMPLETED)
            for starts in start_queues.values():
                while not starts.empty():
                    started[starts.get()] = time.monotonic()
            now = time.monotonic()
            for i, fut in list(futures.items()):
                if fut.cancelled() or (owner[i] is not self._pool and token_of[i] not in started and not fut.done()):
                    submit(i)   # queued in a retired pool (cancelled, or in its call queue behind a hung worker)
                elif fut.done():
                    del futures[i]
                    try:
                        out[i] = fut.result()
                    except BrokenProcessPool as err:
                        out[i] = _crashed(err)
                elif token_of[i] in started and now - started[token_of[i]] > self.timeout_s:
                    del futures[i]
                    hung += 1
                    if owner[i] is self._pool:
                        # the processes are taken first: shutdown(wait=False) lets go of the pool's list
                        retired.append((owner[i], _worker_processes(owner[i])))
                        self._pool = None
                        owner[i].shutdown(wait=False, cancel_futures=True)
                    timeouts[i] = timeouts.get(i, 0) + 1
                    if timeouts[i] <= self.retries:   # a transient hang: tried again in a fresh pool
                        submit(i)
                    else:
                        out[i] = Failure("timeout", f"reward function still running after reward.timeout_s="
                                                    f"{self.timeout_s:g} s" + (f" ({timeouts[i]} tries)"
                                                                               if timeouts[i] > 1 else ""))
        for pool, processes in retired:
            _drop(pool, processes)
        if hung and self.executor == "thread":
            log.warning("%d reward function call(s) still running past reward.timeout_s in threads, which cannot "
                        "be stopped; they are abandoned (reward.executor: process kills them)", hung)
        if any(isinstance(s, Failure) and s.reason == "worker_crashed" for s in out):
            self.close()   # a broken pool refuses every later call: the next one starts fresh workers
        return [s for s in out if s is not None]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def __enter__(self) -> "RewardPool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class DaemonThreadPool(cf.Executor):
    """A fixed set of daemon worker threads behind the ``Executor`` interface.

    ``ThreadPoolExecutor``'s threads are joined when the interpreter exits, so one reward call that
    never returns would hold the trainer's exit forever; daemon threads are not waited for."""

    def __init__(self, workers: int):
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self._workers = max(1, workers)
        for k in range(self._workers):
            threading.Thread(target=self._work, name=f"megarl-reward-{k}", daemon=True).start()

    def _work(self) -> None:
        while True:
            task = self._tasks.get()
            if task is None:
                return
            fut, fn, args = task
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as err:  # noqa: BLE001 - handed to the caller through the future
                fut.set_exception(err)

    def submit(self, fn: Callable, /, *args: Any, **kwargs: Any) -> cf.Future:
        if self._closed:
            raise RuntimeError("reward pool is shut down")
        fut: cf.Future = cf.Future()
        self._tasks.put((fut, functools.partial(fn, **kwargs) if kwargs else fn, args))
        return fut

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Stop taking work; queued futures are cancelled when asked (``wait`` is not supported:
        a hung call would never let it return)."""
        self._closed = True
        if cancel_futures:
            while True:
                try:
                    task = self._tasks.get_nowait()
                except queue.Empty:
                    break
                if task is not None:
                    task[0].cancel()
        for _ in range(self._workers):
            self._tasks.put(None)   # each worker ends at the first one it reads


_START_QUEUE: Any = None   # a process worker's start queue (set by its pool's initializer)


def _set_start_queue(starts: Any) -> None:
    global _START_QUEUE
    _START_QUEUE = starts


def _score_announced(starts: Any, token: int, fn: RewardFn, text: str, record: Any, retries: int) -> Score:
    """``score_one``, after telling the pool (its start queue) that ``token`` began now."""
    (starts if starts is not None else _START_QUEUE).put(token)
    return score_one(fn, text, record, retries)


def _worker_processes(pool: cf.Executor) -> list:
    """A process pool's worker processes (none for threads)."""
    return list((getattr(pool, "_processes", None) or {}).values())


def _drop(pool: cf.Executor, processes: list) -> None:
    """End a retired pool whose other work is done: kill its processes (one is hung; the
    interpreter's exit joins a process pool's manager thread, which waits for every worker), or let
    go of its daemon threads (a hung one is left behind and does not hold the exit)."""
    if isinstance(pool, cf.ProcessPoolExecutor):
        for proc in processes:
            proc.kill()
        for proc in processes:
            proc.join(timeout=10)
        pool.shutdown(wait=True, cancel_futures=True)
        return
    pool.shutdown(wait=False, cancel_futures=True)   # daemon threads: a hung one does not hold the exit


def _crashed(err: BaseException) -> Failure:
    return Failure("worker_crashed", f"reward worker process died: {err}")
