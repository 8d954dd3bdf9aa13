"""RequestCoalescer on its own: which requests share a batch, order of answers, refusals, cancellation.
(The batch form itself is checked against a real server in test_rollout_manager.py.)"""
import asyncio

from megarl.rollout.client import RequestFailed
from megarl.rollout.coalesce import RequestCoalescer, coalescer


class Recorder:
    """A send_batch that answers each item with its own input ids (after ``delay_s``) and records the batches."""

    def __init__(self, delay_s: float = 0.0, refuse=lambda ids: False):
        self.batches: list[list[list[int]]] = []
        self.delay_s, self.refuse = delay_s, refuse
        self.cancelled = 0

    async def __call__(self, ids, params, order):
        self.batches.append(ids)
        try:
            await asyncio.sleep(self.delay_s)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        if any(self.refuse(i) for i in ids):
            raise RequestFailed("http://server", 400, {"message": "bad item"})
        return [("answer", tuple(i), p["seed"]) for i, p in zip(ids, params)]


def test_one_batch_per_key_and_turn_answers_in_order():
    send = Recorder()
    co = RequestCoalescer(send, max_samples=3)

    async def run():
        jobs = [co.submit(key, [key, k], {"seed": 10 * key + k}, k) for key in (1, 2) for k in range(4)]
        return await asyncio.gather(*jobs)
    answers = asyncio.run(run())
    assert answers == [("answer", (key, k), 10 * key + k) for key in (1, 2) for k in range(4)]
    # never two keys in one request; at most 3 items each (the 4th of a key goes in the next one)
    assert sorted(send.batches) == sorted([[[1, 0], [1, 1], [1, 2]], [[1, 3]], [[2, 0], [2, 1], [2, 2]], [[2, 3]]])


def test_refused_batch_is_resent_item_by_item():
    send = Recorder(refuse=lambda ids: ids == [7, 7])
    co = RequestCoalescer(send, max_samples=8)

    async def run():
        return await asyncio.gather(*(co.submit("g", ids, {"seed": i}, i) for i, ids in
                                      enumerate([[1], [7, 7], [2]])), return_exceptions=True)
    ok1, bad, ok2 = asyncio.run(run())
    assert ok1 == ("answer", (1,), 0) and ok2 == ("answer", (2,), 2)
    assert isinstance(bad, RequestFailed) and bad.status == 400
    assert len(send.batches) == 4   # the batch of three, then each item alone


def test_cancelled_waiters_stop_their_request():
    send = Recorder(delay_s=30)
    co = RequestCoalescer(send, max_samples=8)

    async def run():
        tasks = [asyncio.ensure_future(co.submit("g", [k], {"seed": k}, k)) for k in range(3)]
        while not send.batches:
            await asyncio.sleep(0)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.sleep(0)   # the request's task sees its cancellation
        return [t.cancelled() for t in tasks]
    assert asyncio.run(asyncio.wait_for(run(), 10)) == [True, True, True]
    assert send.cancelled == 1


def test_one_sample_per_request_means_no_coalescer():
    assert coalescer(Recorder(), 1) is None and isinstance(coalescer(Recorder(), 2), RequestCoalescer)
