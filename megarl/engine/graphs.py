"""CUDA graphs of the embedded engine's decode step, and of its small prefills (`PrefillGraphs`).

Why: a decode step of a small model is hundreds of tiny kernels; launching them from Python costs
more than running them (graphs gave 3.5-4x over eager on an H100:
benchmarks/results/h100_decode_vs_hf_logprob_parity.jsonl). A graph
is captured per (batch bucket, key-length bucket) on first use and replayed after that.

Rows: the engine keeps its running requests in KV-cache rows ``[0, B)`` (it compacts the batch when
requests finish), so a step of B requests replays the graph of the smallest batch bucket >= B; the
padding rows ``[B, bucket)`` are free rows (their writes land on position 0 of unused rows). A long
tail of a few unfinished requests therefore runs in a small graph: its cost follows the rows that
are still running, not the ones that finished.

Key lengths: attention reads positions ``[0, Lk)`` of each row, with Lk rounded up to a bucket
(64 up to 512 positions, then an eighth of the next power of two), so a step costs the context
actually in use rather than ``max_len``.

Sampled steps (`launch`): the engine's sampler is captured into the same graph, the step's tokens
and logprobs come back through a pinned host buffer (two slots) and an event, and the graph's sampled
tokens (positions + 1) are copied into its own inputs after each replay -- so the next step can be
launched before the host has read this one (engine.py).

Graphs bake in the addresses of every tensor they read. They stay valid across a memory release
and resume (`/release_memory_occupation`, every RL step when colocated) as long as the weights and
the cache come back at the same addresses, which `signature` checks (all of them after a
release/resume, the model's non-parameter tensors every step); otherwise they are dropped and
recaptured lazily.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np
import torch

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256)


def batch_buckets(max_rows: int) -> Tuple[int, ...]:
    """Batch sizes a graph is captured for: BATCH_BUCKETS, then every 64, up to ``max_rows``."""
    out = [b for b in BATCH_BUCKETS if b < max_rows]
    b = 320
    while b < max_rows:
        out.append(b)
        b += 64
    return tuple(out) + (max_rows,)


def len_bucket(n: int, max_len: int) -> int:
    """Key length attended over for a step whose longest row needs ``n`` positions."""
    step = 64 if n <= 512 else 1 << max(6, (n - 1).bit_length() - 3)
    return min(((n + step - 1) // step) * step, max_len)


@dataclass
class StepHandle:
    """A launched decode step: its output's host copy (filled once ``event`` has passed)."""

    host: torch.Tensor
    event: Optional["torch.cuda.Event"]


class _CapturedGraphs:
    """What the decode and prefill graph sets share: graphs keyed by bucket in one memory pool, the
    address signature that says when they must be dropped, and warm-up + recording of a body."""

    def __init__(self, signature: Callable[..., Tuple[int, ...]], device: torch.device):
        self.signature, self.device = signature, device
        self.graphs: Dict[Tuple, Tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None
        self.sig: Optional[Tuple[int, ...]] = None         # signature(): every address
        self.quick: Optional[Tuple[int, ...]] = None       # signature(params=False)
        self.dirty = False
        self.captures = 0

    def mark_dirty(self) -> None:
        """Tensors the graphs read may have moved (weights or cache reallocated): check first."""
        self.dirty = True

    def clear(self) -> None:
        self.graphs, self.pool, self.sig, self.quick = {}, None, None, None

    def _drop_if_moved(self) -> None:
        """Drop every graph when a tensor it reads moved: all addresses after `mark_dirty`, else
        the model's non-parameter tensors (cheap enough for every step)."""
        if self.sig is not None:
            if self.dirty and self.signature() != self.sig:
                self.clear()
            elif not self.dirty and self.signature(params=False) != self.quick:
                self.clear()
        self.dirty = False

    def _capture(self, body: Callable[..., torch.Tensor], *args) -> Tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        self._warm_up(body, *args)
        # the signature is read after the warm-up: a body may make buffers on its first run that
        # the graph reads too (the attention kernel's former split counters were such a buffer). Read
        # before, it lacked them, and the first check after a release found "moved" tensors and
        # captured everything again.
        # Tensors that moved since the last capture were caught by `_drop_if_moved` already.
        self.sig, self.quick = self.signature(), self.signature(params=False)
        graph, out = self._record(body, *args)
        self.captures += 1
        return graph, out

    def _warm_up(self, body: Callable[..., torch.Tensor], *args) -> None:
        """Run the body eagerly first (Triton compiles here; same inputs, so KV writes are idempotent)."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                body(*args)
        torch.cuda.current_stream().wait_stream(side)

    def _record(self, body: Callable[..., torch.Tensor], *args) -> Tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = body(*args)
        return graph, out


class DecodeGraphs(_CapturedGraphs):
    """Captured decode steps of one model. ``body(ids, pos, rows, Lk)`` is the eager decode over
    rows ``[0, rows)`` returning fp32 logits ``[rows, V]``; ``signature()`` lists the addresses of
    every tensor the body reads."""

    def __init__(self, body: Callable[[torch.Tensor, torch.Tensor, int, int], torch.Tensor],
                 signature: Callable[..., Tuple[int, ...]], device: torch.device, max_rows: int, max_len: int,
                 key_length: Optional[Callable[[int, int], int]] = None):
        super().__init__(signature, device)
        self.body = body
        # bucketed key length -> the one a graph is captured for (the body's own coarser classes)
        self.key_length = key_length
        self.max_rows, self.max_len = max_rows, max_len
        self.buckets = batch_buckets(max_rows)
        self.io = torch.zeros(2, max_rows, dtype=torch.long, device=device)   # static inputs: tokens, positions
        self.host = torch.zeros(2, max_rows, dtype=torch.long, pin_memory=device.type == "cuda")
        # sampled steps' outputs on the host, two slots: step t is read while step t+1 runs
        self.results = [torch.zeros(2, max_rows, dtype=torch.float64, pin_memory=device.type == "cuda")
                        for _ in range(2)]
        self.turn = 0

    def run(self, tokens: np.ndarray, positions: np.ndarray) -> torch.Tensor:
        """Logits ``[B, V]`` for rows ``[0, B)`` (a view of the graph's static output, valid until
        the next step)."""
        graph, out = self._prepare(tokens, positions, len(tokens), None, ())
        graph.replay()
        return out[:len(tokens)]

    def launch(self, tokens: Optional[np.ndarray], positions: np.ndarray, sample: Callable[[torch.Tensor, int], torch.Tensor],
               sample_key: Tuple = ()) -> "StepHandle":
        """Queue one decode step of rows ``[0, B)`` and its sampling (``sample(logits, rows)`` ->
        ``[2, rows]`` tokens and logprobs, captured into the same graph) without waiting for it;
        `result` waits. ``tokens`` None: the rows' tokens are the ones the previous launch sampled
        (fed back on the device, positions + 1), so the host can queue step t+1 before it has read
        step t. ``positions``: the rows' positions for this step (they size the key-length bucket).
        ``sample_key`` names what ``sample`` reads (graphs are kept per key)."""
        B = len(positions)
        graph, out = self._prepare(tokens, positions, B, sample, sample_key)
        graph.replay()
        Bb = out.shape[-1]
        self.io[0, :Bb].copy_(out[0])       # the next chained step's tokens and positions
        self.io[1, :Bb] += 1
        slot = self.results[self.turn]
        self.turn ^= 1
        slot[:, :B].copy_(out[:, :B], non_blocking=True)
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        return StepHandle(slot[:, :B], event)

    @staticmethod
    def result(handle: "StepHandle") -> np.ndarray:
        """The launched step's ``[2, B]`` float64 (tokens, logprobs), once it has finished."""
        if handle.event is not None:
            handle.event.synchronize()
        return handle.host.numpy().copy()

    def _prepare(self, tokens: Optional[np.ndarray], positions: np.ndarray, B: int,
                 sample: Optional[Callable[[torch.Tensor, int], torch.Tensor]], sample_key: Tuple):
        """Inputs in place and the graph for this step (captured on first use)."""
        Bb = next(b for b in self.buckets if b >= B)
        Lk = len_bucket(int(positions.max()) + 1, self.max_len)
        if self.key_length is not None:
            Lk = self.key_length(Lk, self.max_len)
        self._drop_if_moved()
        if tokens is not None:
            host = self.host
            host[0, :B] = torch.from_numpy(np.asarray(tokens, dtype=np.int64))
            host[1, :B] = torch.from_numpy(np.asarray(positions, dtype=np.int64))
            host[:, B:Bb] = 0
            self.io[:, :Bb].copy_(host[:, :Bb], non_blocking=True)
        key = (Bb, Lk) + ((sample_key,) if sample is not None else ())
        entry = self.graphs.get(key)
        if entry is None:
            body = self.body if sample is None else (lambda i, p, n, k: sample(self.body(i, p, n, k), n))
            entry = self.graphs[key] = self._capture(body, self.io[0, :Bb], self.io[1, :Bb], Bb, Lk)
        return entry


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


class PrefillGraphs(_CapturedGraphs):
    """Captured prefills from position 0, per (rows bucket, length bucket), up to ``max_tokens``
    padded tokens. ``body(ids [U, T], lens [U], rows [U])`` is the eager fused prefill returning fp32
    logits ``[U, V]`` (`fused_prefill.prefill_body`).

    Why: an admission's prefill launches ~11 kernels per layer from Python, and for a few short
    prompts those launches take several times the GPU's work (benchmarks/RESULTS.md, prefill and admissions:
    7.8 ms of wall for 1.1 ms of kernels, one 32-token prompt of Qwen2.5-0.5B). Every agent turn
    and every admission wave of a rollout pays it. Rows are padded to a power of two with
    sequences of row -1 (nothing stored, logits dropped), lengths to a power of two >= 16 (the
    padding's keys land past each row's end, where decode writes before any query reads, as in
    the eager prefill). Past ``max_tokens`` padded tokens the GPU's work hides the launches and
    the graph's activations would cost memory: `run` returns None and the caller runs it eagerly."""

    MIN_LEN = 16

    def __init__(self, body: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
                 signature: Callable[..., Tuple[int, ...]], device: torch.device, max_rows: int, max_len: int,
                 max_tokens: int):
        super().__init__(signature, device)
        self.body, self.max_len, self.max_tokens = body, max_len, max_tokens
        self.max_rows = _pow2(max_rows)
        pin = device.type == "cuda"
        self.ids = torch.zeros(max(max_tokens, 1), dtype=torch.long, device=device)
        self.meta = torch.zeros(2, self.max_rows, dtype=torch.long, device=device)   # lens, cache rows
        self.host_ids = torch.zeros(max(max_tokens, 1), dtype=torch.long, pin_memory=pin)
        self.host_meta = torch.zeros(2, self.max_rows, dtype=torch.long, pin_memory=pin)
        self.copied: Optional["torch.cuda.Event"] = None   # the host buffers' last copy has run
        # every graph writes its logits here (made by the first warm-up, outside the pool): one
        # buffer for all buckets, where each graph's own output would stay allocated beside the others
        self.out: Optional[torch.Tensor] = None

    def bucket(self, rows: int, length: int) -> Optional[Tuple[int, int]]:
        """(rows, length) a prefill of ``rows`` sequences of at most ``length`` tokens replays, or
        None when it is not served by a graph."""
        Ub, Tb = _pow2(rows), min(max(self.MIN_LEN, _pow2(length)), self.max_len)
        if Ub > self.max_rows or Ub * Tb > self.max_tokens or length > Tb:
            return None
        return Ub, Tb

    def run(self, seqs: List[List[int]], row0: int) -> Optional[torch.Tensor]:
        """Prefill ``seqs`` into cache rows ``row0, row0 + 1, ...`` from position 0: fp32 logits
        ``[U, V]`` (a view of the graph's output, valid until its next replay), or None (too big:
        run it eagerly)."""
        U, T = len(seqs), max(len(q) for q in seqs)
        b = self.bucket(U, T)
        if b is None:
            return None
        Ub, Tb = b
        self._drop_if_moved()
        if self.copied is not None:
            self.copied.synchronize()   # the last admission's copy has read the host buffers
        ids = self.host_ids[:Ub * Tb].numpy().reshape(Ub, Tb)
        ids[:] = 0
        meta = self.host_meta[:, :Ub].numpy()
        meta[0], meta[1] = 1, -1            # padding sequences: one token, no cache row
        for u, q in enumerate(seqs):
            ids[u, :len(q)] = q
            meta[0, u], meta[1, u] = len(q), row0 + u
        self.ids[:Ub * Tb].copy_(self.host_ids[:Ub * Tb], non_blocking=True)
        self.meta[:, :Ub].copy_(self.host_meta[:, :Ub], non_blocking=True)
        if self.device.type == "cuda":
            self.copied = torch.cuda.Event()
            self.copied.record()
        entry = self.graphs.get((Ub, Tb))
        if entry is None:
            entry = self.graphs[(Ub, Tb)] = self._capture(self._into_output, self.ids[:Ub * Tb].view(Ub, Tb),
                                                         self.meta[0, :Ub], self.meta[1, :Ub])
        graph, out = entry
        graph.replay()
        return out[:U]

    def _into_output(self, ids: torch.Tensor, lens: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        logits = self.body(ids, lens, rows)
        if self.out is None:
            self.out = torch.empty((self.max_rows,) + tuple(logits.shape[1:]), dtype=logits.dtype, device=logits.device)
        out = self.out[:logits.shape[0]]
        out.copy_(logits)
        return out
