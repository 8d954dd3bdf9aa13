"""CUDA graphs of the embedded engine's decode step.

Why: a decode step of a small model is hundreds of tiny kernels; launching them from Python costs
more than running them (benchmarks/RESULTS.md section 2: graphs gave 3.5-4x over eager). A graph
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
from typing import Callable, Dict, Optional, Tuple

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


class DecodeGraphs:
    """Captured decode steps of one model. ``body(ids, pos, rows, Lk)`` is the eager decode over
    rows ``[0, rows)`` returning fp32 logits ``[rows, V]``; ``signature()`` lists the addresses of
    every tensor the body reads."""

    def __init__(self, body: Callable[[torch.Tensor, torch.Tensor, int, int], torch.Tensor],
                 signature: Callable[..., Tuple[int, ...]], device: torch.device, max_rows: int, max_len: int,
                 key_length: Optional[Callable[[int, int], int]] = None):
        self.body, self.signature, self.device = body, signature, device
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
        if self.sig is not None:
            if self.dirty and self.signature() != self.sig:
                self.clear()
            elif not self.dirty and self.signature(params=False) != self.quick:
                self.clear()
        self.dirty = False
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
            entry = self.graphs[key] = self._capture(body, Bb, Lk)
        return entry

    def _capture(self, body: Callable[[torch.Tensor, torch.Tensor, int, int], torch.Tensor], Bb: int,
                 Lk: int) -> Tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        ids, pos = self.io[0, :Bb], self.io[1, :Bb]
        self._warm_up(body, ids, pos, Bb, Lk)
        # the signature is read after the warm-up: a body may make buffers on its first run that
        # the graph reads too (session 14's split counters were such a buffer). Read before, it lacked them,
        # and the first check after a release found "moved" tensors and captured everything again.
        # Tensors that moved since the last capture were caught by `_prepare`'s check already.
        self.sig, self.quick = self.signature(), self.signature(params=False)
        graph, out = self._record(body, ids, pos, Bb, Lk)
        self.captures += 1
        return graph, out

    def _warm_up(self, body: Callable[[torch.Tensor, torch.Tensor, int, int], torch.Tensor], ids: torch.Tensor,
                 pos: torch.Tensor, Bb: int, Lk: int) -> None:
        """Run the body eagerly first (Triton compiles here; same inputs, so KV writes are idempotent)."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                body(ids, pos, Bb, Lk)
        torch.cuda.current_stream().wait_stream(side)

    def _record(self, body: Callable[[torch.Tensor, torch.Tensor, int, int], torch.Tensor], ids: torch.Tensor,
                pos: torch.Tensor, Bb: int, Lk: int) -> Tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = body(ids, pos, Bb, Lk)
        return graph, out
