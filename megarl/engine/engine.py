"""Continuous-batching engine: one scheduler thread owns the model and the KV cache.

Loop (one iteration = one "step"):
  1. run queued control ops (weight updates, memory release/resume, flush) -- between steps,
     never in the middle of a forward;
  2. admit waiting requests into free KV rows (up to `max_running`, `max_prefill_tokens` of
     prefill per step): requests with the same prompt -- the n samples of a group -- are
     prefilled once and the prompt's KV is copied to the others' rows (prefix sharing); a prompt
     already held by a running row is copied from it and only its last token recomputed;
  3. one decode step over every running row, sampled in one batched op (`sampler.py`), one
     device->host transfer of the step's tokens and logprobs; with CUDA graphs the step and its
     sampling are one graph, and step t+1 is queued before step t is read (`_decode`);
  4. finished requests resolve; the last running rows move into their gaps, so the next step
     decodes rows [0, B) of the cache (`batch.py`): cost follows the rows still running.

Logprobs are computed from the same fp32 logits the token is sampled from:
`log_softmax(logits / temperature)` (raw logits when temperature == 0), before top-k/top-p/min-p
filtering -- the same convention as sglang's default `output_token_logprobs`.

Prefix sharing reuses KV only within one weight epoch: every control op (a weight update among
them; read-only ones excepted) starts a new epoch, and a prompt's KV computed before it is never
copied after it.
"""
from __future__ import annotations

import collections
import concurrent.futures
import logging
import queue
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from .batch import RunningBatch
from .model import DecoderModel
from .request import Request, Sampling, derive_seed  # noqa: F401  (re-exported: the engine's API)
from .sampler import RowParams, sample_rows, seeded_gumbel  # noqa: F401

if TYPE_CHECKING:
    from .worker import ModelHandle

log = logging.getLogger("megarl.rollout.engine")

STALE_WEIGHTS = ("the weights were released without --enable-weights-cpu-backup and not all pushed since: "
                 "update the weights before generating")


def _context(r: Request) -> List[int]:
    """What a prefill runs for ``r``: its prompt, or for a retracted request its prompt and all it
    generated (its pending token too: the next token is sampled from that position)."""
    return r.input_ids + r.output_ids if r.retracted else r.input_ids


def _pack(tokens: torch.Tensor, lps: torch.Tensor) -> torch.Tensor:
    """A step's tokens (exact in float64) and logprobs as one ``[2, B]`` tensor: one transfer."""
    return torch.stack((tokens.to(torch.float64), lps.to(torch.float64)))


def _unpack(both: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    return both[0].astype(np.int64), both[1].astype(np.float32)


def _to_host(tokens: torch.Tensor, lps: torch.Tensor) -> Tuple[np.ndarray, np.ndarray]:
    """The step's one device->host transfer: tokens and logprobs together."""
    return _unpack(_pack(tokens, lps).cpu().numpy())


def sample(logits: torch.Tensor, reqs: List[Request], default_gen: torch.Generator):
    """logits fp32 [B, V] -> (tokens, logprobs) as lists, one row per request with its own params
    (the per-request form of `sampler.sample_rows`). Requests without ``sampling_seed`` get one
    from ``default_gen``, as on admission to the engine."""
    for r in reqs:
        if not r.sampling.greedy and r.sampling.sampling_seed is None:
            r.sampling.sampling_seed = int(torch.randint(0, 2**31 - 1, (1,), generator=default_gen))
    batch = RunningBatch(len(reqs), 1 << 30, (), logits.device)
    batch.add(reqs)
    steps = torch.tensor([len(r.output_ids) for r in reqs], dtype=torch.int64, device=logits.device)
    rp = batch.params(0, len(reqs))
    rp.steps = steps
    tokens, lps = sample_rows(logits, rp, batch.any_stochastic(0, len(reqs)), batch.filter_rows(0, len(reqs)))
    return tokens.tolist(), lps.tolist()


class EngineStopped(RuntimeError):
    """The server is exiting: the engine takes no more requests or control calls."""


class Engine:
    """The scheduler loop. `model` is a `DecoderModel` (tests) or, in the server, a
    `worker.ModelHandle` whose every call runs on all TP ranks.

    ``prefix_sharing`` False prefills every request on its own (SGLang's ``--disable-radix-cache``)."""

    def __init__(self, model: Union[DecoderModel, "ModelHandle"], max_running: int = 32, max_len: int = 2048,
                 max_prefill_tokens: int = 8192, seed: int = 0, prefix_sharing: bool = True):
        self.model = model
        self.max_running = max_running
        self.max_len = max_len
        self.max_prefill_tokens = max_prefill_tokens
        self.prefix_sharing = prefix_sharing
        self.waiting: "queue.Queue[List[Request]]" = queue.Queue()
        self.controls: "queue.Queue[tuple]" = queue.Queue()
        self.batch = RunningBatch(max_running, max_len, model.spec.eos_token_ids, model.device)
        self.weight_version = "default"
        self.gen = torch.Generator().manual_seed(seed)
        self.epoch = 0
        # counts, and the engine thread's wall seconds admitting (prefill + first token) and
        # decoding: what a rollout phase spent inside the engine, against its own wall time
        self.stats = {"steps": 0, "decode_tokens": 0, "prefill_tokens": 0, "shared_prefill_tokens": 0,
                      "max_batch": 0, "admissions": 0, "admit_s": 0.0, "decode_s": 0.0}
        self.released: set = set()
        self.paused: Optional[str] = None   # SGLang pause mode (retract | in_place) while paused
        self.loras: set = set()            # LoRA adapters new requests may name (loaded, not unloaded)
        self._unloading: set = set()       # unloaded while requests still ran them: dropped once they finish
        self._stop = threading.Event()
        self._closing = threading.Lock()   # nothing is queued once stop() has begun
        self._wake = threading.Event()
        self._backlog: "collections.deque[Request]" = collections.deque()
        self._inflight = None     # a decode step launched ahead, not read yet (`_decode`)
        self._thread: Optional[threading.Thread] = None
        model.alloc_cache(max_running, max_len)

    # ------------------------------------------------------------ public (any thread)
    def start(self):
        self._thread = threading.Thread(target=self._loop, name="megarl-engine", daemon=True)
        self._thread.start()

    def stop(self):
        """End the engine thread, then finish everything it held: running and queued requests as
        aborted (finish reason ``abort``, with the tokens they have, as SGLang's abort answers),
        pending control calls with an error. A server told to exit (SIGTERM; the trainer's death
        through PR_SET_PDEATHSIG) otherwise kept its HTTP handlers waiting on futures no thread
        would resolve, and its web runner waited out its shutdown timeout before exiting."""
        with self._closing:
            self._stop.set()
        self._wake.set()
        if self._thread:
            self._thread.join(timeout=10)
        if self._thread is None or not self._thread.is_alive():   # else it is stuck in a step: leave its state be
            try:
                if self._inflight is not None:
                    self._drain()            # the step launched ahead: its tokens belong to the answers
                self.abort(abort_all=True, message="server shutting down")
            except Exception:   # noqa: BLE001 - e.g. TP ranks gone: the rest of the shutdown must still run
                log.exception("answering the requests held at shutdown failed")
        while True:
            try:
                _, fut, _ = self.controls.get_nowait()
            except queue.Empty:
                break
            if fut.set_running_or_notify_cancel():
                fut.set_exception(EngineStopped("server shutting down"))

    def submit(self, req: Request) -> concurrent.futures.Future:
        return self.submit_many([req])[0]

    def submit_many(self, reqs: Sequence[Request]) -> List[concurrent.futures.Future]:
        """Queue requests together: they are admitted in one step when rows and the prefill
        budget allow (so a group's samples share one prefill)."""
        for req in reqs:
            n = len(req.input_ids)
            if req.lora is not None and req.lora not in self.loras:
                raise ValueError(f"lora_path: LoRA adapter {req.lora!r} is not loaded (loaded: {sorted(self.loras)})")
            if n == 0:
                raise ValueError("empty input_ids")
            if n >= self.max_len:
                raise ValueError(f"prompt of {n} tokens does not fit max_len {self.max_len}")
        if "kv_cache" in self.released or "weights" in self.released:
            raise RuntimeError(f"memory released ({sorted(self.released)}); call /resume_memory_occupation")
        if self.model.weights_stale():
            raise RuntimeError(STALE_WEIGHTS)
        with self._closing:
            if self._stop.is_set():
                raise EngineStopped("server shutting down")
            self.waiting.put(list(reqs))
        self._wake.set()
        return [r.done for r in reqs]

    def control(self, fn: Callable[[], Any], new_epoch: bool = True) -> concurrent.futures.Future:
        """Run fn on the engine thread between steps; returns a future of its result. ``new_epoch``
        False: fn only reads (``requests``), so prefixes computed before it stay shareable."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._closing:
            if self._stop.is_set():
                fut.set_exception(EngineStopped("server shutting down"))
                return fut
            self.controls.put((fn, fut, new_epoch))
        self._wake.set()
        return fut

    @property
    def running(self) -> List[Request]:
        return self.batch.live()

    def num_active(self) -> int:
        with self.waiting.mutex:
            queued = sum(len(x) for x in self.waiting.queue)
        return self.batch.size + queued + len(self._backlog)

    # ------------------------------------------------------------ SGLang's pause / abort (engine thread)
    # Called through `control(...)`, i.e. between steps, like SGLang's scheduler handles them.
    def set_weight_version(self, version: str) -> None:
        """New weights are in place: every live request records how many tokens it had under the
        old version (SGLang's ``record_weight_version_events``), so its answer says which tokens
        which version produced."""
        if version == self.weight_version:
            return
        self._drain_waiting()
        b = self.batch
        held = [(r, int(b.n[i])) for i, r in enumerate(b.reqs[:b.size]) if r is not None]
        held += [(r, len(r.output_ids)) for r in self._backlog]
        for r, n in held:
            if n:
                r.version_events.append((self.weight_version, n))
        self.weight_version = version

    def abort(self, rid: str = "", abort_all: bool = False, message: str = "Aborted") -> int:
        """Finish the matching requests now with the tokens they have (SGLang's ``AbortReq``: an
        empty rid without ``abort_all`` matches nothing; a rid matches by prefix, as SGLang's
        scheduler does, so the sub-requests of a batch go with it). Returns how many."""
        if not abort_all and not rid:
            return 0
        self._drain_waiting()
        hit = lambda r: abort_all or r.rid.startswith(rid)  # noqa: E731
        reason = {"type": "abort", "message": message, "status_code": None, "err_type": None}
        b = self.batch
        rows = [i for i, r in enumerate(b.reqs[:b.size]) if r is not None and hit(r)]
        queued = [r for r in self._backlog if hit(r)]
        self._backlog = collections.deque(r for r in self._backlog if not hit(r))
        for i in rows:
            r = b.take(i)              # its cache row stays intact until compact() below
            if r.return_routed_experts and r.output_ids:
                self._collect_routes(r, i)   # SGLang finishes a running abort through its decode path, routes included
            self._resolve(r, reason)
        for r in queued:
            self._resolve(r, reason)
        if rows:
            src, dst, length = b.compact(rows)
            if src:
                self.model.copy_rows(src, dst, length)
        self._drop_unused_loras()
        return len(rows) + len(queued)

    def requests(self) -> Dict[str, Any]:
        """The requests the engine holds: ``running`` (rid -> output tokens so far; a running request
        has been prefilled and has at least its first token) and ``queued`` (rids waiting for a row,
        or retracted). Read on the engine thread (``control(engine.requests, new_epoch=False)``);
        tests wait on it for a request to be generating instead of sleeping."""
        self._drain_waiting()
        b = self.batch
        running = {r.rid: int(b.n[i]) for i, r in enumerate(b.reqs[:b.size]) if r is not None}
        return {"running": running, "queued": [r.rid for r in self._backlog]}

    def unload_lora(self, name: str) -> bool:
        """Engine thread: new requests may no longer name ``name``; its weights go now, or when the
        last running or queued request that uses it finishes (so no request loses its adapter
        mid-generation). Returns whether it was loaded."""
        if name not in self.loras:
            return False
        self.loras.discard(name)
        self._unloading.add(name)
        self._drop_unused_loras()
        return True

    def _drop_unused_loras(self) -> None:
        if not self._unloading:
            return
        self._drain_waiting()
        b = self.batch
        used = {r.lora for r in b.reqs[:b.size] if r is not None} | {r.lora for r in self._backlog}
        for name in self._unloading - used:
            self.model.unload_lora(name)
        self._unloading &= used

    def has_request(self, rid: str) -> bool:
        """Is a request with exactly this rid running or queued?"""
        self._drain_waiting()
        return bool(rid) and any(r.rid == rid for r in self.running + list(self._backlog))

    def pause(self, mode: str) -> int:
        """Stop scheduling. ``retract``: running requests go back to the front of the queue with
        their KV freed (re-prefilled from prompt + output when continued, under whatever weights
        are current then); ``in_place``: they stay as they are. Returns the running count."""
        if mode not in ("retract", "in_place"):
            raise ValueError(f"engine pause mode must be retract or in_place, got {mode!r}")
        self.paused = mode
        b = self.batch
        held = b.size
        if mode == "retract":
            back = [b.take(i) for i in range(b.size) if b.reqs[i] is not None]
            b.clear()
            for r in back:
                r.retracted = True
            self._backlog.extendleft(reversed(back))
        return held

    def unpause(self) -> None:
        self.paused = None
        self._wake.set()

    def idle(self, ignore_waiting: bool = False) -> bool:
        """SGLang's ``is_fully_idle``: nothing running (and, unless ignored, nothing queued)."""
        return not self.batch.size and (ignore_waiting or (not self._backlog and self.waiting.empty()))

    def _drain_waiting(self) -> None:
        while True:
            try:
                self._backlog.extend(self.waiting.get_nowait())
            except queue.Empty:
                return

    # ------------------------------------------------------------ engine thread
    def _loop(self):
        while not self._stop.is_set():
            try:
                if self._inflight is not None and self._must_drain():
                    self._drain()
                self._run_controls()
                if self.paused:
                    self._wake.wait(timeout=0.05)
                    self._wake.clear()
                    continue
                t = time.perf_counter()
                admitted = self._admit()
                self.stats["admit_s"] += time.perf_counter() - t
                if not self.batch.size:
                    if admitted:   # all finished at their prefill (one new token): admit the next now
                        continue
                    self._wake.wait(timeout=0.05)
                    self._wake.clear()
                    continue
                t = time.perf_counter()
                self._decode()
                self.stats["decode_s"] += time.perf_counter() - t
            except Exception as e:  # never die silently: fail the running requests
                log.exception("engine step failed")
                self._inflight = None
                for r in self.batch.clear():
                    self._resolve(r, {"type": "abort", "message": f"engine error: {e}"}, error=e)

    def _run_controls(self):
        while True:
            try:
                fn, fut, new_epoch = self.controls.get_nowait()
            except queue.Empty:
                return
            if self._inflight is not None:
                self._drain()     # queued after the loop's check: settle the step in flight first
            if new_epoch:
                self.epoch += 1   # weights may change: no prefix computed before is shared after
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as e:
                fut.set_exception(e)

    def _admit(self) -> int:
        """Prefill as many backlog requests as free rows and the prefill budget allow; returns how
        many were admitted (the loop goes on at once after an admission that left no row running)."""
        self._drain_waiting()
        b = self.batch
        free = b.cap - b.size
        if not self._backlog or not free or self.released:
            return 0     # (released: requests held by a pause wait for /resume_memory_occupation)
        if self.model.weights_stale():   # retracted requests held across a release that dropped the
            self._fail_backlog(RuntimeError(STALE_WEIGHTS))   # weights, resumed without a push
            return 0
        held: Optional[Dict[tuple, int]] = None   # prompt -> running row holding its KV (this epoch)
        take: List[Request] = []
        reps: Dict[Any, int] = {}       # prompt key -> index into `firsts`
        firsts: List[Request] = []      # one request per distinct prompt: its row is prefilled
        src: List[int] = []             # per first: the running row to copy from (-1: none)
        budget = self.max_prefill_tokens
        while self._backlog and len(take) < free:
            r = self._backlog[0]
            if r.done.cancelled():
                self._backlog.popleft()
                continue
            key = self._share_key(r)
            if key not in reps:
                if held is None:
                    held = {q.key: i for i, q in enumerate(b.reqs[:b.size])
                            if q is not None and q.kv_epoch == self.epoch} if self.prefix_sharing else {}
                row = held.get(key, -1)
                cost = 1 if row >= 0 else len(_context(r))
                if take and cost > budget:
                    break
                budget -= cost
                reps[key] = len(firsts)
                firsts.append(r)
                src.append(row)
            take.append(self._backlog.popleft())
        if not take:
            return 0
        for r in take:   # seeds in arrival order, as the per-request sampler drew them
            if not r.sampling.greedy and r.sampling.sampling_seed is None:
                r.sampling.sampling_seed = int(torch.randint(0, 2**31 - 1, (1,), generator=self.gen))
            r.kv_epoch = self.epoch
        first_ids = {id(r) for r in firsts}
        siblings = [r for r in take if id(r) not in first_ids]
        a, _ = b.add(firsts + siblings)
        # a prompt a running row holds: copy all but its last token, recompute that one
        hits = [(u, row) for u, row in enumerate(src) if row >= 0]
        if hits:
            self.model.copy_rows([row for _, row in hits], [a + u for u, _ in hits],
                                 max(len(firsts[u].input_ids) - 1 for u, _ in hits))
        starts = [len(r.input_ids) - 1 if row >= 0 else 0 for r, row in zip(firsts, src)]
        seqs = [_context(r)[s:] for r, s in zip(firsts, starts)]
        loras = [r.lora for r in firsts] if any(r.lora for r in firsts) else None
        logits = self.model.prefill(seqs, a, starts if hits else None, loras)
        for r, s in zip(firsts, starts):
            r.cached_tokens = s
            r.retracted = False     # its KV is back (prompt and output so far, current weights)
        # the group's other samples: copy the prompt's rows, sample from the same logits
        U = len(firsts)
        which = [reps[self._share_key(r)] for r in siblings]
        if siblings:
            self.model.copy_rows([a + u for u in which], list(range(a + U, a + U + len(siblings))),
                                 max(len(r.input_ids) for r in siblings))
            for r in siblings:
                r.cached_tokens = len(r.input_ids)
            logits = logits[torch.tensor(list(range(U)) + which, device=logits.device)]
        self.stats["admissions"] += 1
        self.stats["prefill_tokens"] += sum(len(q) for q in seqs)
        self.stats["shared_prefill_tokens"] += sum(starts) + sum(len(r.input_ids) for r in siblings)
        self._sample_and_record(logits, a, a + len(take))
        return len(take)

    def _fail_backlog(self, error: BaseException) -> None:
        while self._backlog:
            r = self._backlog.popleft()
            self._resolve(r, {"type": "abort", "message": str(error)}, error=error)

    def _share_key(self, r: Request) -> Any:
        """Requests with the same key share one prefill (a group's samples); a retracted request
        brings its own output along, so it shares with nobody."""
        return r.key if self.prefix_sharing and not r.retracted else id(r)

    def _decode(self):
        b = self.batch
        B = b.size
        loras = [r.lora if r is not None else None for r in b.reqs[:B]]
        launch = getattr(self.model, "decode_launch", None)
        if launch is None or any(loras):
            self._count_step(B)
            logits = self.model.decode(b.pending[:B], b.positions(), loras if any(loras) else None)[:B]
            self._sample_and_record(logits, 0, B)
            return
        # forward + sampling in one launch (one CUDA graph): rows [0, n) with their own params;
        # with a top-k/top-p/min-p row in the batch every row goes through the filters (a row
        # without one is unchanged), so the step keeps its graph and runs ahead
        stochastic = b.any_stochastic(0, B)
        kinds = b.filter_kinds(0, B)   # (a filtered row is never greedy: RunningBatch.add)
        filters = any(kinds)
        one_pass = bool(getattr(self.model, "uses_triton", lambda: False)())   # the Triton sampler too

        def sample(logits: torch.Tensor, n: int) -> torch.Tensor:
            return _pack(*sample_rows(logits, b.params(0, n), stochastic, None, fused=one_pass, filter_all=filters,
                                      filter_kinds=kinds))

        key = (stochastic, one_pass, kinds) + tuple(t.data_ptr() for t in b.d.values())
        step = self._inflight
        self._inflight = None
        if step is None:
            step = launch(b.pending[:B], b.positions(), sample, key)
            self._after_launch(B)
        # Overlap: while the GPU runs step t+1 (its tokens fed back on the device), the host reads
        # and records step t. If step t finished a row, step t+1 is read at once too (its finished
        # rows' extra token is dropped) and the batch compacts; otherwise step t+1 stays in flight.
        ahead = None
        if self.model.can_chain() and not self._must_drain():
            ahead = launch(None, b.positions() + 1, sample, key)
            self._after_launch(B)
        done = self._record_step(step, B)
        if ahead is not None:
            if not done:
                self._inflight = ahead
                return
            done += self._record_step(ahead, B)
        self._compact(done)

    def _count_step(self, B: int) -> None:
        self.stats["steps"] += 1
        self.stats["decode_tokens"] += B
        self.stats["max_batch"] = max(self.stats["max_batch"], B)

    def _after_launch(self, B: int) -> None:
        """A sampled step is queued: its rows' sampling step counters advance on the device, in
        stream order before the next launch reads them."""
        self.batch.d["steps"][:B] += 1
        self._count_step(B)

    def _must_drain(self) -> bool:
        """Must the batch settle before the next step (a control op, a pause, requests that could be
        admitted now)? Then no step is launched ahead."""
        b = self.batch
        admit = b.size < b.cap and (self._backlog or not self.waiting.empty())
        return bool(admit or not self.controls.empty() or self.paused or self._stop.is_set())

    def _drain(self) -> None:
        """Read the step in flight, finish its rows and compact: the batch is settled."""
        step, self._inflight = self._inflight, None
        if step is not None:
            self._compact(self._record_step(step, len(step.host[0])))

    def _record_step(self, step, B: int) -> List[int]:
        """Record a launched step's tokens for the rows still running; their finished rows resolve
        (compaction is the caller's)."""
        toks, lp = _unpack(self.model.decode_result(step))
        return self._finish(self.batch.record(0, B, toks, lp, count_steps=False))

    def _sample_and_record(self, logits: torch.Tensor, a: int, z: int) -> None:
        """Sample rows ``[a, z)`` from ``logits`` (one row each), record, finish, compact."""
        b = self.batch
        tokens, lps = sample_rows(logits, b.params(a, z), b.any_stochastic(a, z), b.filter_rows(a, z))
        self._compact(self._finish(b.record(a, z, *_to_host(tokens, lps))))

    def _finish(self, done: Dict[int, dict]) -> List[int]:
        """Resolve the requests of the rows ``done`` names (rows already finished are skipped: an
        overlapped step ran them once more); returns the rows finished now."""
        b = self.batch
        rows = []
        for row, reason in done.items():
            if b.reqs[row] is None:
                continue
            r = b.take(row)        # the row's cache stays intact until compact() below
            if r.return_routed_experts:
                self._collect_routes(r, row)
            self._resolve(r, reason)
            rows.append(row)
        return rows

    def _compact(self, rows: List[int]) -> None:
        """Close the gaps finished ``rows`` left (their KV rows move with them)."""
        if not rows:
            return
        src, dst, length = self.batch.compact(rows)
        if src:
            self.model.copy_rows(src, dst, length)
        self._drop_unused_loras()

    def _collect_routes(self, r: Request, row: int) -> None:
        """SGLang's ``_maybe_collect_routed_experts``: the experts of positions
        ``[routed_experts_start_len, seqlen - 1)`` of cache row ``row`` (the last sampled token
        never ran through the model), base64 of the int32 array, when the model records them
        (else nothing, as SGLang)."""
        from megarl.wire.routes import encode_routed_experts

        read = getattr(self.model, "routed_experts", None)
        if read is None or not getattr(self.model, "records_routes", lambda: False)():
            return
        seqlen = len(r.input_ids) + len(r.output_ids)
        start = min(r.routed_experts_start_len, seqlen - 1)
        r.routed_experts = encode_routed_experts(read(row, start, seqlen - 1))

    def _resolve(self, r: Request, reason: dict, error: Optional[BaseException] = None):
        r.finish_reason = reason
        if not r.done.done():
            if error is not None:
                r.done.set_exception(error)
            else:
                r.done.set_result(r.result(self.weight_version))
