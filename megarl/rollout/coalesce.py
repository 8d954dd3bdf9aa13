"""A group's single-sample requests, issued together, go out as one batched ``/generate``.

The off-policy sources ask for one sample at a time (each is resumable on its own after an
abort). Sent as they are, a step of 512 samples is 512 HTTP requests, each costing Python time on
the client's HTTP thread in the trainer's process (``benchmarks/bench_client_cpu.py``: 0.14 s of
CPU per step one request per sample, 0.05 s one per group). That thread shares the interpreter lock
with the main thread, which launches the trainer's kernels beside an overlapped rollout.

Requests submitted with the same key (a GRPO group) in the same turn of the event loop
(``asyncio.gather`` over a group's samples starts them all in one turn) are collected until the
loop comes back around, then sent as one request in SGLang's batch form (a list of ``input_ids``,
one ``sampling_params`` each; answers in the same order). Only one key's requests share a batch:
a batch answers when its last item is done, and a group is only usable whole anyway, while two
groups coupled would hold the first finished one back (and, in async mode, keep it from meeting
the next weight push in flight). Each sample keeps its own sampling seed, so the tokens are the
same as sent one by one. A batch the server refuses as a whole (4xx) is sent again one item at a
time, so only the item that is wrong fails.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Hashable, Optional

from megarl.rollout.client import GenerateOutput, RequestFailed, Unauthorized

# (input_ids of each item, sampling params of each item, order for server choice) -> outputs in item order
SendBatch = Callable[[list[list[int]], list[dict[str, Any]], int], Awaitable[list[GenerateOutput]]]


@dataclass
class _Pending:
    input_ids: list[int]
    params: dict[str, Any]
    order: int
    future: asyncio.Future = field(repr=False)
    batch: list["_Pending"] = field(default_factory=list, repr=False)   # the items sent with this one
    task: Optional[asyncio.Task] = field(default=None, repr=False)      # the request carrying them


class RequestCoalescer:
    """Collects ``submit`` calls of one key and one loop turn (at most ``max_samples``) into one batch."""

    def __init__(self, send_batch: SendBatch, max_samples: int) -> None:
        if max_samples < 1:
            raise ValueError(f"max_samples must be >= 1, got {max_samples}")
        self.send_batch = send_batch
        self.max_samples = max_samples
        self._pending: dict[Hashable, list[_Pending]] = {}   # key -> items waiting for the end of the turn

    async def submit(self, key: Hashable, input_ids: list[int], params: dict[str, Any], order: int) -> GenerateOutput:
        loop = asyncio.get_running_loop()
        item = _Pending(input_ids, params, order, loop.create_future())
        waiting = self._pending.setdefault(key, [])
        waiting.append(item)
        if len(waiting) >= self.max_samples:
            self._flush(key)
        elif len(waiting) == 1:
            loop.call_soon(self._flush, key)   # after the other tasks already scheduled for this turn
        try:
            return await item.future
        except asyncio.CancelledError:
            # every sample of the request stopped waiting (the source closed): stop the request too
            if item.task is not None and all(b.future.done() for b in item.batch):
                item.task.cancel()
            raise

    def _flush(self, key: Hashable) -> None:
        batch = [b for b in self._pending.pop(key, []) if not b.future.done()]   # done: cancelled already
        if batch:
            task = asyncio.ensure_future(self._send(batch))
            for item in batch:
                item.batch, item.task = batch, task

    async def _send(self, batch: list[_Pending]) -> None:
        """Settle every item's future: with its answer, or with the error that ended it."""
        try:
            outs = await self.send_batch([b.input_ids for b in batch], [b.params for b in batch], batch[0].order)
        except RequestFailed as err:
            if len(batch) > 1 and err.status < 500 and not isinstance(err, Unauthorized):
                await asyncio.gather(*(self._send([b]) for b in batch))   # the refused item fails alone
                return
            self._fail(batch, err)
            return
        except BaseException as err:
            self._fail(batch, err)
            if not isinstance(err, Exception):
                raise
            return
        if len(outs) != len(batch):
            self._fail(batch, RuntimeError(f"a batched /generate answered {len(outs)} outputs for {len(batch)} items"))
            return
        for item, out in zip(batch, outs):
            if not item.future.done():   # done: its caller was cancelled meanwhile
                item.future.set_result(out)

    @staticmethod
    def _fail(batch: list[_Pending], err: BaseException) -> None:
        for item in batch:
            if not item.future.done():
                if isinstance(err, asyncio.CancelledError):
                    item.future.cancel()
                else:
                    item.future.set_exception(err)


def coalescer(send_batch: SendBatch, max_samples: Optional[int]) -> Optional[RequestCoalescer]:
    """None when requests go out one by one (``max_samples`` <= 1)."""
    return RequestCoalescer(send_batch, max_samples) if max_samples and max_samples > 1 else None
