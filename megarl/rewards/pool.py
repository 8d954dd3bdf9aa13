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
"""
from __future__ import annotations

import concurrent.futures as cf
import multiprocessing as mp
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Callable, Literal, Optional, Sequence

from megarl.rewards.failures import Failure, Score, checked_score, failure_of

RewardFn = Callable[[str, Any], float]


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
                 retries: int = 0):
        if workers < 0:
            raise ValueError(f"reward.workers must be >= 0, got {workers}")
        if executor not in ("thread", "process"):
            raise ValueError(f"reward.executor must be 'thread' or 'process', got {executor!r}")
        self.fn = fn
        self.workers = workers
        self.executor = executor
        self.retries = retries
        self._pool: Optional[cf.Executor] = None

    def _get_pool(self) -> cf.Executor:
        if self._pool is None:
            if self.executor == "thread":
                self._pool = cf.ThreadPoolExecutor(self.workers, thread_name_prefix="megarl-reward")
            else:
                # forkserver: the trainer holds threads (Ray, HTTP clients) that must not be forked
                self._pool = cf.ProcessPoolExecutor(self.workers, mp_context=mp.get_context("forkserver"))
        return self._pool

    def score(self, texts: Sequence[str], records: Sequence[Any]) -> list[Score]:
        """``[fn(text, record) for ...]`` computed by the pool, a :class:`Failure` where it failed;
        the order of the inputs is kept."""
        if len(texts) != len(records):
            raise ValueError(f"{len(texts)} responses but {len(records)} records")
        items = list(zip(texts, records))
        # one item is scored inline with threads; processes get it too: a scorer may need a main thread
        # (math-verify's SIGALRM timeouts), which the caller's thread need not be
        if self.workers == 0 or (len(items) <= 1 and self.executor == "thread"):
            return _score_chunk(self.fn, items, self.retries)
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
                out += [Failure("worker_crashed", f"reward worker process died: {err}")] * len(chunk)
        if any(isinstance(s, Failure) and s.reason == "worker_crashed" for s in out):
            self.close()   # a broken pool refuses every later call: the next one starts fresh workers
        return out

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def __enter__(self) -> "RewardPool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
