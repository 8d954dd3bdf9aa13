"""RolloutManager over real embedded servers: spread, n samples, batching, streaming, a dying server's
requests retried."""
import signal
import threading
import time

import pytest

from megarl.rollout.client import sampling_params
from megarl.rollout.manager import NoServerLeft, RolloutManager
from tests.helpers.per_sample import PerSampleManager
from tests.helpers.servers import ServerProcess, free_port, make_tiny_hf_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("mgr") / "m")
    make_tiny_hf_model(d, "llama", std=0.3)
    return d


def test_spread_and_server_death(model_dir):
    s1, s2 = ServerProcess(model_dir), ServerProcess(model_dir)
    try:
        s1.wait_ready()
        s2.wait_ready()
        mgr = RolloutManager([s1.url, s2.url], timeout_s=60)
        for c in mgr.clients:
            c.retries, c.backoff_s = 1, 0.05
        prompts = [[i + 1, i + 2, i + 3] for i in range(6)]
        groups = mgr.generate(prompts, n=3, sampling=sampling_params(max_new_tokens=6, temperature=1.0), seed=1)
        again = mgr.generate(prompts, n=3, sampling=sampling_params(max_new_tokens=6, temperature=1.0), seed=1)
        assert len(groups) == 6 and all(len(g) == 3 for g in groups)
        for g, g2 in zip(groups, again):
            for o, o2 in zip(g, g2):
                assert len(o.output_ids) == 6 and len(o.logprobs) == 6 and o.finish_reason == "length"
                assert o.output_ids == o2.output_ids  # per-sample seeds: reproducible across servers
        assert mgr.dead == set()

        # kill server 2 while a long batch is in flight: everything still comes back, from s1. s2 is
        # stopped (SIGSTOP) first, so whatever it was sent is still unanswered when it dies, however
        # fast the machine (a sleep before the kill let a fast box finish s2's share first)
        s2.proc.send_signal(signal.SIGSTOP)

        def kill_when_busy():
            deadline = time.time() + 300   # a hang guard
            while mgr.outstanding[1] == 0 and time.time() < deadline:
                time.sleep(0.01)
            s2.proc.kill()
        killer = threading.Thread(target=kill_when_busy)
        killer.start()
        t = time.time()
        groups = mgr.generate([[i, i + 1] for i in range(8)], n=2,
                              sampling=sampling_params(max_new_tokens=400, temperature=1.0, ignore_eos=True), seed=2)
        killer.join()
        assert mgr.dead_urls == [s2.url] and mgr.failures
        assert all(len(o.output_ids) == 400 and len(o.logprobs) == 400 for g in groups for o in g)
        print(f"\n[manager] recovered from a killed server in {time.time() - t:.1f}s: {mgr.failures[0][:90]}")
        assert list(mgr.call_all("flush_cache")) == [s1.url]
        mgr.close()
    finally:
        s1.stop()
        s2.stop()


def test_all_servers_down_raises():
    mgr = RolloutManager([f"http://127.0.0.1:{free_port()}"])
    for c in mgr.clients:
        c.retries = 0
    with pytest.raises(NoServerLeft):
        mgr.generate([[1, 2]], n=1, sampling=sampling_params(max_new_tokens=2))
    mgr.close()


def test_batched_requests_give_the_per_sample_results(model_dir):
    """The batched path (chunks of whole groups, one item per seeded sample) returns, sample for
    sample, what one request per sample returns; it sends a few requests instead of one per
    sample, and streams every prompt back exactly once."""
    with ServerProcess(model_dir, extra=["--max-running-requests", "32"]) as s:
        batched, old = RolloutManager([s.url]), PerSampleManager([s.url])
        prompts = [[i + 1, i + 2, i + 3] for i in range(6)] + [[1, 2, 3]]    # a repeated prompt too
        sp = sampling_params(max_new_tokens=8, temperature=1.0)
        try:
            a = batched.generate(prompts, n=4, sampling=sp, seed=11)
            b = old.generate(prompts, n=4, sampling=sp, seed=11)
            for ga, gb in zip(a, b):
                for oa, ob in zip(ga, gb):
                    assert oa.output_ids == ob.output_ids
                    assert max(abs(x - y) for x, y in zip(oa.logprobs, ob.logprobs)) < 1e-5
            assert old.requests == 28 and batched.requests < 28
            seen = [p for p, outs in batched.stream(prompts, n=2, sampling=sp, seed=3) if len(outs) == 2]
            assert sorted(seen) == list(range(len(prompts)))
            free = batched.generate(prompts[:2], n=3, sampling=sp)               # no seed: one item with n=3
            assert all(len(g) == 3 and len({tuple(o.output_ids) for o in g}) > 1 for g in free)
        finally:
            batched.close()
            old.close()


def test_single_sample_requests_issued_together_share_one_request(model_dir):
    """``generate_one`` calls of one ``batch_key`` and one loop turn (a group's samples, the
    off-policy sources) go out as one batched /generate: the same tokens as one request each
    (per-sample seeds), one request per key; an item the server refuses fails alone, the others
    are answered."""
    import asyncio

    from megarl.rollout.client import RequestFailed

    with ServerProcess(model_dir) as s:
        together, alone = RolloutManager([s.url]), RolloutManager([s.url], coalesce_max_samples=1)
        sp = sampling_params(max_new_tokens=6, temperature=1.0)
        prompts = [[i + 1, i + 2, i + 3] for i in range(5)]

        async def group(mgr, bad_item=None):
            items = [(p, dict(sp, n=1, sampling_seed=100 + 4 * j + k)) for j, p in enumerate(prompts) for k in range(4)]
            if bad_item is not None:
                items[bad_item] = (items[bad_item][0], dict(items[bad_item][1], max_new_tokens=-3))
            return await asyncio.gather(*(mgr.generate_one(ids, params, job_index=i, batch_key=i // 4)
                                          for i, (ids, params) in enumerate(items)), return_exceptions=True)
        try:
            a = together.io.run(group(together))
            b = alone.io.run(group(alone))
            assert together.requests == 5 and alone.requests == 20   # one per prompt's 4 samples
            for oa, ob in zip(a, b):
                assert oa.output_ids == ob.output_ids and len(oa.output_ids) == 6
                assert max(abs(x - y) for x, y in zip(oa.logprobs, ob.logprobs)) < 1e-5
            refused = together.io.run(group(together, bad_item=7))
            assert isinstance(refused[7], RequestFailed) and refused[7].status == 400
            good = [o for i, o in enumerate(refused) if i != 7]
            assert all(o.output_ids == ob.output_ids for o, ob in zip(good, b[:7] + b[8:]))
        finally:
            together.close()
            alone.close()
