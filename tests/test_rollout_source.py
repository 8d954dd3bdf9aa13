"""The off-policy rollout source under randomized timing, without servers or models.

A simulated rollout fleet generates tokens one at a time with random delays, tagging each with the
version its weights hold; ``pause_generation`` stops it mid-sample (abort: the sample's tokens so
far are kept and generation continues after ``continue_generation`` with the new version -- a
partial rollout). A simulated trainer takes batches with random training times and pushes a new
version after each. Whatever the timing:

* async, ``stale: drop``: no trained token is more than ``max_staleness`` versions behind, and every
  dropped group is counted;
* one_step_off: batch k >= 1 was generated entirely by version k - 1 (and batch 0 by version 0);
* ``stale: downweight``: nothing is dropped, and exactly the tokens past the bound get weights < 1;
* every prompt drawn is trained on, discarded (counted), or still pending -- never twice;
* a snapshot taken between steps restores the same pending prompts and loader position.
"""
from __future__ import annotations

import asyncio
import json
import random
import time
from pathlib import Path

import pytest
import torch

from megarl.algos.offpolicy import staleness_stats, staleness_weights
from megarl.data.loader import PromptLoader
from megarl.data.records import PromptRecord
from megarl.rollout.client import LoopThread
from megarl.rollout.ledger import PromptLedger
from megarl.rollout.sample import Sample
from megarl.rollout.source import GroupJob, OffPolicySource

P, N = 3, 2   # groups per batch, samples per group


class Fleet:
    """Simulated servers: one version, a pause flag (SGLang semantics: abort answers the requests in
    flight, which the client resubmits; they wait until continue)."""

    def __init__(self, rng: random.Random, max_tokens: int = 12, straggler_every: int = 0):
        self.version = 0
        self.rng = rng
        self.max_tokens = max_tokens
        self.straggler_every = straggler_every   # every so many groups, one 8x longer than the rest
        self.running = asyncio.Event()
        self.running.set()
        self.paused_with: list[str] = []
        self.loop: asyncio.AbstractEventLoop | None = None

    async def __call__(self, job: GroupJob) -> list[Sample]:
        self.loop = asyncio.get_running_loop()

        async def sample(k: int) -> Sample:
            length = self.rng.randint(1, self.max_tokens)
            if self.straggler_every and job.group.serial % self.straggler_every == 1:
                length *= 8
            versions: list[int] = []
            while len(versions) < length:
                await self.running.wait()
                await asyncio.sleep(self.rng.uniform(0, 0.004))
                if self.running.is_set():        # a token sampled under the current weights
                    versions.append(self.version)
            return Sample(job.record, 0, job.prompt_ids, list(range(length)), [-1.0] * length, "stop",
                          reward=float(self.rng.random()), versions=versions)
        return list(await asyncio.gather(*(sample(k) for k in range(N))))

    def call_servers(self, method: str, **kw) -> dict:
        assert self.loop is not None

        async def flip(on: bool) -> None:   # on the fleet's loop, between two tokens
            (self.running.set if on else self.running.clear)()
        if method == "pause_generation":
            self.paused_with.append(kw["mode"])
            asyncio.run_coroutine_threadsafe(flip(False), self.loop).result()
        elif method == "continue_generation":
            asyncio.run_coroutine_threadsafe(flip(True), self.loop).result()
        return {}


def make_source(mode: str, io: LoopThread, fleet: Fleet, max_staleness: int, stale: str = "drop",
                interrupt: str = "abort", records: int = 50, ledger: Path | None = None):
    recs = [PromptRecord(prompt=f"p{i}", index=i) for i in range(records)]
    loader = PromptLoader(recs, 1, seed=3)
    source = OffPolicySource(mode=mode, rollout=fleet, loader=loader, records={r.index: r for r in recs},
                             encode=lambda rec: [1, 2, 3], n=N, groups_per_batch=P, max_staleness=max_staleness,
                             interrupt=interrupt, stale=stale, group_seed=lambda step: step, call_servers=fleet.call_servers,
                             run=io.run, submit=io.submit, take_timeout_s=60, ledger=PromptLedger(ledger))
    return source, recs


def train(source: OffPolicySource, fleet: Fleet, steps: int, rng: random.Random, check) -> list[dict]:
    """The trainer's side: take, 'train' for a random time, push the next version."""
    out = []
    for step in range(steps):
        samples, metrics = source.next_batch(step)
        check(step, samples, metrics)
        out.append(metrics)
        time.sleep(rng.uniform(0, 0.03))
        with source.weight_update(step + 1):
            time.sleep(rng.uniform(0, 0.01))
            fleet.version = step + 1
    return out


def loader_stream(records: int, count: int) -> list[int]:
    loader = PromptLoader([PromptRecord(prompt=f"p{i}", index=i) for i in range(records)], 1, seed=3)
    return [loader.next_batch()[0].index for _ in range(count)]


def prompt_accounting(ledger: Path) -> tuple[list[int], list[int], list[int]]:
    """(trained on, discarded, pending at exit) prompt indices from a run's ledger."""
    lines = [json.loads(x) for x in ledger.read_text().splitlines()]
    trained = [i for e in lines if "step" in e for i in e["trained"]]
    discarded = [i for e in lines if "step" in e for i in e["discarded"]]
    pending = [i for e in lines if "pending_at_exit" in e for i in e["pending_at_exit"]]
    return trained, discarded, pending


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("max_staleness", [0, 1, 3])
def test_async_staleness_never_exceeds_the_bound(seed, max_staleness, tmp_path):
    rng = random.Random(seed)
    io = LoopThread()
    fleet = Fleet(rng, straggler_every=5)
    source, _ = make_source("async", io, fleet, max_staleness, ledger=tmp_path / "ledger.jsonl")
    trained, dropped = [], 0

    def check(step, samples, metrics):
        nonlocal dropped
        assert len(samples) == P * N and sorted({s.group for s in samples}) == list(range(P))
        for s in samples:
            assert step - min(s.versions) <= max_staleness, (step, s.versions)
            assert s.versions == sorted(s.versions)
        trained.extend(s.record.index for s in samples[::N])
        dropped += metrics["rollout/stale_groups_dropped"]
    try:
        metrics = train(source, fleet, 10, rng, check)
        assert sum(m["rollout/prompts_drawn"] - m["rollout/groups_kept"] for m in metrics) == dropped
        assert set(fleet.paused_with) == {"abort"}
    finally:
        source.close()
        io.close()
    ledger_trained, discarded, pending = prompt_accounting(tmp_path / "ledger.jsonl")
    assert ledger_trained == trained and len(trained) == 10 * P and len(discarded) == dropped
    seen = trained + discarded + pending
    assert len(seen) == len(set(seen)), "a prompt was trained on twice, or trained on and discarded"
    assert sorted(seen) == sorted(loader_stream(50, len(seen))), "every prompt drawn is accounted for"


def test_one_step_off_trains_every_batch_one_version_behind():
    rng = random.Random(7)
    io = LoopThread()
    fleet = Fleet(rng)
    source, _ = make_source("one_step_off", io, fleet, max_staleness=1)

    def check(step, samples, metrics):
        want = max(step - 1, 0)
        assert {v for s in samples for v in s.versions} == {want}, (step, [s.versions for s in samples])
        assert metrics["rollout/stale_groups_dropped"] == 0
    try:
        train(source, fleet, 8, rng, check)
        assert fleet.paused_with == [], "one_step_off never interrupts a generation"
    finally:
        source.close()
        io.close()


def test_downweight_keeps_stale_groups_and_weights_exactly_the_tokens_past_the_bound():
    rng = random.Random(11)
    io = LoopThread()
    fleet = Fleet(rng, max_tokens=20, straggler_every=4)
    source, _ = make_source("async", io, fleet, max_staleness=1, stale="downweight")
    past = 0

    def check(step, samples, metrics):
        nonlocal past
        assert metrics["rollout/stale_groups_dropped"] == 0
        width = max(len(s.versions) for s in samples)
        versions = torch.tensor([s.versions + [step] * (width - len(s.versions)) for s in samples])
        mask = torch.tensor([[1.0] * len(s.versions) + [0.0] * (width - len(s.versions)) for s in samples])
        w = staleness_weights(versions, mask, step, 1, 0.5)
        expect = torch.where(mask.bool(), 0.5 ** (step - versions - 1).clamp(min=0).float(), torch.zeros_like(w))
        assert torch.equal(w, expect)
        past += int(((w < 1) & mask.bool()).sum())
        stats = staleness_stats(versions, mask, step)
        assert stats["staleness_max"] == float((step - versions)[mask.bool()].max())
    try:
        train(source, fleet, 8, rng, check)
    finally:
        source.close()
        io.close()
    assert past > 0, "straggler groups overtaken by later ones end up past the bound"


def test_state_snapshot_restores_pending_prompts_and_loader_position():
    rng = random.Random(5)
    io = LoopThread()
    fleet = Fleet(rng)
    source, recs = make_source("async", io, fleet, max_staleness=2)
    try:
        train(source, fleet, 3, rng, lambda *a: None)
        deadline = time.time() + 120   # a hang guard: the loop ends as soon as the budget is full
        while source.buffer.pending < source.buffer.budget() and time.time() < deadline:
            time.sleep(0.01)   # the producer fills its budget: the next batch can only come from these
        state = source.state_dict()
    finally:
        source.close()
        io.close()
    saved = state["rollout_source"]
    pending = [g["record_index"] for g in saved["groups"]]
    assert saved["version"] == 3 and saved["taken_batches"] == 3 and pending
    assert [g["serial"] for g in saved["groups"]] == sorted(g["serial"] for g in saved["groups"])
    # a fresh source restored from it re-issues the in-flight prompts first, keeps finished groups
    io2 = LoopThread()
    fleet2 = Fleet(random.Random(6))
    fleet2.version = 3
    restored, _ = make_source("async", io2, fleet2, max_staleness=2)
    restored.load_state_dict(state)
    try:
        assert restored.loader.state_dict() == state["loader"]
        finished = {g["serial"] for g in saved["groups"] if g["samples"] is not None}
        assert set(restored.buffer.ready) == finished
        assert [g.serial for g in restored._reissue] == [g["serial"] for g in saved["groups"] if g["samples"] is None]
        assert len(pending) == restored.buffer.budget()
        first, _ = restored.next_batch(3)
        taken = [s.record.index for s in first[::N]]
        assert set(taken) <= set(pending), "the first batch after resume comes from the pending prompts"
    finally:
        restored.close()
        io2.close()


def test_a_batch_whose_push_failed_is_rewound_into_the_snapshot():
    """A step that fails before its push (a rollout server lost for good) rewinds its batch into the
    buffer: the checkpoint written then holds those groups with their tokens, so a resume trains on
    them instead of losing them; a batch whose push succeeded is never rewound."""
    rng = random.Random(9)
    io = LoopThread()
    fleet = Fleet(rng)
    source, _ = make_source("async", io, fleet, max_staleness=1)
    try:
        train(source, fleet, 2, rng, lambda *a: None)
        source.rewind_batch()                                # step 1's push succeeded: nothing to rewind
        assert source.buffer.taken_batches == 2
        samples, _ = source.next_batch(2)
        taken = {id(s) for s in samples}
        with pytest.raises(RuntimeError):
            with source.weight_update(3):
                raise RuntimeError("rollout server 0 is gone")
        source.rewind_batch()
        state = source.state_dict()
    finally:
        source.close()
        io.close()
    saved = state["rollout_source"]
    assert saved["taken_batches"] == 2 and saved["version"] == 2   # as if step 2 never ran
    back = [g for g in saved["groups"] if g["samples"] is not None]
    tokens = {tuple(s["response_ids"]) for g in back for s in g["samples"]}
    assert len(taken) == P * N and {tuple(s.response_ids) for s in samples} <= tokens
