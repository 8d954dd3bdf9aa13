"""Score a batch's responses in parallel workers, results in input order.

Why: the trainer used to call the reward function once per sample in its own thread, so a user
function that takes a second (a sandboxed test run, a remote judge, a slow verifier) made a
1k-sample step wait 1k seconds. ``RewardPool`` maps the function over the samples with
``workers`` threads (any callable; parallel while the function waits on I/O, a subprocess or a
sandbox, or runs C code that releases the GIL) or processes (CPU-bound pure-Python scorers; the
function and records must pickle, e.g. a module-level function). ``workers = 0`` scores inline.
"""
from __future__ import annotations

import concurrent.futures as cf
import multiprocessing as mp
from typing import Any, Callable, Literal, Optional, Sequence

RewardFn = Callable[[str, Any], float]


def _score_chunk(fn: RewardFn, items: list[tuple[str, Any]]) -> list[float]:
    return [float(fn(text, record)) for text, record in items]


class RewardPool:
    def __init__(self, fn: RewardFn, workers: int = 8, executor: Literal["thread", "process"] = "thread"):
        if workers < 0:
            raise ValueError(f"reward.workers must be >= 0, got {workers}")
        if executor not in ("thread", "process"):
            raise ValueError(f"reward.executor must be 'thread' or 'process', got {executor!r}")
        self.fn = fn
        self.workers = workers
        self.executor = executor
        self._pool: Optional[cf.Executor] = None

    def _get_pool(self) -> cf.Executor:
        if self._pool is None:
            if self.executor == "thread":
                self._pool = cf.ThreadPoolExecutor(self.workers, thread_name_prefix="megarl-reward")
            else:
                # forkserver: the trainer holds threads (Ray, HTTP clients) that must not be forked
                self._pool = cf.ProcessPoolExecutor(self.workers, mp_context=mp.get_context("forkserver"))
        return self._pool

    def score(self, texts: Sequence[str], records: Sequence[Any]) -> list[float]:
        """``[fn(text, record) for ...]`` computed by the pool; the order of the inputs is kept."""
        if len(texts) != len(records):
            raise ValueError(f"{len(texts)} responses but {len(records)} records")
        items = list(zip(texts, records))
        # one item is scored inline with threads; processes get it too: a scorer may need a main thread
        # (math-verify's SIGALRM timeouts), which the caller's thread need not be
        if self.workers == 0 or (len(items) <= 1 and self.executor == "thread"):
            return _score_chunk(self.fn, items)
        pool = self._get_pool()
        if self.executor == "thread":
            return [float(x) for x in pool.map(lambda it: self.fn(*it), items)]
        # processes: a few chunks per worker bound the pickling overhead per call
        size = max(1, len(items) // (self.workers * 4))
        chunks = [items[i:i + size] for i in range(0, len(items), size)]
        return [s for part in pool.map(_score_chunk, [self.fn] * len(chunks), chunks) for s in part]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def __enter__(self) -> "RewardPool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
