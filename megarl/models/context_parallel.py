"""Context parallelism (CP) for packed (THD) micro-batches, without Transformer Engine.

Why: one long reasoning sample (32k-128k tokens) has activations that no longer fit one GPU.
CP splits every sequence of a packed micro-batch over the ``cp`` ranks of megatron's context
parallel group; each rank runs the whole model on ``T / cp`` tokens and only attention needs the
other ranks' tokens.

Layout (megatron / Transformer Engine's load-balanced "zig-zag"): every sequence is padded to a
multiple of ``2 * cp`` tokens and cut into ``2 * cp`` equal chunks; rank ``r`` holds chunks ``r``
and ``2 * cp - 1 - r`` of every sequence, laid end to end (sequence by sequence). Under causal
attention chunk ``j`` attends ``j + 1`` chunks, so every rank does the same work.

Contracts with megatron (the same as TE's THD CP):

* ``PackedSeqParams.cu_seqlens_q/kv`` and ``max_seqlen_q/kv`` describe the *global* padded
  sequences; the model input is the rank's ``T / cp`` tokens. megatron's RoPE
  (``rope_utils._apply_rotary_pos_emb_thd`` with the cp group) then gives each local token the
  frequencies of its global position, and megatron's schedule multiplies each micro-batch loss by
  ``cp`` while DDP averages gradients over the data-parallel x context-parallel group.
* Attention (:func:`cp_packed_attention`): each layer all-gathers K and V over the CP group
  (:class:`_GatherKV`, whose backward reduce-scatters the gradient of the gathered K/V back to
  the rank that owns the tokens) and attends the local queries to them, causal by global position.
* Per-token outputs (logprob, entropy, value) are computed on the local rows and gathered into
  global row order (:func:`gather_rows`; backward: the local slice) so that every loss runs
  unchanged over whole sequences with its global denominators; each CP rank's backward then
  covers exactly its own tokens.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor


def cp_padded_len(n: int, cp: int) -> int:
    """``n`` rounded up to a multiple of ``2 * cp`` (every chunk of the zig-zag split equal); ``n``
    itself without CP."""
    m = 2 * cp if cp > 1 else 1
    return -(-int(n) // m) * m


def zigzag_rows(padded_lens: Sequence[int], cp: int, rank: int) -> Tensor:
    """Global packed row of each of rank ``rank``'s local rows: per sequence, chunk ``rank`` then
    chunk ``2 * cp - 1 - rank`` (int64, ``sum(padded_lens) / cp`` rows)."""
    parts = []
    start = 0
    for n in padded_lens:
        if n % (2 * cp):
            raise ValueError(f"sequence of {n} tokens is not padded to a multiple of 2*cp = {2 * cp}")
        c = n // (2 * cp)
        parts.append(torch.arange(start + rank * c, start + (rank + 1) * c))
        parts.append(torch.arange(start + (2 * cp - 1 - rank) * c, start + (2 * cp - rank) * c))
        start += n
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


@dataclass
class CPSplit:
    """One micro-batch's CP split on one rank: which global rows are local, and how the rank-major
    gathered rows map back to global order (host tensors; moved with the micro-batch)."""

    cp: int
    rank: int
    padded_lens: tuple           # global per-sequence lengths, multiples of 2 * cp
    local_rows: Tensor           # [T / cp] global row of each local row
    global_order: Tensor         # [T] index into the rank-major gathered rows, in global order
    prefix_rows: Tensor          # varlen path: global K/V rows of each local chunk's key prefix, chunk by chunk
    cu_q: Tensor                 # varlen path: [chunks + 1] query offsets (local chunks)
    cu_k: Tensor                 # varlen path: [chunks + 1] key offsets into ``prefix_rows``
    max_q: int
    max_k: int
    group: Optional[object] = None   # the CP process group (None: megatron's current one)

    @classmethod
    def build(cls, padded_lens: Sequence[int], cp: int, rank: int, group=None) -> "CPSplit":
        """Index tensors made once per micro-batch on the host (no per-layer host work or copies)."""
        lens = tuple(int(n) for n in padded_lens)
        ranks = [zigzag_rows(lens, cp, r) for r in range(cp)]
        order = torch.empty(sum(lens), dtype=torch.int64)
        order[torch.cat(ranks)] = torch.arange(sum(lens))
        chunks = list(_local_chunks(lens, cp, rank))
        prefix = torch.cat([torch.arange(g0, g0 + p + c) for _, g0, p, c in chunks])
        q_lens = torch.tensor([c for *_, c in chunks])
        k_lens = torch.tensor([p + c for _, _, p, c in chunks])
        return cls(cp, rank, lens, ranks[rank], order, prefix, F.pad(q_lens.cumsum(0), (1, 0)),
                   F.pad(k_lens.cumsum(0), (1, 0)), int(q_lens.max()), int(k_lens.max()), group)

    def to(self, device: torch.device) -> "CPSplit":
        return replace(self, local_rows=self.local_rows.to(device), global_order=self.global_order.to(device),
                       prefix_rows=self.prefix_rows.to(device), cu_q=self.cu_q.to(device), cu_k=self.cu_k.to(device))

    def process_group(self):
        if self.group is not None:
            return self.group
        from megatron.core import parallel_state as mpu

        return mpu.get_context_parallel_group()


def _all_gather(x: Tensor, group, size: int) -> Tensor:
    """Rank-major concatenation of ``x`` (same shape on every rank) along dim 0."""
    x = x.contiguous()
    if dist.get_backend(group) == "nccl":
        out = x.new_empty((size * x.shape[0],) + tuple(x.shape[1:]))
        dist.all_gather_into_tensor(out, x, group=group)
        return out
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, 0)


def _own_slice(x: Tensor, group, size: int) -> Tensor:
    n = x.shape[0] // size
    r = dist.get_rank(group)
    return x[r * n:(r + 1) * n]


class _Gather(torch.autograd.Function):
    """All-gather along dim 0 (rank-major); the subclasses say what the backward does."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group, ctx.size = group, dist.get_world_size(group)
        return _all_gather(x, group, ctx.size)


class _GatherKV(_Gather):
    """Backward sums every rank's gradient of the gathered tensor and keeps this rank's part (a
    reduce-scatter: the other ranks' queries also attended to our keys)."""

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = grad.contiguous()
        if dist.get_backend(ctx.group) == "nccl":
            out = grad.new_empty((grad.shape[0] // ctx.size,) + tuple(grad.shape[1:]))
            dist.reduce_scatter_tensor(out, grad, group=ctx.group)
            return out, None
        grad = grad.clone()   # reduced in place: never into a buffer autograd may hold elsewhere
        dist.all_reduce(grad, group=ctx.group)   # gloo has no reduce-scatter
        return _own_slice(grad, ctx.group, ctx.size).contiguous(), None


class _GatherRows(_Gather):
    """For values every rank then uses identically (per-token outputs read by the loss): backward
    keeps this rank's slice only, since every rank computes the same loss and each must propagate
    it through its own tokens once."""

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _own_slice(grad, ctx.group, ctx.size).contiguous(), None


def gather_rows(x: Tensor, split: CPSplit) -> Tensor:
    """Per-local-row values ``[T / cp, ...]`` -> ``[T, ...]`` in global packed row order."""
    gathered = _GatherRows.apply(x, split.process_group())
    return gathered.index_select(0, split.global_order.to(gathered.device))


def gather_kv(x: Tensor, split: CPSplit) -> Tensor:
    """Local keys or values ``[T / cp, h, d]`` -> ``[T, h, d]`` in global packed row order
    (backward: reduce-scatter)."""
    gathered = _GatherKV.apply(x, split.process_group())
    return gathered.index_select(0, split.global_order.to(gathered.device))


def _local_chunks(padded_lens: Sequence[int], cp: int, r: int):
    """Per local chunk of rank ``r``: (local start, global sequence start, chunk start inside the
    sequence, size)."""
    local = start = 0
    for n in padded_lens:
        c = n // (2 * cp)
        for j in (r, 2 * cp - 1 - r):
            yield local, start, j * c, c
            local += c
        start += n


def cp_packed_attention(q: Tensor, k: Tensor, v: Tensor, split: CPSplit, scale: float, backend: str) -> Tensor:
    """Causal attention of this rank's packed queries ``[T / cp, hq, d]`` to the keys/values of the
    whole sequences (gathered over the CP group). ``backend``: ``per_sequence`` (an explicit
    position mask per sequence; CPU, fp32) or ``varlen`` (the varlen flash kernel, one query chunk
    against its key prefix each, bottom-right causal)."""
    kg, vg = gather_kv(k, split), gather_kv(v, split)
    if backend == "varlen":
        return _varlen_chunks(q, kg, vg, split, scale)
    gqa = q.shape[1] != k.shape[1]
    outs = []
    chunks = list(_local_chunks(split.padded_lens, split.cp, split.rank))
    for i in range(0, len(chunks), 2):   # the two chunks of one sequence share its keys
        (l0, g0, p0, c), (_, _, p1, _) = chunks[i], chunks[i + 1]
        pos = torch.cat([torch.arange(p0, p0 + c), torch.arange(p1, p1 + c)]).to(q.device)
        end = max(p0, p1) + c
        allowed = torch.arange(end, device=q.device).unsqueeze(0) <= pos.unsqueeze(1)   # [2c, end]
        qs = q[l0:l0 + 2 * c].transpose(0, 1).unsqueeze(0)
        ks, vs = (x[g0:g0 + end].transpose(0, 1).unsqueeze(0) for x in (kg, vg))
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=allowed, scale=scale, enable_gqa=gqa)
        outs.append(o[0].transpose(0, 1))
    return torch.cat(outs, 0) if len(outs) > 1 else outs[0].contiguous()


def _varlen_chunks(q: Tensor, kg: Tensor, vg: Tensor, split: CPSplit, scale: float) -> Tensor:
    """One varlen call: query chunk ``j`` of a sequence against the sequence's first ``j + 1``
    chunks of keys, causal bottom-right aligned (FlashAttention's varlen convention when a query
    block is shorter than its keys). The prefixes are copied out of the gathered K/V: per sequence
    ``(2 cp + 1) / (2 cp)`` of its length, which attention keeps for its backward."""
    from .packed_attention import _varlen

    index = split.prefix_rows.to(kg.device)
    return _varlen(q, kg.index_select(0, index), vg.index_select(0, index), split.cu_q.to(q.device),
                   split.cu_k.to(q.device), split.max_q, split.max_k, scale)
