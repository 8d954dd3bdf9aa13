"""The embedded engine's batching machinery against references that do not use it: prefix sharing,
row compaction, the decode graph's padded/bucketed body, seeds per sample -- each must leave every
request's tokens and logprobs what they are when the request runs alone."""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from transformers import AutoConfig

from megarl.engine.engine import Engine, Request, Sampling
from megarl.engine.graphs import batch_buckets, len_bucket
from megarl.engine.model import DecoderModel
from tests.helpers.graphs import EmulatedGraphs
from tests.helpers.servers import make_tiny_hf_model

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("eng") / "m")
    hf = make_tiny_hf_model(d, "llama", std=0.3)
    return d, hf


def _model(d: str) -> DecoderModel:
    m = DecoderModel(AutoConfig.from_pretrained(d))
    m.load_hf_dir(d)
    return m


def _run(d: str, reqs: list[Request], **kw) -> tuple[list[dict], dict]:
    eng = Engine(_model(d), **kw)
    eng.start()
    try:
        futs = eng.submit_many(reqs)
        return [f.result(timeout=120) for f in futs], dict(eng.stats)
    finally:
        eng.stop()


def _alone(d: str, req: Request) -> dict:
    return _run(d, [req], max_running=1, max_len=128)[0][0]


def _req(prompt, seed=None, max_new=12, **kw) -> Request:
    return Request(list(prompt), Sampling(max_new_tokens=max_new, sampling_seed=seed, **kw), return_logprob=True)


def _same(a: dict, b: dict, tol: float = 1e-5) -> None:
    assert a["output_ids"] == b["output_ids"]
    la = [x[0] for x in a["meta_info"]["output_token_logprobs"]]
    lb = [x[0] for x in b["meta_info"]["output_token_logprobs"]]
    assert max(abs(x - y) for x, y in zip(la, lb)) < tol


PROMPT_A = [5, 17, 42, 99, 3, 250, 7, 8, 9]
PROMPT_B = [11, 12, 13]


def test_group_prefills_once_and_each_sample_matches_its_run_alone(tiny):
    """8 samples of two prompts (4 each, own seeds, different lengths): 2 prefills, 6 copies;
    every sample equals the same request run alone in a batch of one."""
    d, _ = tiny
    reqs = [_req(PROMPT_A if i < 4 else PROMPT_B, seed=100 + i, max_new=4 + 3 * (i % 4), ignore_eos=True)
            for i in range(8)]
    outs, stats = _run(d, [_req(r.input_ids, r.sampling.sampling_seed, r.sampling.max_new_tokens, ignore_eos=True)
                           for r in reqs], max_running=8, max_len=128)
    assert stats["prefill_tokens"] == len(PROMPT_A) + len(PROMPT_B)
    assert stats["shared_prefill_tokens"] == 3 * len(PROMPT_A) + 3 * len(PROMPT_B)
    assert stats["admissions"] == 1
    for r, o in zip(reqs, outs):
        _same(o, _alone(d, r))
        assert len(o["output_ids"]) == r.sampling.max_new_tokens     # finished at different steps
    assert outs[0]["meta_info"]["cached_tokens"] == 0 and outs[1]["meta_info"]["cached_tokens"] == len(PROMPT_A)
    assert len({tuple(o["output_ids"]) for o in outs[:4]}) > 1           # the seeds differ


def test_no_prefix_sharing_gives_the_same_outputs(tiny):
    d, _ = tiny
    reqs = lambda: [_req(PROMPT_A, seed=7 + i, max_new=8) for i in range(4)]  # noqa: E731
    shared, s1 = _run(d, reqs(), max_running=4, max_len=128)
    alone, s2 = _run(d, reqs(), max_running=4, max_len=128, prefix_sharing=False)
    assert s1["prefill_tokens"] == len(PROMPT_A) and s2["prefill_tokens"] == 4 * len(PROMPT_A)
    for a, b in zip(shared, alone):
        _same(a, b)


def test_prompt_held_by_a_running_row_is_copied_and_its_last_token_recomputed(tiny):
    """Two rows only: the group's later samples wait for a row, then take the prompt's KV from a
    sample still running (all but the last prompt token, which is recomputed at an offset)."""
    d, _ = tiny
    reqs = [_req(PROMPT_A, seed=30 + i, max_new=3 if i == 0 else 10, ignore_eos=True) for i in range(4)]
    outs, stats = _run(d, [_req(r.input_ids, r.sampling.sampling_seed, r.sampling.max_new_tokens, ignore_eos=True)
                           for r in reqs], max_running=2, max_len=128)
    assert stats["admissions"] >= 2
    assert stats["prefill_tokens"] < 4 * len(PROMPT_A)                     # later admissions reused the prompt
    assert any(o["meta_info"]["cached_tokens"] == len(PROMPT_A) - 1 for o in outs)
    for r, o in zip(reqs, outs):
        _same(o, _alone(d, r))


def test_greedy_batch_with_compaction_equals_hf_generate(tiny):
    """Requests of different lengths and budgets finish at different steps; the survivors move to
    the freed rows; every greedy output is still HF's."""
    d, hf = tiny
    prompts = [PROMPT_A, PROMPT_B, [200, 100, 50, 25], [1, 2], [9] * 11, [3, 4, 5, 6, 7]]
    budgets = [2, 12, 5, 9, 1, 7]
    outs, stats = _run(d, [_req(p, max_new=n, temperature=0.0) for p, n in zip(prompts, budgets)],
                       max_running=6, max_len=64)
    for p, n, o in zip(prompts, budgets, outs):
        ref = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long), max_new_tokens=n,
                          min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
        assert o["output_ids"] == ref
    assert stats["max_batch"] == 5     # the 1-token request finished on its prefill token


def test_weight_change_ends_prefix_sharing_with_running_rows(tiny):
    """KV computed before a control op (a weight update) is never copied after it."""
    d, _ = tiny
    eng = Engine(_model(d), max_running=4, max_len=256)
    eng.start()
    try:
        first = eng.submit(_req(PROMPT_A, seed=1, max_new=200, ignore_eos=True))
        while eng.stats["steps"] < 2:
            time.sleep(0.01)
        eng.control(lambda: None).result(timeout=30)
        before = eng.stats["shared_prefill_tokens"]
        eng.submit(_req(PROMPT_A, seed=2, max_new=2)).result(timeout=60)
        assert eng.stats["shared_prefill_tokens"] == before          # prefilled again, not copied
        first.result(timeout=120)
    finally:
        eng.stop()


def test_requests_reports_running_rows_and_the_queue(tiny):
    """``Engine.requests`` (what the servers report so that tests wait for a request to generate
    instead of sleeping): submitted while paused, both requests are queued; with one row, one runs
    (its first token out) and the other waits; paused in place, nothing moves; a read-only control
    starts no new weight epoch."""
    d, _ = tiny
    eng = Engine(_model(d), max_running=1, max_len=4096)   # 4000 tokens: more than any machine makes meanwhile
    eng.start()
    read = lambda: eng.control(eng.requests, new_epoch=False).result(timeout=300)  # noqa: E731
    try:
        eng.control(lambda: eng.pause("in_place")).result(timeout=300)
        a = _req(PROMPT_A, seed=1, max_new=4000, ignore_eos=True)
        b = _req(PROMPT_B, seed=2, max_new=4000, ignore_eos=True)
        eng.submit_many([a])
        eng.submit_many([b])
        epoch = eng.epoch
        assert read() == {"running": {}, "queued": [a.rid, b.rid]} and eng.epoch == epoch
        eng.control(eng.unpause).result(timeout=300)
        deadline = time.time() + 300   # a hang guard: ends once a is seen running
        while a.rid not in (held := read())["running"] and time.time() < deadline:
            time.sleep(0.005)
        assert held["running"][a.rid] >= 1 and held["queued"] == [b.rid], held
        eng.control(lambda: eng.pause("in_place")).result(timeout=300)
        frozen = read()
        assert list(frozen["running"]) == [a.rid] and frozen["queued"] == [b.rid], frozen
        assert read() == frozen                     # paused in place: not a token more
        eng.control(lambda: eng.abort(abort_all=True)).result(timeout=300)
        assert read() == {"running": {}, "queued": []}
        done = a.done.result(timeout=300)
        assert done["meta_info"]["finish_reason"]["type"] == "abort"
        assert len(done["output_ids"]) == frozen["running"][a.rid]
    finally:
        eng.stop()


def test_padded_bucketed_decode_body_equals_the_exact_one(tiny):
    """What a decode CUDA graph replays -- rows padded to a batch bucket (token 0 at position 0 in
    free rows) and keys to a length bucket -- gives the running rows the logits of the exact step."""
    d, _ = tiny
    m = _model(d)
    m.alloc_cache(8, 64)
    m.prefill([PROMPT_A, PROMPT_B, [7, 7, 7]], 0)
    toks, pos = np.array([4, 5, 6]), np.array([len(PROMPT_A), len(PROMPT_B), 3])
    exact = m.decode(toks, pos).clone()
    m.prefill([PROMPT_A, PROMPT_B, [7, 7, 7]], 0)        # same cache state again
    Bb = next(b for b in batch_buckets(8) if b >= 3)
    Lk = len_bucket(int(pos.max()) + 1, 64)
    ids = torch.tensor(list(toks) + [0] * (Bb - 3))
    p = torch.tensor(list(pos) + [0] * (Bb - 3))
    with torch.inference_mode():
        padded = m._decode_body(ids, p, Bb, Lk)[:3]
    assert (Bb, Lk) == (4, 64)
    assert (padded - exact).abs().max().item() < 1e-5


def test_buckets():
    assert batch_buckets(512) == (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 448, 512)
    assert batch_buckets(6) == (1, 2, 4, 6)
    assert all(b <= 300 for b in batch_buckets(300)) and batch_buckets(300)[-1] == 300
    assert len_bucket(1, 2048) == 64 and len_bucket(65, 2048) == 128 and len_bucket(100, 90) == 90
    assert len_bucket(600, 4096) == 640 and len_bucket(1500, 4096) == 1536


def test_samples_of_one_seeded_request_differ_and_sample_zero_keeps_the_seed():
    s = Sampling(sampling_seed=5)
    seeds = [s.for_sample(j).sampling_seed for j in range(8)]
    assert seeds[0] == 5 and len(set(seeds)) == 8
    assert [Sampling(sampling_seed=5).for_sample(j).sampling_seed for j in range(8)] == seeds
    assert Sampling().for_sample(3).sampling_seed is None


def test_requests_that_finish_at_their_prefill_do_not_wait_between_admissions(tiny):
    """One new token each: a wave of requests finishes at its prefill, the batch is empty again, and
    the next wave must be admitted at once. The loop waited up to 50 ms per wave for a wake-up that
    never came (on the H100, 128 prompts of 2000 tokens with one new token took 2.58 s, longer than
    the ~1.3 s of the same prompts with 64 new tokens): here no wait may begin while admissible
    requests are queued."""
    d, _ = tiny
    eng = Engine(_model(d), max_running=4, max_len=64, max_prefill_tokens=16)   # one 9-token prompt a wave
    waits = []
    wake_wait = eng._wake.wait

    def wait(timeout=None):
        waits.append(len(eng._backlog))   # the engine thread's own queue (a submit may race the wait)
        return wake_wait(timeout)

    eng._wake.wait = wait
    eng.start()
    try:
        reqs = [_req(PROMPT_A[:-1] + [i], seed=i, max_new=1) for i in range(12)]
        outs = [f.result(timeout=120) for f in eng.submit_many(reqs)]
    finally:
        eng.stop()
    assert all(len(o["output_ids"]) == 1 for o in outs)
    assert eng.stats["admissions"] >= 12 // 2          # several waves (the prefill budget)
    assert not any(waits), waits                       # no wait began with requests queued


def test_a_buffer_the_body_makes_on_its_first_run_is_in_the_graphs_signature(tiny):
    """A body may make a buffer on its first (warm-up) run that its graph then reads (the attention
    kernel's former split counters did). Read before the warm-up, the signature lacked it: the first check
    after a release (every tensor back at its address) saw a "moved" tensor and captured every graph
    again -- what the GPU test of stable memory caught (2 captures where 1 was right)."""
    d, _ = tiny
    m = _model(d)
    m.alloc_cache(4, 128)

    def body(ids, pos, rows, Lk):
        if getattr(m, "_scratch", None) is None:   # made on first use, read by every step after
            m._scratch = torch.zeros(4, device=m.device)
        return m._decode_body(ids, pos, rows, Lk) + m._scratch.sum()

    graphs = EmulatedGraphs(body, m.tensor_addresses, m.device, 4, 128)
    m.prefill([[5, 17, 42], [7, 250]], 0)
    tokens, positions = np.array([9, 11]), np.array([3, 2])
    first = graphs.run(tokens, positions).clone()
    assert graphs.captures == 1 and m._scratch is not None
    m.tensor_addresses()                      # a full walk: it lists the buffer from now on
    graphs.mark_dirty()                       # a release and resume; nothing moved
    assert torch.equal(graphs.run(tokens, positions), first)
    assert graphs.captures == 1               # replayed, not captured again


def test_graph_path_gives_the_eager_outputs_and_is_invalidated_by_moved_tensors(tiny):
    d, hf = tiny
    reqs = lambda: ([_req(PROMPT_A, seed=50 + i, max_new=6 + 2 * i, ignore_eos=True) for i in range(3)]  # noqa: E731
                    + [_req(p, max_new=9, temperature=0.0) for p in (PROMPT_B, [1, 2])])
    eager, _ = _run(d, reqs(), max_running=6, max_len=128)
    m = _model(d)
    eng = Engine(m, max_running=6, max_len=128)
    m.use_cuda_graphs = True
    m.graphs = EmulatedGraphs(m._decode_body, m.tensor_addresses, m.device, 6, 128)
    eng.start()
    try:
        graphed = [f.result(timeout=120) for f in eng.submit_many(reqs())]
        first = m.graphs.captures
        again = [f.result(timeout=120) for f in eng.submit_many(reqs())]
        assert m.graphs.captures == first                       # same buckets: replayed, not recaptured
        eng.control(lambda: m.alloc_cache(6, 128)).result(timeout=30)   # a resume: maybe other addresses
        eng.control(lambda: setattr(m, "inv_freq", m.inv_freq.clone())).result(timeout=30)  # a moved tensor
        moved = [f.result(timeout=120) for f in eng.submit_many(reqs())]
        assert m.graphs.captures > first                        # the moved tensor forced a recapture
    finally:
        eng.stop()
    assert {key[0] for key in m.graphs.graphs} <= {1, 2, 4, 6}
    assert all(len(key) == 3 for key in m.graphs.graphs)   # the engine's steps sample inside the graph
    for outs in (graphed, again, moved):
        for a, b in zip(outs, eager):
            _same(a, b)


def test_filtered_rows_keep_the_graph_path_and_sample_as_they_do_alone(tiny):
    """top-k / top-p / min-p rows in a batch with unfiltered and greedy ones: the decode step stays
    on the (emulated) graph path -- no eager ``decode`` call -- and every request gets the tokens and
    logprobs it gets alone; top-p 0.01 keeps only the most likely token, so it decodes greedily."""
    d, _ = tiny
    reqs = lambda: [_req(PROMPT_A, seed=70, max_new=8, ignore_eos=True, top_k=5),  # noqa: E731
                    _req(PROMPT_A, seed=71, max_new=10, ignore_eos=True, top_p=0.6),
                    _req(PROMPT_B, seed=72, max_new=7, ignore_eos=True, min_p=0.2, temperature=0.7),
                    _req(PROMPT_B, seed=73, max_new=9, ignore_eos=True),
                    _req([1, 2], seed=74, max_new=6, ignore_eos=True, top_p=0.01),
                    _req([1, 2], max_new=6, ignore_eos=True, temperature=0.0)]
    m = _model(d)
    eng = Engine(m, max_running=6, max_len=128)
    m.use_cuda_graphs = True
    m.graphs = EmulatedGraphs(m._decode_body, m.tensor_addresses, m.device, 6, 128)
    eager_calls = []
    decode = m.decode
    m.decode = lambda *a, **k: (eager_calls.append(1), decode(*a, **k))[1]
    eng.start()
    try:
        outs = [f.result(timeout=120) for f in eng.submit_many(reqs())]
    finally:
        eng.stop()
    assert not eager_calls
    for r, o in zip(reqs(), outs):
        _same(o, _alone(d, r))
    assert outs[4]["output_ids"] == outs[5]["output_ids"]


def test_stop_answers_what_the_engine_holds_and_refuses_what_comes_after(tiny):
    """``Engine.stop``: a running request comes back aborted with the tokens it has (read while
    paused, so the count is exact), a queued one aborted with none; after stop, a request or a
    control call is refused at once (EngineStopped), never left waiting on a thread that has ended."""
    from megarl.engine.engine import EngineStopped

    d, _ = tiny
    eng = Engine(_model(d), max_running=1, max_len=4096)
    eng.start()
    read = lambda: eng.control(eng.requests, new_epoch=False).result(timeout=300)  # noqa: E731
    a = _req(PROMPT_A, seed=1, max_new=4000, ignore_eos=True)
    b = _req(PROMPT_B, seed=2, max_new=4000, ignore_eos=True)
    try:
        eng.submit_many([a, b])
        deadline = time.time() + 300   # a hang guard: ends once a is seen running
        while a.rid not in (held := read())["running"] and time.time() < deadline:
            time.sleep(0.005)
        eng.control(lambda: eng.pause("in_place")).result(timeout=300)
        frozen = read()
        assert list(frozen["running"]) == [a.rid] and frozen["queued"] == [b.rid], frozen
    finally:
        eng.stop()
    done_a, done_b = a.done.result(timeout=300), b.done.result(timeout=300)
    assert done_a["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(done_a["output_ids"]) == frozen["running"][a.rid] >= 1
    assert done_b["meta_info"]["finish_reason"]["type"] == "abort" and done_b["output_ids"] == []
    with pytest.raises(EngineStopped):
        eng.submit_many([_req(PROMPT_A, seed=3, max_new=4)])
    with pytest.raises(EngineStopped):
        eng.control(eng.requests, new_epoch=False).result(timeout=300)


def test_the_served_handle_takes_the_one_launch_decode_path_at_tp1(tiny):
    """What `megarl serve` builds (rank 0's `ModelHandle` over `Lockstep` and a `RankWorker`) must
    decode as the bare model does: forward and sampling in one (emulated) graph, the next step queued
    ahead -- no eager `decode` call -- with every request's tokens and logprobs those of the eager
    path. Before, the handle had no `decode_launch` and every served step decoded, then sampled."""
    from megarl.engine.worker import one_rank_handle

    d, _ = tiny
    reqs = lambda: ([_req(PROMPT_A, seed=90 + i, max_new=5 + 3 * i, ignore_eos=True) for i in range(3)]  # noqa: E731
                    + [_req(PROMPT_B, max_new=8, temperature=0.0)])
    eager, _ = _run(d, reqs(), max_running=4, max_len=128)
    m = _model(d)
    eager_calls = []
    decode = m.decode
    m.decode = lambda *a, **k: (eager_calls.append(1), decode(*a, **k))[1]
    handle = one_rank_handle(m)
    eng = Engine(handle, max_running=4, max_len=128)
    m.use_cuda_graphs = True
    m.graphs = EmulatedGraphs(m._decode_body, m.tensor_addresses, m.device, 4, 128)
    assert handle.decode_launch is not None and handle.can_chain()
    eng.start()
    try:
        served = [f.result(timeout=120) for f in eng.submit_many(reqs())]
    finally:
        eng.stop()
    assert not eager_calls and m.graphs.captures > 0
    assert all(len(key) == 3 for key in m.graphs.graphs)    # sampled inside the graph
    for a, b in zip(served, eager):
        _same(a, b)


def test_a_control_queued_while_a_step_is_in_flight_runs_after_that_step_is_read(tiny):
    """The loop drains a step launched ahead when it sees a queued control, but a control can arrive
    between that check and ``_run_controls``: it must still meet a settled batch (an abort run with
    a step in flight left that step's tokens for more rows than the batch held, and the next step
    failed every request)."""
    d, _ = tiny
    reqs = [_req(PROMPT_A, seed=40 + i, max_new=12, ignore_eos=True) for i in range(3)]
    m = _model(d)
    eng = Engine(m, max_running=4, max_len=128)
    m.use_cuda_graphs = True
    m.graphs = EmulatedGraphs(m._decode_body, m.tensor_addresses, m.device, 4, 128)
    futs = eng.submit_many(reqs)
    eng._admit()
    eng._decode()                                   # step t read, step t+1 left in flight
    assert eng._inflight is not None
    aborted = eng.control(lambda: eng.abort(reqs[0].rid))
    eng._run_controls()                             # as if queued after the loop's drain check
    assert aborted.result(timeout=10) == 1 and eng._inflight is None
    eng.start()
    try:
        outs = [f.result(timeout=120) for f in futs]
    finally:
        eng.stop()
    assert outs[0]["meta_info"]["finish_reason"]["type"] == "abort"
    for r, o in zip(reqs[1:], outs[1:]):
        _same(o, _alone(d, _req(PROMPT_A, seed=r.sampling.sampling_seed, max_new=12, ignore_eos=True)))
