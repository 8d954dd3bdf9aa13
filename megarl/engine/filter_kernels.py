"""Top-k / top-p / min-p keep-sets without a sort: one value threshold per row (Triton).

Why: a decode graph whose batch has a filtered row put every row through `sampler.filtered_logp`,
a stable sort of ``[B, V]`` plus a cumulative sum, scatter and a dozen more ``[B, V]`` passes. On
the H200 that made a top-p 0.9 batch of 128 at Qwen's 152k vocabulary 3.6x slower than the same
batch unfiltered (benchmarks/RESULTS.md, decode speed).

Every one of these filters keeps the ids whose value is above some bound, so a row's keep-set is
``z >= threshold`` with ``z = logits / T``:

* top-k keeps the ids with fewer than k ids strictly above them (``p >= k-th largest``, ties kept);
* top-p keeps the ids whose strictly larger ids hold at most ``top_p`` of the mass -- the
  sorted cumulative sum before them, as `sampler.filtered_logp` computes it (ties at the boundary
  are all kept here, where the stable sort keeps the lower ids: the one difference);
* min-p keeps ``p >= min_p * max p``.

The top-k and top-p bounds are found exactly by a search over the fp32 values' order keys: a pass
evaluates F candidate values at once (the count and the mass of the ids above each), which narrows
the key interval F + 1 ways; 11 passes of 8 candidates pin any fp32 value. Each pass is one kernel
over (row, 4096-id chunk) programs, so even one row spreads over the GPU; a pass's programs first
fold the previous pass's per-chunk sums (in a fixed order: the result does not depend on the
batch) into the row's narrowed interval. No host sync: the whole search is graph-capturable.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from .kernels import merged_lse, online_max_sumexp

CANDIDATES = 8     # values a pass evaluates (F)
CHUNK = 4096       # vocabulary ids per program
BLOCK = 1024       # ids per inner step


def search_passes(candidates: int = CANDIDATES) -> int:
    """Passes that narrow any fp32 key interval (< 2^32 + 1 keys) to one key, ``candidates``
    values per pass (an interval of L keys becomes at most L // (F + 1) + 1)."""
    length, passes = (1 << 32) + 1, 0
    while length > 1:
        length = length // (candidates + 1) + 1 if length > candidates + 1 else 1
        passes += 1
    return passes


@triton.jit
def _order_key(z):
    """fp32 -> int64 key in the order of the values (negative floats' magnitude bits flipped)."""
    b = z.to(tl.int32, bitcast=True)
    return tl.where(b >= 0, b, b ^ 0x7FFFFFFF).to(tl.int64)


@triton.jit
def _key_value(k):
    """`_order_key`'s inverse: an int64 key (within int32) -> its fp32 value."""
    b = k.to(tl.int32)
    return tl.where(b >= 0, b, b ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)


@triton.jit
def _candidates(lo, hi, F: tl.constexpr):
    """F keys splitting ``(lo, hi]`` into F + 1 parts, each in ``[lo + 1, hi]``."""
    j = tl.arange(0, F).to(tl.int64)
    return tl.minimum(tl.maximum(lo + ((hi - lo) * (j + 1)) // (F + 1), lo + 1), hi)


@triton.jit
def _row_stats(stats_ptr, r, S, BLOCK_S: tl.constexpr):
    """Row r's (max z, log-sum-exp of z, min z) from its chunks' (max, sum exp, min)."""
    c = tl.arange(0, BLOCK_S)
    ok = c < S
    base = (r * S + c) * 3
    m = tl.load(stats_ptr + base, mask=ok, other=float("-inf"))
    s = tl.load(stats_ptr + base + 1, mask=ok, other=0.0)
    mn = tl.load(stats_ptr + base + 2, mask=ok, other=float("inf"))
    mx, lse = merged_lse(m, s)
    return mx, lse, tl.min(mn, axis=0)


@triton.jit
def _narrow(lo, hi, cand, keep):
    """The interval after a pass: from the last candidate not kept to the first one kept
    (keep is monotone over the candidates: false ... false true ... true)."""
    return tl.max(tl.where(keep, lo, cand), axis=0), tl.min(tl.where(keep, cand, hi), axis=0)


@triton.jit
def _stats_kernel(logits_ptr, temp_ptr, stats_ptr, stride, V: tl.constexpr, CHUNK: tl.constexpr,
                  BLOCK: tl.constexpr):
    """Program (row r, chunk c): (max, sum exp relative to that max, min) of z = logits / T."""
    r = tl.program_id(0)
    c = tl.program_id(1)
    S = tl.num_programs(1)
    t = tl.load(temp_ptr + r)
    lane = tl.arange(0, BLOCK)
    m = tl.full([1], float("-inf"), tl.float32)
    mn = tl.full([1], float("inf"), tl.float32)
    s = tl.zeros([1], tl.float32)
    for j in range(0, CHUNK // BLOCK):
        v = c * CHUNK + j * BLOCK + lane
        ok = v < V
        z = tl.load(logits_ptr + r * stride + v, mask=ok, other=float("-inf")).to(tl.float32) / t
        m, s = online_max_sumexp(m, s, z)
        mn = tl.minimum(mn, tl.min(tl.where(ok, z, float("inf")), axis=0))
    o = (r * S + c) * 3 + tl.arange(0, 1)
    tl.store(stats_ptr + o, m)
    tl.store(stats_ptr + o + 1, s)
    tl.store(stats_ptr + o + 2, mn)


@triton.jit
def _fold_pass(r, S, topk_ptr, topp_ptr, state_ptr, above_k_ptr, above_p_ptr, total_ptr,
               F: tl.constexpr, BLOCK_S: tl.constexpr, HAS_K: tl.constexpr, HAS_P: tl.constexpr):
    """Row r's key intervals (lo_k, hi_k, lo_p, hi_p) after the pass whose interval state and
    per-chunk sums are given: its candidates again, their sums over the chunks, then narrowed."""
    lo_k = tl.load(state_ptr + r * 4)
    hi_k = tl.load(state_ptr + r * 4 + 1)
    lo_p = tl.load(state_ptr + r * 4 + 2)
    hi_p = tl.load(state_ptr + r * 4 + 3)
    c = tl.arange(0, BLOCK_S)
    f = tl.arange(0, F)
    ok = c < S
    rows = (r * S + c)[:, None] * F + f[None, :]
    if HAS_K:
        above = tl.sum(tl.load(above_k_ptr + rows, mask=ok[:, None], other=0), axis=0)
        lo_k, hi_k = _narrow(lo_k, hi_k, _candidates(lo_k, hi_k, F), above < tl.load(topk_ptr + r))
    if HAS_P:
        above = tl.sum(tl.load(above_p_ptr + rows, mask=ok[:, None], other=0.0), axis=0)
        total = tl.sum(tl.load(total_ptr + r * S + c, mask=ok, other=0.0), axis=0)
        lo_p, hi_p = _narrow(lo_p, hi_p, _candidates(lo_p, hi_p, F), above <= tl.load(topp_ptr + r) * total)
    return lo_k, hi_k, lo_p, hi_p


@triton.jit
def _chunk_sums(logits_ptr, r, c, stride, t, lse, xk, xp, above_k_out, above_p_out, total_out, S,
                V: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr, F: tl.constexpr,
                HAS_K: tl.constexpr, HAS_P: tl.constexpr):
    """Chunk c of row r: for each candidate, the count (top-k) and the mass (top-p) of the ids
    above it, and the chunk's total mass -> slot (r, c)."""
    lane = tl.arange(0, BLOCK)
    # per-lane sums over the chunk's blocks, reduced across lanes once at the end. The ids are the
    # last (contiguous) axis: the compiler spreads that axis over the threads, so each id's value
    # and exp live in one thread; as [BLOCK, F] each was held and exponentiated by 8 threads.
    above_k = tl.zeros([F, BLOCK], tl.int32)
    above_p = tl.zeros([F, BLOCK], tl.float32)
    total = tl.zeros([BLOCK], tl.float32)
    for j in range(0, CHUNK // BLOCK):
        v = c * CHUNK + j * BLOCK + lane
        ok = v < V
        z = tl.load(logits_ptr + r * stride + v, mask=ok, other=float("-inf")).to(tl.float32) / t
        if HAS_K:
            above_k += (z[None, :] > xk[:, None]).to(tl.int32)
        if HAS_P:
            p = tl.where(ok, tl.exp(z - lse), 0.0)
            total += p
            above_p += tl.where(z[None, :] > xp[:, None], p[None, :], 0.0)
    f = tl.arange(0, F)
    tl.store(above_k_out + (r * S + c) * F + f, tl.sum(above_k, axis=1))
    tl.store(above_p_out + (r * S + c) * F + f, tl.sum(above_p, axis=1))
    tl.store(total_out + r * S + c + tl.arange(0, 1), tl.sum(total, axis=0, keep_dims=True))


@triton.jit
def _pass_kernel(logits_ptr, temp_ptr, topk_ptr, topp_ptr, stats_ptr, state_in, above_k_in, above_p_in, total_in,
                 state_out, above_k_out, above_p_out, total_out, stride, S,
                 CPP: tl.constexpr, V: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr, F: tl.constexpr,
                 BLOCK_S: tl.constexpr, FIRST: tl.constexpr, HAS_K: tl.constexpr, HAS_P: tl.constexpr):
    """Program (row r, group g) of one search pass: the row's intervals (the first pass: every key
    from min z to max z; later ones: the previous pass folded in, group 0 records them), then chunks
    ``[g * CPP, (g + 1) * CPP)`` (`_chunk_sums`). A chunk's sums do not depend on CPP: grouping
    only spreads the interval work over fewer programs."""
    r = tl.program_id(0)
    grp = tl.program_id(1)
    zmax, lse, zmin = _row_stats(stats_ptr, r, S, BLOCK_S)
    if FIRST:
        lo_k = _order_key(zmin) - 1
        hi_k = _order_key(zmax)
        lo_p = lo_k
        hi_p = hi_k
    else:
        lo_k, hi_k, lo_p, hi_p = _fold_pass(r, S, topk_ptr, topp_ptr, state_in, above_k_in, above_p_in, total_in,
                                            F, BLOCK_S, HAS_K, HAS_P)
    first_group = grp == 0
    so = state_out + r * 4
    tl.store(so, lo_k, mask=first_group)
    tl.store(so + 1, hi_k, mask=first_group)
    tl.store(so + 2, lo_p, mask=first_group)
    tl.store(so + 3, hi_p, mask=first_group)
    xk = _key_value(_candidates(lo_k, hi_k, F))
    xp = _key_value(_candidates(lo_p, hi_p, F))
    t = tl.load(temp_ptr + r)
    for i in range(0, CPP):
        c = grp * CPP + i
        if c < S:
            _chunk_sums(logits_ptr, r, c, stride, t, lse, xk, xp, above_k_out, above_p_out, total_out, S,
                        V, CHUNK, BLOCK, F, HAS_K, HAS_P)


@triton.jit
def _threshold_kernel(topk_ptr, topp_ptr, minp_ptr, stats_ptr, state_in, above_k_in, above_p_in, total_in, thr_ptr,
                      S, V: tl.constexpr, F: tl.constexpr, BLOCK_S: tl.constexpr, SEARCH: tl.constexpr,
                      HAS_K: tl.constexpr, HAS_P: tl.constexpr, HAS_M: tl.constexpr):
    """Row r: the last pass folded in, each filter's bound (the smallest key it keeps), the largest
    of them -> ``thr[r]`` (-inf: no filter on for this row)."""
    r = tl.program_id(0)
    zmax, lse, zmin = _row_stats(stats_ptr, r, S, BLOCK_S)
    thr = float("-inf")
    if SEARCH:
        lo_k, hi_k, lo_p, hi_p = _fold_pass(r, S, topk_ptr, topp_ptr, state_in, above_k_in, above_p_in, total_in,
                                            F, BLOCK_S, HAS_K, HAS_P)
        if HAS_K:
            k = tl.load(topk_ptr + r)
            thr = tl.where((k > 0) & (k < V), tl.maximum(thr, _key_value(hi_k)), thr)
        if HAS_P:
            thr = tl.where(tl.load(topp_ptr + r) < 1.0, tl.maximum(thr, _key_value(hi_p)), thr)
    if HAS_M:
        min_p = tl.load(minp_ptr + r)
        thr = tl.where(min_p > 0.0, tl.maximum(thr, zmax + tl.log(tl.maximum(min_p, 1e-30))), thr)
    tl.store(thr_ptr + r, thr)


def chunks_per_program(rows: int, chunks: int, device: torch.device) -> int:
    """How many chunks a search program takes: one while the rows' chunks are few, more once they
    exceed ~4 programs per SM (each program folds the previous pass and the row's statistics
    first -- a few dependent loads -- then streams its chunks)."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(chunks, rows * chunks // (4 * sms)))


def filter_thresholds(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                      min_p: torch.Tensor, kinds: Tuple[bool, bool, bool] = (True, True, True),
                      group: Optional[int] = None) -> torch.Tensor:
    """Per row of ``logits [B, V]`` (fp32 or the model's 16-bit logits, upcast as read), the smallest
    ``logits / T`` its top-k / top-p / min-p keep: fp32 ``[B]``, -inf where no filter is on
    (``top_k <= 0`` or ``>= V``, ``top_p >= 1``, ``min_p <= 0``). ``kinds``: which of (top-k, top-p,
    min-p) any row has -- host knowledge; the others are compiled out. ``group``: chunks per search
    program (default `chunks_per_program`; the result does not depend on it)."""
    B, V = logits.shape
    logits = logits.contiguous()
    dev = logits.device
    has_k, has_p, has_m = (bool(x) for x in kinds)
    S = triton.cdiv(V, CHUNK)
    block_s = triton.next_power_of_2(S)
    stats = torch.empty(B, S, 3, dtype=torch.float32, device=dev)
    _stats_kernel[(B, S)](logits, temperature, stats, logits.stride(0), V=V, CHUNK=CHUNK, BLOCK=BLOCK)
    search = has_k or has_p
    passes = search_passes() if search else 0
    F = CANDIDATES
    # one slot per pass (no slot is written while another program of the same pass reads it)
    state = torch.empty(passes + 1, B, 4, dtype=torch.int64, device=dev)
    above_k = torch.empty(passes + 1, B, S, F, dtype=torch.int32, device=dev)
    above_p = torch.empty(passes + 1, B, S, F, dtype=torch.float32, device=dev)
    total = torch.empty(passes + 1, B, S, dtype=torch.float32, device=dev)
    cpp = group or chunks_per_program(B, S, dev)
    for i in range(passes):
        src = max(i - 1, 0)
        _pass_kernel[(B, triton.cdiv(S, cpp))](logits, temperature, top_k, top_p, stats, state[src], above_k[src],
                             above_p[src], total[src], state[i], above_k[i], above_p[i], total[i], logits.stride(0),
                             S, CPP=cpp, V=V, CHUNK=CHUNK, BLOCK=BLOCK, F=F, BLOCK_S=block_s, FIRST=i == 0,
                             HAS_K=has_k, HAS_P=has_p, num_warps=8)
    last = max(passes - 1, 0)
    thr = torch.empty(B, dtype=torch.float32, device=dev)
    _threshold_kernel[(B,)](top_k, top_p, min_p, stats, state[last], above_k[last], above_p[last], total[last], thr,
                            S, V=V, F=F, BLOCK_S=block_s, SEARCH=search, HAS_K=has_k, HAS_P=has_p, HAS_M=has_m)
    return thr
