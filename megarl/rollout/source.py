"""Rollout sources: where the trainer's batches come from (``rollout.mode``).

The loop asks its source for the next batch and tells it around every weight push::

    samples, metrics = source.next_batch(step)
    ...train...
    with source.weight_update(step + 1) as stats:
        push weights (one session on every server)

* ``sync`` (:class:`SyncSource`): the step's prompts are generated and scored after the previous
  push (``RolloutPipeline.collect``); every token comes from the weights being trained.
* ``one_step_off`` and ``async`` (:class:`OffPolicySource`): a producer on the rollout client's
  event loop keeps drawing prompts and generating their groups while the trainer trains; the
  trainer takes finished groups from a buffer (``megarl/rollout/buffer.py``: admission that bounds
  staleness, stale groups dropped or kept for down-weighting, exact state for resume). Each
  response token carries the weight version that sampled it.

  - ``one_step_off`` = at most one version behind, no interruption: the batch of step k+1 is
    generated with version k while step k trains, and the push of version k+1 waits until that
    generation is done.
  - ``async`` = at most ``rollout.max_staleness`` versions behind; at a push the requests in flight
    are paused through SGLang's ``/pause_generation`` (``rollout.interrupt``: ``abort`` -- answered
    with their tokens so far and continued by the client from them, ``megarl/rollout/partial.py``
    -- or ``retract`` -- kept by the server and continued under the new weights), or, with
    ``none``, the push waits for them.

Overlap needs the rollout servers on devices of their own or a shared one that both sides may use
(placement ``disaggregated``); colocated runs hand the GPUs back and forth and keep ``sync``.

A group rollout is pluggable (``GroupRollout``): :class:`SingleTurnRollout` generates the n samples
of one prompt and scores them; the agent loop (``megarl.rollout.agent``) is another.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import copy
import functools
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterator, Optional, Protocol

import torch

from megarl.algos.filters import group_has_signal
from megarl.algos.offpolicy import offpolicy_step
from megarl.data import PromptLoader
from megarl.rewards.failures import Failure
from megarl.rollout.buffer import Group, GroupBuffer, SourceClosed
from megarl.rollout.failures import valid_rewards
from megarl.rollout.ledger import PromptLedger
from megarl.rollout.manager import sample_seed
from megarl.rollout.partial import generate_resumable
from megarl.rollout.routed_experts import joined_routes, routes_from_state, routes_state
from megarl.rollout.sample import Sample

MODES = ("sync", "one_step_off", "async")
INTERRUPTS = ("abort", "retract", "none")


class RolloutSource(Protocol):
    mode: str
    off_policy: bool

    def next_batch(self, step: int) -> tuple[list[Sample], dict[str, float]]: ...

    def weight_update(self, version: int) -> contextlib.AbstractContextManager[dict[str, float]]: ...

    def rewind_batch(self) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


# ---------------------------------------------------------------------------------------------
# sync
# ---------------------------------------------------------------------------------------------

class SyncSource:
    """The pipeline's ``collect(loader, step)`` after each push: on-policy batches."""

    mode, off_policy = "sync", False

    def __init__(self, pipeline: Any, loader: Any, ledger: Optional[PromptLedger] = None):
        self.pipeline, self.loader = pipeline, loader
        self.ledger = ledger or PromptLedger(None)
        self._loader_before: Optional[dict] = None

    def next_batch(self, step: int) -> tuple[list[Sample], dict[str, float]]:
        self._loader_before = copy.deepcopy(self.loader.state_dict())
        before = self.pipeline.manager.retried
        drawing = _DrawnRecords(self.loader)
        samples, metrics = self.pipeline.collect(drawing, step)
        metrics["rollout/retried_requests"] = self.pipeline.manager.retried - before  # after a failure or timeout
        trained = list(dict.fromkeys(s.record.index for s in samples))
        kept = set(trained)
        self.ledger.record_step(step, trained, [i for i in drawing.indices if i not in kept], self.loader.epoch)
        return samples, metrics

    @contextlib.contextmanager
    def weight_update(self, version: int) -> Iterator[dict[str, float]]:
        yield {}   # nothing is generating during a push

    def rewind_batch(self) -> None:
        """The step failed before its push: the loader back where the step started (a
        checkpoint then resumes by redoing the step)."""
        if self._loader_before is not None:
            self.loader.load_state_dict(self._loader_before)
            self._loader_before = None

    def state_dict(self) -> dict[str, Any]:
        return {"loader": self.loader.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state["loader"])

    def close(self) -> None:
        pass


class _DrawnRecords:
    """The loader as ``collect`` sees it, noting every record it hands out (for the ledger)."""

    def __init__(self, loader: Any):
        self.loader = loader
        self.indices: list[int] = []

    def next_batch(self) -> list[Any]:
        records = self.loader.next_batch()
        self.indices += [r.index for r in records]
        return records


# ---------------------------------------------------------------------------------------------
# group rollouts
# ---------------------------------------------------------------------------------------------

@dataclass
class GroupJob:
    group: Group
    record: Any
    prompt_ids: list[int]
    seeds: list[int]                 # one sampling seed per sample
    job_index: int                   # first request's index (server round-robin)


class GroupRollout(Protocol):
    async def __call__(self, job: GroupJob) -> list[Sample]: ...


class SingleTurnRollout:
    """The n samples of one prompt, each a resumable request (partial rollouts), then scored in a
    thread (reward functions may block)."""

    def __init__(self, manager: Any, sampling: dict[str, Any], decode: Callable[[list[int]], str],
                 score: Callable[[list[Sample]], None], routes: Optional[tuple[int, int]] = None,
                 routes_required: bool = False):
        self.manager, self.sampling, self.decode, self.score = manager, sampling, decode, score
        self.routes, self.routes_required = routes, routes_required   # MoE (layers, top_k): R3
        self.resumed = 0                                     # answers continued after an abort (whole run)
        self._scorer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="megarl-score")

    async def __call__(self, job: GroupJob) -> list[Sample]:
        async def one(k: int, seed: int) -> Sample:
            send = functools.partial(self.manager.generate_one, job_index=job.job_index + k,
                                     batch_key=("group", job.job_index))   # a group's samples: one request
            t = await generate_resumable(send, job.prompt_ids, self.sampling, seed,
                                         0 if self.routes is not None else None)
            self.resumed += t.resumed
            seq_len = len(job.prompt_ids) + len(t.output_ids)
            routes = (joined_routes(t.routes, seq_len - 1, seq_len, self.routes, self.routes_required)
                      if self.routes is not None else None)
            return Sample(job.record, 0, job.prompt_ids, t.output_ids, t.logprobs, t.finish_reason,
                          text=self.decode(t.output_ids), versions=t.versions, routed_experts=routes)
        samples = list(await asyncio.gather(*(one(k, s) for k, s in enumerate(job.seeds))))
        await asyncio.get_running_loop().run_in_executor(self._scorer, self.score, samples)
        return samples

    def close(self) -> None:
        self._scorer.shutdown(wait=True, cancel_futures=True)


# ---------------------------------------------------------------------------------------------
# one_step_off / async
# ---------------------------------------------------------------------------------------------

class OffPolicySource:
    """A producer that keeps the servers busy; the trainer takes batches from a bounded buffer.

    Runs its producer as a task on ``loop`` (the rollout client's event loop thread); the
    trainer's calls (``next_batch``, ``weight_update``, ``state_dict``) come from the main thread.
    """

    off_policy = True

    def __init__(self, *, mode: str, rollout: GroupRollout, loader: Any, records: dict[int, Any],
                 encode: Callable[[Any], Optional[list[int]]], n: int, groups_per_batch: int,
                 max_staleness: int, interrupt: str, stale: str, group_seed: Callable[[int], int],
                 call_servers: Callable[..., Any], run: Callable[[Awaitable[Any]], Any],
                 submit: Callable[[Awaitable[Any]], concurrent.futures.Future],
                 dynamic_sampling_rounds: Optional[int] = None, ledger: Optional[PromptLedger] = None,
                 take_timeout_s: Optional[float] = None, stale_weight: float = 0.0):
        if mode not in ("one_step_off", "async"):
            raise ValueError(f"rollout.mode {mode!r} is not an off-policy mode")
        if interrupt not in INTERRUPTS:
            raise ValueError(f"rollout.interrupt must be one of {INTERRUPTS}, got {interrupt!r}")
        self.mode = mode
        self.rollout, self.loader, self.records, self.encode = rollout, loader, records, encode
        self.n, self.P = n, groups_per_batch
        self.interrupt = "none" if mode == "one_step_off" else interrupt
        self.max_staleness = 1 if mode == "one_step_off" else max_staleness
        self.buffer = GroupBuffer(groups_per_batch, self.max_staleness, stale)
        self.downweight = stale_weight if stale == "downweight" else None   # factor of tokens past the bound
        self.group_seed = group_seed
        self.call_servers, self.run, self.submit = call_servers, run, submit
        self.ds_give_up = dynamic_sampling_rounds * groups_per_batch if dynamic_sampling_rounds else None
        self.ledger = ledger or PromptLedger(None)
        self.take_timeout_s = take_timeout_s
        self._reissue: list[Group] = []
        self._producer: Optional[concurrent.futures.Future] = None
        self._wake: Optional[asyncio.Event] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._tasks: set[asyncio.Task] = set()
        self._resumed_seen = 0
        self._retried_seen = 0
        self._uncommitted: Optional[list[Group]] = None   # the batch taken, until its push succeeds

    # ------------------------------------------------------------------ producer (event loop thread)
    def start(self) -> None:
        if self._producer is None:
            self._producer = self.submit(self._produce())

    async def _produce(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        try:
            while True:
                job = self._next_job()
                if job is None:
                    if self.buffer.closed:
                        return
                    self._wake.clear()
                    job = self._next_job()   # a wake-up between the check and clear() is not lost
                    if job is None:
                        await self._wake.wait()
                        continue
                task = asyncio.ensure_future(self._run_group(job))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 - surfaced to the trainer by next_batch
            with self.buffer.cond:
                self.buffer.fail(e)

    def _next_job(self) -> Optional[GroupJob]:
        """Draw (or re-issue) one group if admission allows; under the buffer's lock, so a state
        snapshot sees the loader and the pending groups at one instant."""
        b = self.buffer
        with b.cond:
            while b.can_start():
                if self._reissue:
                    old = self._reissue.pop(0)
                    record = self.records[old.record_index]
                    ids = self.encode(record)
                    group = b.start(old.record_index, serial=old.serial)
                else:
                    record = self.loader.next_batch()[0]
                    ids = self.encode(record)
                    if ids is None:               # too long: dropped (counted), draw the next one
                        b.discard_unstarted(record.index)
                        continue
                    group = b.start(record.index)
                serial = group.serial
                base = self.group_seed(serial // self.P)
                first = (serial % self.P) * self.n
                return GroupJob(group, record, ids, [sample_seed(base, first + k) for k in range(self.n)], first)
            return None

    async def _run_group(self, job: GroupJob) -> None:
        try:
            samples = await self.rollout(job)
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 - surfaced to the trainer by next_batch
            with self.buffer.cond:
                self.buffer.fail(e)
            return
        keep = self.ds_give_up is None or group_has_signal(valid_rewards(samples))
        with self.buffer.cond:
            self.buffer.finish(job.group, samples if keep else None, filtered=not keep)
        self._poke_async()

    def _poke_async(self) -> None:
        if self._wake is not None:
            self._wake.set()

    def _poke(self) -> None:
        """Wake the producer from another thread."""
        if self._loop is not None and self._wake is not None:
            self._loop.call_soon_threadsafe(self._wake.set)

    # ------------------------------------------------------------------ trainer side (main thread)
    def next_batch(self, step: int) -> tuple[list[Sample], dict[str, float]]:
        self.start()
        retried = self.rollout.manager.retried if hasattr(self.rollout, "manager") else 0
        try:
            got = self.buffer.take(step, self.ds_give_up, self.take_timeout_s)
        finally:
            self._poke()
        self._uncommitted = got.groups
        samples: list[Sample] = []
        for g, group in enumerate(got.groups):
            for s in group.samples:
                s.group = g
                samples.append(s)
        resumed = getattr(self.rollout, "resumed", 0)
        with self.buffer.cond:
            inflight, ready = len(self.buffer.inflight), len(self.buffer.ready)
        drawn = len(got.groups) + len(got.discarded)
        metrics = {"rollout/rounds": max(1, -(-drawn // self.P)), "rollout/prompts_drawn": drawn,
                   "rollout/groups_kept": len(got.groups),
                   "rollout/retried_requests": retried - self._retried_seen,
                   "rollout/groups_filtered": got.filtered,
                   "rollout/stale_groups_dropped": len(got.stale_dropped),
                   "rollout/resumed_requests": resumed - self._resumed_seen,
                   "rollout/buffer_ready_groups": ready, "rollout/inflight_groups": inflight}
        self._retried_seen, self._resumed_seen = retried, resumed
        self.ledger.record_step(step, [g.record_index for g in got.groups], got.discarded, self.loader.epoch)
        return samples, metrics

    @contextlib.contextmanager
    def weight_update(self, version: int) -> Iterator[dict[str, float]]:
        """Around one push: no new group starts; requests in flight are paused (abort/retract) or
        waited for (none); the servers continue after it, under version ``version``."""
        b = self.buffer
        with b.cond:
            b.updating = True
        stats: dict[str, float] = {}
        paused = False
        ok = False
        try:
            t = time.time()
            if self.interrupt == "none":
                b.wait_drained()
                stats["time/rollout_drain_s"] = time.time() - t
            else:
                self.call_servers("pause_generation", mode=self.interrupt)
                paused = True
                stats["time/rollout_pause_s"] = time.time() - t
            yield stats
            ok = True
        finally:
            try:
                if paused:
                    self.call_servers("continue_generation")
            finally:
                with b.cond:
                    if ok:
                        b.version = version
                        self._uncommitted = None
                    b.updating = False
                    b.cond.notify_all()
                self._poke()

    def staleness(self, samples: list[Sample], batch: Any, mask: Any, step: int) -> tuple[dict[str, float], Any]:
        """A batch the trainer at version ``step`` took: staleness metrics and, with
        ``stale_samples: downweight``, per-token advantage weights ``[B, T]`` (else None). Needs
        the trainer's ``old_logprobs`` in the batch."""
        versions = batch.padded(torch.tensor([v for s in samples for v in s.versions], dtype=torch.int64))
        lp = batch.token_fields
        # algorithm.old_logprobs 'rollout': the old logprobs are the rollout's own tensor, nothing to compare
        trainer = None if lp["old_logprobs"] is lp["rollout_logprobs"] else batch.padded(lp["old_logprobs"])
        return offpolicy_step(versions, mask, step, trainer, batch.padded(lp["rollout_logprobs"]),
                              self.max_staleness, self.downweight)

    def rewind_batch(self) -> None:
        """The step failed before its push: the batch it took goes back to the buffer (finished,
        with its tokens), so a checkpoint written now holds it and a resume trains on it."""
        with self.buffer.cond:
            if self._uncommitted:
                for group in self._uncommitted:
                    self.buffer.ready[group.serial] = group
                self.buffer.taken_batches -= 1
            self._uncommitted = None

    def state_dict(self) -> dict[str, Any]:
        """The loader position and every pending group (finished ones with their samples, the
        rest as prompts to re-issue), read at one instant under the buffer's lock."""
        with self.buffer.cond:
            state = self.buffer.state_dict(_encode_sample)
            state["groups"] += [{"serial": g.serial, "record_index": g.record_index,
                                 "start_version": g.start_version, "samples": None} for g in self._reissue]
            state["groups"].sort(key=lambda x: x["serial"])
            loader = self.loader.state_dict()
        return {"loader": loader, "rollout_source": {"mode": self.mode, **state}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state["loader"])
        saved = state.get("rollout_source")
        if saved is None:   # a checkpoint of a sync run: start the producer from its loader position
            return
        records = self.records

        def decode(d: dict, record_index: int) -> Sample:
            return Sample(records[record_index], 0, d["prompt_ids"], d["response_ids"], d["rollout_logprobs"],
                          d["finish_reason"], d["reward"], d["text"], d["versions"],
                          loss_mask=d.get("loss_mask", []), info=d.get("info", {}),
                          routed_experts=routes_from_state(d.get("routed_experts")),
                          failure=Failure(**d["failure"]) if d.get("failure") else None)
        self._reissue = self.buffer.load_state_dict(saved, decode)

    def set_version(self, version: int, taken_batches: int) -> None:
        """Where a fresh (not resumed) run starts: the servers hold ``version``."""
        with self.buffer.cond:
            self.buffer.version, self.buffer.taken_batches = version, taken_batches

    def close(self) -> None:
        with self.buffer.cond:
            pending = [g.record_index for g in sorted(list(self.buffer.inflight.values()) + list(self.buffer.ready.values())
                                                      + self._reissue, key=lambda g: g.serial)]
            self.buffer.closed = True
            self.buffer.cond.notify_all()
        if self._producer is not None:
            async def stop() -> None:
                for t in list(self._tasks):
                    t.cancel()
                await asyncio.gather(*self._tasks, return_exceptions=True)
                if self._wake is not None:
                    self._wake.set()
            try:
                self.run(stop())
                self._producer.result(timeout=30)
            except Exception:  # noqa: BLE001 - teardown: the producer's error was reported by next_batch
                pass
            try:   # the server keeps generating for a closed connection; a server stop would wait on it
                self.call_servers("abort_request", abort_all=True)
            except Exception:  # noqa: BLE001 - teardown: a dead server has nothing left to abort
                pass
        if hasattr(self.rollout, "close"):
            self.rollout.close()
        self.ledger.record_exit(pending)   # drawn, not trained: in the checkpoint, trained first on resume


def _encode_sample(s: Sample) -> dict[str, Any]:
    return {"prompt_ids": list(s.prompt_ids), "response_ids": list(s.response_ids),
            "rollout_logprobs": list(s.rollout_logprobs), "finish_reason": s.finish_reason, "reward": s.reward,
            "text": s.text, "versions": list(s.versions), "loss_mask": list(s.loss_mask), "info": dict(s.info),
            "routed_experts": routes_state(s.routed_experts),
            "failure": asdict(s.failure) if s.failure is not None else None}


def make_source(cfg: Any, pipeline: Any, records: list[Any], loader: Any, ledger: Optional[Path] = None) -> Any:
    """The run's source (``rollout.mode``): sync over ``loader``, or an off-policy producer that
    draws one prompt at a time from its own loader over ``records`` with the pipeline's group
    rollout (single-turn or agent). ``ledger``: the prompt ledger's file (``megarl/rollout/ledger.py``)."""
    r = cfg.rollout
    if r.mode == "sync":
        return SyncSource(pipeline, loader, PromptLedger(ledger))
    ds = cfg.algorithm.dynamic_sampling
    manager = pipeline.manager
    return OffPolicySource(
        mode=r.mode, rollout=pipeline.group_rollout(), loader=PromptLoader(records, 1, cfg.seed, cfg.data.shuffle),
        records={rec.index: rec for rec in records}, encode=pipeline.prompt_ids, n=r.n_per_prompt,
        groups_per_batch=cfg.batch.prompts_per_step, max_staleness=r.max_staleness, interrupt=r.interrupt,
        stale=r.stale_samples, group_seed=lambda step: pipeline.seed_base(step, 0), call_servers=manager.call_all,
        run=manager.io.run, submit=manager.io.submit,
        dynamic_sampling_rounds=ds.max_rounds if ds.enabled else None, ledger=PromptLedger(ledger),
        stale_weight=r.stale_weight)


__all__ = ["make_source", "MODES", "INTERRUPTS", "RolloutSource", "SyncSource", "OffPolicySource", "SingleTurnRollout", "GroupJob",
           "GroupRollout", "SourceClosed"]
