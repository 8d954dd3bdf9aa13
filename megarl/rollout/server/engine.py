"""Continuous-batching engine: one scheduler thread owns the model and the KV cache.

Loop (one iteration = one "step"):
  1. run queued control ops (weight updates, memory release/resume, flush) -- between steps,
     never in the middle of a forward;
  2. admit waiting requests into free KV slots (up to `max_running`, `max_prefill_tokens` per
     step) and prefill them as one right-padded batch;
  3. one decode step over every running request (new and old together);
  4. sample each row with its own params; finished requests free their slot and resolve.

Logprobs are computed from the same fp32 logits the token is sampled from:
`log_softmax(logits / temperature)` (raw logits when temperature == 0), before top-k/top-p/min-p
filtering -- the same convention as sglang's default `output_token_logprobs`.
"""
from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple, Union

import torch

from megarl.rollout.versions import weight_version_spans

from .model import DecoderModel

if TYPE_CHECKING:
    from .worker import ModelHandle

log = logging.getLogger("megarl.rollout.engine")


@dataclass
class Sampling:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    min_new_tokens: int = 0
    stop_token_ids: tuple = ()
    ignore_eos: bool = False
    sampling_seed: Optional[int] = None

    @classmethod
    def from_dict(cls, d: Optional[Dict[str, Any]]) -> "Sampling":
        d = dict(d or {})
        s = cls()
        for k in ("max_new_tokens", "min_new_tokens", "top_k", "sampling_seed"):
            if d.get(k) is not None:
                setattr(s, k, int(d[k]))
        for k in ("temperature", "top_p", "min_p"):
            if d.get(k) is not None:
                setattr(s, k, float(d[k]))
        if d.get("ignore_eos") is not None:
            s.ignore_eos = bool(d["ignore_eos"])
        if d.get("stop_token_ids"):
            s.stop_token_ids = tuple(int(t) for t in d["stop_token_ids"])
        if s.max_new_tokens < 0 or s.temperature < 0 or not (0 < s.top_p <= 1) or s.top_k == 0:
            raise ValueError(f"invalid sampling params {d}")
        return s

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


@dataclass
class Request:
    input_ids: List[int]
    sampling: Sampling
    return_logprob: bool = False
    rid: str = field(default_factory=lambda: uuid.uuid4().hex)
    done: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    output_ids: List[int] = field(default_factory=list)
    logprobs: List[float] = field(default_factory=list)
    finish_reason: Optional[dict] = None
    slot: int = -1
    pending: int = -1          # last sampled token, not yet written to the KV cache
    t_start: float = field(default_factory=time.time)
    # (old weight version, output tokens so far) at each weight change while this request lived
    version_events: List[Tuple[str, int]] = field(default_factory=list)
    retracted: bool = False    # back in the queue with its KV freed: re-prefilled with its output

    def result(self, weight_version: str) -> dict:
        spans = weight_version_spans(self.version_events, weight_version, len(self.output_ids))
        meta = {
            "id": self.rid,
            "finish_reason": self.finish_reason,
            "prompt_tokens": len(self.input_ids),
            "completion_tokens": len(self.output_ids),
            "cached_tokens": 0,
            "weight_version": spans[-1]["version"],
            "weight_versions": spans,     # SGLang 0.5.23: which version produced which tokens
            "e2e_latency": time.time() - self.t_start,
        }
        if self.return_logprob:
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(self.logprobs, self.output_ids)]
        return {"output_ids": list(self.output_ids), "meta_info": meta}


_MASK32 = 0xFFFFFFFF


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mix (xorshift-multiply, as in Wang/Mueller hashes) on int64 tensors whose
    values stay below 2^58, so the arithmetic is exact and identical on CPU and CUDA."""
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    return (x >> 16) ^ x


def seeded_gumbel(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """Gumbel noise ``[B, V]`` that depends only on (request seed, decode step, token id): a
    seeded request samples the same tokens whether it is batched with others or alone, on any
    device, and without a per-request generator (the rows are sampled in one batched op)."""
    key = _hash32((_hash32(seeds & _MASK32) ^ ((steps * 0x27D4EB2D) & _MASK32)) & _MASK32)
    vocab_ids = _hash32(torch.arange(vocab, device=seeds.device, dtype=torch.int64))
    bits = _hash32(key[:, None] ^ vocab_ids[None, :])
    u = (bits.to(torch.float64) + 0.5) / 4294967296.0
    return -torch.log(-torch.log(u)).to(torch.float32)


def _filtered_logp(logp: torch.Tensor, s: "Sampling") -> torch.Tensor:
    """Row ``logp`` with the tokens that top-k / top-p / min-p exclude set to -inf."""
    p = logp.exp()
    keep = torch.ones_like(p, dtype=torch.bool)
    if 0 < s.top_k < p.numel():
        keep &= p >= torch.topk(p, s.top_k).values[-1]
    if s.top_p < 1.0:
        sp, si = torch.sort(p, descending=True)
        cum = torch.cumsum(sp, 0)
        drop_sorted = (cum - sp) > s.top_p * cum[-1]
        keep &= ~torch.zeros_like(keep).scatter_(0, si, drop_sorted)
    if s.min_p > 0.0:
        keep &= p >= s.min_p * p.max()
    return torch.where(keep, logp, torch.full_like(logp, float("-inf")))


def sample(logits: torch.Tensor, reqs: List[Request], default_gen: torch.Generator):
    """logits fp32 [B, V] -> (tokens [B], logprobs [B]) with per-row params.

    Every non-greedy row is sampled by Gumbel-max on its (filtered) temperature-scaled log-probs,
    with noise from ``seeded_gumbel`` keyed by the request's seed and its number of generated
    tokens (requests without ``sampling_seed`` get one from the server's generator on admission),
    all rows in one batched op. Logprobs are those of the unfiltered temperature-scaled
    distribution, SGLang's convention."""
    B, V = logits.shape
    temps = torch.tensor([r.sampling.temperature if not r.sampling.greedy else 1.0 for r in reqs],
                         dtype=torch.float32, device=logits.device)
    logp = torch.log_softmax(logits / temps[:, None], dim=-1)
    tokens = logits.argmax(dim=-1)
    stochastic = [i for i, r in enumerate(reqs) if not r.sampling.greedy]
    if stochastic:
        for r in (reqs[i] for i in stochastic):
            if r.sampling.sampling_seed is None:
                r.sampling.sampling_seed = int(torch.randint(0, 2**31 - 1, (1,), generator=default_gen))
        index = torch.tensor(stochastic, device=logits.device)
        rows = logp.index_select(0, index)
        filtered = [j for j, i in enumerate(stochastic) if reqs[i].sampling.top_k > 0 or reqs[i].sampling.top_p < 1.0
                    or reqs[i].sampling.min_p > 0.0]
        if filtered:
            rows = rows.clone()
            for j in filtered:
                rows[j] = _filtered_logp(rows[j], reqs[stochastic[j]].sampling)
        seeds = torch.tensor([reqs[i].sampling.sampling_seed for i in stochastic], dtype=torch.int64, device=logits.device)
        steps = torch.tensor([len(reqs[i].output_ids) for i in stochastic], dtype=torch.int64, device=logits.device)
        tokens[index] = (rows + seeded_gumbel(seeds, steps, V)).argmax(dim=-1)
    lps = logp.gather(1, tokens[:, None])[:, 0]
    return tokens.tolist(), lps.tolist()


class Engine:
    """The scheduler loop. `model` is a `DecoderModel` (tests) or, in the server, a
    `worker.ModelHandle` whose every call runs on all TP ranks."""

    def __init__(self, model: Union[DecoderModel, "ModelHandle"], max_running: int = 32, max_len: int = 2048,
                 max_prefill_tokens: int = 8192, seed: int = 0):
        self.model = model
        self.max_running = max_running
        self.max_len = max_len
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: "queue.Queue[Request]" = queue.Queue()
        self.controls: "queue.Queue[tuple]" = queue.Queue()
        self.running: List[Request] = []
        self.free_slots = list(range(max_running))
        self.weight_version = "default"
        self.gen = torch.Generator().manual_seed(seed)
        self.stats = {"steps": 0, "decode_tokens": 0, "prefill_tokens": 0, "max_batch": 0}
        self.released: set = set()
        self.paused: Optional[str] = None   # SGLang pause mode (retract | in_place) while paused
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._backlog: List[Request] = []
        self._thread: Optional[threading.Thread] = None
        model.alloc_cache(max_running, max_len)

    # ------------------------------------------------------------ public (any thread)
    def start(self):
        self._thread = threading.Thread(target=self._loop, name="megarl-engine", daemon=True)
        self._thread.start()

    def stop(self):
        self._stop.set()
        self._wake.set()
        if self._thread:
            self._thread.join(timeout=10)

    def submit(self, req: Request) -> concurrent.futures.Future:
        n = len(req.input_ids)
        if n == 0:
            raise ValueError("empty input_ids")
        if n >= self.max_len:
            raise ValueError(f"prompt of {n} tokens does not fit max_len {self.max_len}")
        if "kv_cache" in self.released or "weights" in self.released:
            raise RuntimeError(f"memory released ({sorted(self.released)}); call /resume_memory_occupation")
        self.waiting.put(req)
        self._wake.set()
        return req.done

    def control(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run fn on the engine thread between steps; returns a future of its result."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self.controls.put((fn, fut))
        self._wake.set()
        return fut

    def num_active(self) -> int:
        return len(self.running) + self.waiting.qsize() + len(self._backlog)

    # ------------------------------------------------------------ SGLang's pause / abort (engine thread)
    # Called through `control(...)`, i.e. between steps, like SGLang's scheduler handles them.
    def set_weight_version(self, version: str) -> None:
        """New weights are in place: every live request records how many tokens it had under the
        old version (SGLang's ``record_weight_version_events``), so its answer says which tokens
        which version produced."""
        if version == self.weight_version:
            return
        self._drain_waiting()
        for r in self.running + list(self._backlog):
            if r.output_ids:
                r.version_events.append((self.weight_version, len(r.output_ids)))
        self.weight_version = version

    def abort(self, rid: str = "", abort_all: bool = False) -> int:
        """Finish the matching requests now with the tokens they have (SGLang's ``AbortReq``: an
        empty rid without ``abort_all`` matches nothing; a rid matches by prefix, as SGLang's
        scheduler does, so the sub-requests of a batch go with it). Returns how many."""
        if not abort_all and not rid:
            return 0
        self._drain_waiting()
        hit = lambda r: abort_all or r.rid.startswith(rid)  # noqa: E731
        victims = [r for r in self.running if hit(r)] + [r for r in self._backlog if hit(r)]
        self._backlog = [r for r in self._backlog if not hit(r)]
        for r in victims:
            self._finish(r, {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None})
        self.running = [r for r in self.running if r.finish_reason is None]
        return len(victims)

    def has_request(self, rid: str) -> bool:
        """Is a request with exactly this rid running or queued?"""
        self._drain_waiting()
        return bool(rid) and any(r.rid == rid for r in self.running + self._backlog)

    def pause(self, mode: str) -> int:
        """Stop scheduling. ``retract``: running requests go back to the front of the queue with
        their KV freed (re-prefilled from prompt + output when continued, under whatever weights
        are current then); ``in_place``: they stay as they are. Returns the running count."""
        if mode not in ("retract", "in_place"):
            raise ValueError(f"engine pause mode must be retract or in_place, got {mode!r}")
        self.paused = mode
        held = len(self.running)
        if mode == "retract":
            for r in self.running:
                self.free_slots.append(r.slot)
                r.slot, r.retracted = -1, True
            self._backlog = self.running + self._backlog
            self.running = []
        return held

    def unpause(self) -> None:
        self.paused = None
        self._wake.set()

    def idle(self, ignore_waiting: bool = False) -> bool:
        """SGLang's ``is_fully_idle``: nothing running (and, unless ignored, nothing queued)."""
        return not self.running and (ignore_waiting or (not self._backlog and self.waiting.empty()))

    def _drain_waiting(self) -> None:
        while True:
            try:
                self._backlog.append(self.waiting.get_nowait())
            except queue.Empty:
                return

    # ------------------------------------------------------------ engine thread
    def _loop(self):
        while not self._stop.is_set():
            try:
                self._run_controls()
                if self.paused:
                    self._wake.wait(timeout=0.05)
                    self._wake.clear()
                    continue
                admitted = self._admit()
                if not self.running:
                    self._wake.wait(timeout=0.05)
                    self._wake.clear()
                    continue
                self._decode(skip=admitted)
            except Exception as e:  # never die silently: fail the running requests
                log.exception("engine step failed")
                for r in self.running:
                    self._finish(r, {"type": "abort", "message": f"engine error: {e}"}, error=e)
                self.running = []

    def _run_controls(self):
        while True:
            try:
                fn, fut = self.controls.get_nowait()
            except queue.Empty:
                return
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as e:
                fut.set_exception(e)

    def _admit(self) -> List[Request]:
        self._drain_waiting()
        new, budget = [], self.max_prefill_tokens
        # a retracted request's context is its prompt and all it generated (its pending token too)
        context = lambda r: r.input_ids + r.output_ids if r.retracted else r.input_ids  # noqa: E731
        while self._backlog and self.free_slots:
            r = self._backlog[0]
            if new and len(context(r)) > budget:
                break
            self._backlog.pop(0)
            if r.done.cancelled():
                continue
            r.slot = self.free_slots.pop()
            budget -= len(context(r))
            new.append(r)
        if not new:
            return []
        seqs = [context(r) for r in new]
        for r in new:
            r.retracted = False
        logits = self.model.prefill(seqs, [r.slot for r in new])
        self.stats["prefill_tokens"] += sum(len(q) for q in seqs)
        self.running.extend(new)
        self._consume(new, logits)
        return new

    def _decode(self, skip: List[Request]):
        # requests admitted this step already got their first token from the prefill logits;
        # they join the decode batch from the next step on -- except that we still want to
        # batch them now: feed every running request's pending token.
        batch = [r for r in self.running if r.finish_reason is None]
        if not batch:
            self.running = []
            return
        pos = [len(r.input_ids) + len(r.output_ids) - 1 for r in batch]
        logits = self.model.decode([r.pending for r in batch], [r.slot for r in batch], pos)
        self.stats["steps"] += 1
        self.stats["decode_tokens"] += len(batch)
        self.stats["max_batch"] = max(self.stats["max_batch"], len(batch))
        self._consume(batch, logits)

    def _consume(self, reqs: List[Request], logits: torch.Tensor):
        toks, lps = sample(logits, reqs, self.gen)
        eos = set(self.model.spec.eos_token_ids)
        for r, t, lp in zip(reqs, toks, lps):
            r.output_ids.append(t)
            r.logprobs.append(lp)
            r.pending = t
            s = r.sampling
            n = len(r.output_ids)
            if n >= s.min_new_tokens and (t in s.stop_token_ids or (not s.ignore_eos and t in eos)):
                self._finish(r, {"type": "stop", "matched": t})
            elif n >= s.max_new_tokens:
                self._finish(r, {"type": "length", "length": s.max_new_tokens})
            elif len(r.input_ids) + n >= self.max_len:
                self._finish(r, {"type": "length", "length": n})
        self.running = [r for r in self.running if r.finish_reason is None]

    def _finish(self, r: Request, reason: dict, error: Optional[BaseException] = None):
        r.finish_reason = reason
        if r.slot >= 0:
            self.free_slots.append(r.slot)
            r.slot = -1
        if not r.done.done():
            if error is not None:
                r.done.set_exception(error)
            else:
                r.done.set_result(r.result(self.weight_version))
