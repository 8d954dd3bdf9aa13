"""Triton projections for a decode step's few rows, with the work around them folded in.

Why: at decode, a projection multiplies a handful of rows (M = 1..128) by a weight matrix, so its
time is the weight's bytes plus a fixed cost per kernel; a profile of the decode step on the H200 saw
cuBLAS at 4.4-8 us per projection for bytes that take ~1 us, and the elementwise work between
projections costing a kernel of its own. Here each projection is one kernel that also does its
neighbours' work:

- ``qkv_rope``: the q/k/v projection + bias, q/k RMSNorm (qwen3), RoPE, and the key/value cache
  write -- the rotation pairs columns ``j`` and ``j + D/2`` of a head, so one program computes both
  halves of its column block as two accumulators;
- ``gate_up_silu``: the gate/up projection + bias and ``silu(gate) * up``, gate and up columns of
  one block as two accumulators over the same input tiles;
- ``linear_parts``: o_proj / down_proj split over K into fp32 partial sums (more programs reading
  the weight at once), summed in a fixed order by their consumer (`add_norm`, or a projection's
  `NormedInput` prologue) together with the bias and the residual add -- no reduce kernel.

Measured (benchmarks/RESULTS.md, decode and prefill kernel choices): about at parity with the cuBLAS
step (0.92-1.10x on an H100, batch 128 to 1), so
`DecoderModel` runs these only when asked (``decode_kernels = "triton-proj"``). Each program walks
K in dependent 128-column steps; passing cuBLAS needs more bytes in flight per SM.

Numerics follow the torch body op by op (``DecoderModel._layer``): q/k/v and gate/up round once
after their bias (``F.linear(x, w, b)``), o/down round before their bias and after it (the bias
is added after the TP all-reduce), RoPE and SiLU round where torch rounds. Only the order of
reductions differs (K, the norms' sums of squares), as between any two GEMM kernels; the split
count depends on the weight's shape only, never on how many rows the step has.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from .kernels import _INTERPRET, head_rms_norm, rope_rotate, round_to

MAX_SPLITS = 8
SPLIT_MIN_K = 256     # a split reads at least this many of K (fewer: the fixed cost dominates)
PARTS_PROGRAMS = 256  # o/down: split K until about this many programs read the weight
# Up to this many rows (at most 16) a projection makes its RMSNorm input itself; 0: the separate
# `add_norm` kernel always. Off by default: every program of the projection re-reads the rows' x and
# branch parts, twice, one dependent load after another -- 0.60-0.75x cuBLAS where the separate
# kernel gives 0.96-1.02x (benchmarks/RESULTS.md, decode and prefill kernel choices).
NORM_PROLOGUE_ROWS = int(os.environ.get("MEGARL_DECODE_NORM_PROLOGUE_ROWS", "0"))


@triton.jit
def _mma(acc, x, w, IEEE: tl.constexpr, INTERPRET: tl.constexpr = _INTERPRET):
    """``acc += x @ w^T`` in fp32."""
    if INTERPRET:   # Triton 3.5's interpreter multiplies 16-bit floats wrongly; the products are exact in fp32
        acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc)
    elif IEEE:
        acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
    else:
        acc = tl.dot(x, tl.trans(w), acc)
    return acc


@triton.jit
def _residual(x_ptr, part_ptr, pb_ptr, rows, m_mask, kk, km, M, K, stride_x,
              SPLITS: tl.constexpr, HAS_PB: tl.constexpr, dt: tl.constexpr):
    """fp32 values of ``x + y`` on a tile, rounded as torch's body rounds: ``y`` is the sum of
    SPLITS partial products ``part[s, rows, kk]`` in split order, rounded, plus its bias (rounded);
    SPLITS 0: no branch to add."""
    mask = m_mask[:, None] & km[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_x + kk[None, :], mask=mask, other=0.0).to(tl.float32)
    if SPLITS > 0:
        acc = tl.zeros_like(x)
        for s in tl.static_range(SPLITS):
            acc += tl.load(part_ptr + (s * M + rows[:, None]) * K + kk[None, :], mask=mask, other=0.0).to(tl.float32)
        y = round_to(acc, dt).to(tl.float32)
        if HAS_PB:
            y = round_to(y + tl.load(pb_ptr + kk, mask=km, other=0.0).to(tl.float32)[None, :], dt).to(tl.float32)
        x = round_to(x + y, dt).to(tl.float32)
    return x


@triton.jit
def _add_rms_rows(x_ptr, part_ptr, pb_ptr, xo_ptr, rows, m_mask, write, M, K, stride_x, stride_o, eps,
                  SPLITS: tl.constexpr, HAS_PB: tl.constexpr, LEN: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_K: tl.constexpr, dt: tl.constexpr):
    """First pass of an RMSNorm over ``x + y`` (`_residual`): stores ``x + y`` to ``xo`` where
    ``write``, returns each row's ``rsqrt(mean((x + y)^2) + eps)``."""
    sq = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, LEN, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        km = kk < K
        x = _residual(x_ptr, part_ptr, pb_ptr, rows, m_mask, kk, km, M, K, stride_x, SPLITS, HAS_PB, dt)
        tl.store(xo_ptr + rows[:, None] * stride_o + kk[None, :], x.to(dt), mask=m_mask[:, None] & km[None, :] & write)
        sq += x * x
    return tl.math.rsqrt(tl.sum(sq, axis=1) / K + eps)


@triton.jit
def _normed(x, nw_ptr, kk, km, inv, dt: tl.constexpr):
    """RMSNorm's output on a tile: ``w * (x * inv).to(dt)``, rounded as ``model._rms`` rounds."""
    nw = tl.load(nw_ptr + kk, mask=km, other=0.0).to(tl.float32)
    return round_to(nw[None, :] * round_to(x * inv[:, None], dt).to(tl.float32), dt)


@triton.jit
def _dot_pair(acc_a, acc_b, x_ptr, w_ptr, rows_m, m_mask, rows_a, rows_b, n_mask, k_lo, K, stride_x, stride_w,
              part_ptr, pb_ptr, nw_ptr, inv, M,
              PAIR: tl.constexpr, NORM: tl.constexpr, SPLITS: tl.constexpr, HAS_PB: tl.constexpr,
              LEN: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr, dt: tl.constexpr):
    """``acc_a += x[rows_m, k_lo:k_lo+LEN] @ w[rows_a, ...]^T`` and, with PAIR, ``acc_b`` over
    ``rows_b`` from the same x tiles (fp32 accumulation; columns past K masked; LEN a multiple of
    BLOCK_K, a constant trip count). NORM: x is not in memory but RMSNorm(x + y) * w, made tile by
    tile from the residual and the branch's partial sums (`_residual`, `_normed`; ``inv`` from
    `_add_rms_rows`)."""
    for k0 in range(0, LEN, BLOCK_K):
        kk = k_lo + k0 + tl.arange(0, BLOCK_K)
        km = kk < K
        if NORM:
            xr = _residual(x_ptr, part_ptr, pb_ptr, rows_m, m_mask, kk, km, M, K, stride_x, SPLITS, HAS_PB, dt)
            x = _normed(xr, nw_ptr, kk, km, inv, dt)
        else:
            x = tl.load(x_ptr + rows_m[:, None] * stride_x + kk[None, :], mask=m_mask[:, None] & km[None, :],
                        other=0.0)
        wa = tl.load(w_ptr + rows_a[:, None] * stride_w + kk[None, :], mask=n_mask[:, None] & km[None, :], other=0.0)
        acc_a = _mma(acc_a, x, wa, IEEE)
        if PAIR:
            wb = tl.load(w_ptr + rows_b[:, None] * stride_w + kk[None, :], mask=n_mask[:, None] & km[None, :],
                         other=0.0)
            acc_b = _mma(acc_b, x, wb, IEEE)
    return acc_a, acc_b


@triton.jit
def _biased(acc, b_ptr, cols, n_mask, HAS_BIAS: tl.constexpr, dt: tl.constexpr):
    """``F.linear(x, w, b)``'s output: the bias added to the fp32 sum, rounded to the model dtype
    once (addmm's beta * C term)."""
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=n_mask, other=0.0)[None, :].to(tl.float32)
    return round_to(acc, dt)


@triton.jit
def _linear_parts_kernel(x_ptr, w_ptr, part_ptr, M, N, stride_x, stride_w,
                         K: tl.constexpr, K_SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    """Program (column block, K split, row block): ``part[split, rows, cols]`` (fp32) = the rows
    times the columns' weights over ``[split * K_SPLIT, ...)``."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    sp = tl.program_id(1)
    rows = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask, n_mask = rows < M, cols < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc, _ = _dot_pair(acc, acc, x_ptr, w_ptr, rows, m_mask, cols, cols, n_mask, sp * K_SPLIT, K, stride_x, stride_w,
                       x_ptr, x_ptr, x_ptr, acc, M, PAIR=False, NORM=False, SPLITS=0, HAS_PB=False, LEN=K_SPLIT,
                       BLOCK_K=BLOCK_K, IEEE=IEEE, dt=tl.float32)
    tl.store(part_ptr + (sp * M + rows[:, None]) * N + cols[None, :], acc, mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _parts_add_rms_kernel(x_ptr, part_ptr, pb_ptr, nw_ptr, xo_ptr, h_ptr, M, eps, stride_x, stride_xo, stride_h,
                          H: tl.constexpr, SPLITS: tl.constexpr, HAS_PB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """Row block: ``xo = x + y`` and ``h = w * rmsnorm(x + y)`` -- the arithmetic of a
    projection's NORM prologue (`_add_rms_rows`, `_residual`, `_normed`), for consumers that need
    ``h`` in memory (M above NORM_PROLOGUE_ROWS, an MoE layer, the LM head). Nothing is read after
    it is written: the second pass recomputes ``x + y``."""
    LEN: tl.constexpr = (H + BLOCK_K - 1) // BLOCK_K * BLOCK_K
    dt = h_ptr.dtype.element_ty
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = rows < M
    inv = _add_rms_rows(x_ptr, part_ptr, pb_ptr, xo_ptr, rows, m_mask, True, M, H, stride_x, stride_xo, eps,
                        SPLITS, HAS_PB, LEN, BLOCK_M, BLOCK_K, dt)
    for k0 in range(0, LEN, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        km = kk < H
        x = _residual(x_ptr, part_ptr, pb_ptr, rows, m_mask, kk, km, M, H, stride_x, SPLITS, HAS_PB, dt)
        tl.store(h_ptr + rows[:, None] * stride_h + kk[None, :], _normed(x, nw_ptr, kk, km, inv, dt),
                 mask=m_mask[:, None] & km[None, :])


@triton.jit
def _gate_up_silu_kernel(x_ptr, w_ptr, b_ptr, out_ptr, part_ptr, pb_ptr, nw_ptr, xo_ptr, M, I, stride_x, stride_w,
                         stride_o, stride_xo, eps,
                         K: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr, SPLITS: tl.constexpr,
                         HAS_PB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         IEEE: tl.constexpr):
    """Program (column block j, row block): gate columns j and up columns I + j of the stacked
    ``[2I, K]`` weight, then ``out = silu(gate) * up`` (silu rounded before the product). NORM:
    the input is RMSNorm(x + y) * w, made here (the first column block stores x + y to ``xo``)."""
    K_PAD: tl.constexpr = (K + BLOCK_K - 1) // BLOCK_K * BLOCK_K
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask, n_mask = rows < M, cols < I
    dt = out_ptr.dtype.element_ty
    inv = tl.zeros([BLOCK_M], dtype=tl.float32)
    if NORM:
        inv = _add_rms_rows(x_ptr, part_ptr, pb_ptr, xo_ptr, rows, m_mask, tl.program_id(0) == 0, M, K, stride_x,
                            stride_xo, eps, SPLITS, HAS_PB, K_PAD, BLOCK_M, BLOCK_K, dt)
    g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    g, u = _dot_pair(g, g, x_ptr, w_ptr, rows, m_mask, cols, I + cols, n_mask, 0, K, stride_x, stride_w,
                     part_ptr, pb_ptr, nw_ptr, inv, M, True, NORM, SPLITS, HAS_PB, K_PAD, BLOCK_K, IEEE, dt)
    g = _biased(g, b_ptr, cols, n_mask, HAS_BIAS, dt).to(tl.float32)
    u = _biased(u, b_ptr, I + cols, n_mask, HAS_BIAS, dt).to(tl.float32)
    act = round_to(g / (1.0 + tl.exp(-g)), dt).to(tl.float32)
    tl.store(out_ptr + rows[:, None] * stride_o + cols[None, :], round_to(act * u, dt),
             mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _qkv_rope_kernel(x_ptr, w_ptr, b_ptr, pos_ptr, cos_ptr, sin_ptr, qn_ptr, kn_ptr, q_ptr, kc_ptr, vc_ptr,
                     part_ptr, pb_ptr, nw_ptr, xo_ptr,
                     M, stride_x, stride_w, stride_qb, stride_kr, stride_kh, stride_kp, stride_cs, stride_xo,
                     NH, NKV, eps,
                     K: tl.constexpr, HALF: tl.constexpr, HAS_BIAS: tl.constexpr, QK_NORM: tl.constexpr,
                     NORM: tl.constexpr, SPLITS: tl.constexpr, HAS_PB: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    """Program (head h and column block j of its first half, row block): columns ``j`` and
    ``j + HALF`` of head h of the stacked ``[(NH + 2 NKV) * 2 HALF, K]`` q/k/v weight. A query head
    is rotated into ``q[rows, h]``; a key head rotated into the cache at (row, pos[row]); a value
    head copied there. QK_NORM (BLOCK_N == HALF: the whole head in one program) RMS-normalises
    each q/k head first. NORM: the input is RMSNorm(x + y) * w, made here (program 0 stores x + y
    to ``xo``)."""
    per_head: tl.constexpr = HALF // BLOCK_N
    K_PAD: tl.constexpr = (K + BLOCK_K - 1) // BLOCK_K * BLOCK_K
    h = tl.program_id(0) // per_head
    j = (tl.program_id(0) % per_head) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = rows < M
    n_all = j < HALF
    dt = q_ptr.dtype.element_ty
    c1 = h * (2 * HALF) + j
    c2 = c1 + HALF
    inv = tl.zeros([BLOCK_M], dtype=tl.float32)
    if NORM:
        inv = _add_rms_rows(x_ptr, part_ptr, pb_ptr, xo_ptr, rows, m_mask, tl.program_id(0) == 0, M, K, stride_x,
                            stride_xo, eps, SPLITS, HAS_PB, K_PAD, BLOCK_M, BLOCK_K, dt)
    x1 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    x1, x2 = _dot_pair(x1, x1, x_ptr, w_ptr, rows, m_mask, c1, c2, n_all, 0, K, stride_x, stride_w,
                       part_ptr, pb_ptr, nw_ptr, inv, M, True, NORM, SPLITS, HAS_PB, K_PAD, BLOCK_K, IEEE, dt)
    x1 = _biased(x1, b_ptr, c1, n_all, HAS_BIAS, dt)
    x2 = _biased(x2, b_ptr, c2, n_all, HAS_BIAS, dt)
    p = tl.load(pos_ptr + rows, mask=m_mask, other=0)
    mask = m_mask[:, None] & n_all[None, :]
    if h < NH + NKV:
        f1 = x1.to(tl.float32)
        f2 = x2.to(tl.float32)
        if QK_NORM:   # qwen3: RMSNorm over each head before RoPE
            if h < NH:
                w1 = tl.load(qn_ptr + j).to(tl.float32)
                w2 = tl.load(qn_ptr + HALF + j).to(tl.float32)
            else:
                w1 = tl.load(kn_ptr + j).to(tl.float32)
                w2 = tl.load(kn_ptr + HALF + j).to(tl.float32)
            f1, f2 = head_rms_norm(f1, f2, w1[None, :], w2[None, :], eps, HALF, 1, dt)
        c = tl.load(cos_ptr + p[:, None] * stride_cs + j[None, :], mask=mask, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + p[:, None] * stride_cs + j[None, :], mask=mask, other=0.0).to(tl.float32)
        o1, o2 = rope_rotate(f1, f2, c, s, dt)
        if h < NH:
            dst = q_ptr + rows[:, None] * stride_qb + h * (2 * HALF) + j[None, :]
            tl.store(dst, o1, mask=mask)
            tl.store(dst + HALF, o2, mask=mask)
        else:
            dst = kc_ptr + rows[:, None] * stride_kr + (h - NH) * stride_kh + p[:, None] * stride_kp + j[None, :]
            tl.store(dst, o1, mask=mask)
            tl.store(dst + HALF, o2, mask=mask)
    else:
        dst = vc_ptr + rows[:, None] * stride_kr + (h - NH - NKV) * stride_kh + p[:, None] * stride_kp + j[None, :]
        tl.store(dst, x1, mask=mask)
        tl.store(dst + HALF, x2, mask=mask)


def _block_m(M: int) -> int:
    """Rows per program: the step's rows in one block up to 64 (the weight is read once)."""
    return min(64, max(16, triton.next_power_of_2(M)))


BLOCK_K_MAX = 128     # columns of K per step of a projection's K walk


def _block_k(K: int) -> int:
    return min(BLOCK_K_MAX, max(16, triton.next_power_of_2(K)))


def splits_for(K: int, N: int, block_n: int = 32) -> int:
    """How many K ranges a row-parallel projection splits into: a power of two, each range at least
    SPLIT_MIN_K long, until about PARTS_PROGRAMS programs per row block. A function of the weight's
    shape only, so a row's sum is the same whatever else shares its step."""
    tiles = triton.cdiv(N, block_n)
    s = 1
    while s < MAX_SPLITS and K // (2 * s) >= SPLIT_MIN_K and tiles * s * 2 <= PARTS_PROGRAMS:
        s *= 2
    return s


def linear_parts(x: torch.Tensor, w: torch.Tensor, splits: Optional[int] = None, block_n: int = 32,
                 num_warps: int = 4, block_m: Optional[int] = None) -> torch.Tensor:
    """``x [M, K] @ w[N, K]^T`` as ``splits`` fp32 partial sums ``[splits, M, N]`` over K ranges
    (their sum in split order is the product; a `NormedInput` takes it as it is)."""
    M, K = x.shape
    N = w.shape[0]
    S = splits or splits_for(K, N, block_n)
    bk = _block_k(K)
    k_split = triton.cdiv(triton.cdiv(K, S), bk) * bk
    part = torch.empty(S, M, N, dtype=torch.float32, device=x.device)
    bm = block_m or _block_m(M)
    _linear_parts_kernel[(triton.cdiv(N, block_n), S, triton.cdiv(M, bm))](
        x, w, part, M, N, x.stride(0), w.stride(0), K=K, K_SPLIT=k_split, BLOCK_M=bm, BLOCK_N=block_n,
        BLOCK_K=bk, IEEE=x.dtype == torch.float32, num_warps=num_warps)
    return part


def parts_sum(part: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The product a `linear_parts` result stands for, in ``dtype`` (where its consumer is not a
    `NormedInput`: a TP all-reduce)."""
    return part.sum(0).to(dtype)


@dataclass
class NormedInput:
    """A projection input given as ``RMSNorm(x + y) * weight`` rather than as a tensor: the kernel
    that consumes it makes it tile by tile and writes the new residual ``x + y`` to ``x_out``.
    ``y`` is ``parts`` -- `linear_parts` sums ``[S, M, H]`` (a dense ``[M, H]`` branch output is
    one part), or None (nothing to add) -- plus ``bias`` (added after the sum, as after a TP
    all-reduce)."""
    x: torch.Tensor
    parts: Optional[torch.Tensor]
    bias: Optional[torch.Tensor]
    weight: torch.Tensor
    eps: float
    x_out: Optional[torch.Tensor] = None

    def launch_args(self) -> Tuple[tuple, dict]:
        """(pointer args: x, parts, bias, weight, x_out) and constexprs, with ``x_out`` allocated."""
        self.x_out = torch.empty_like(self.x)
        parts = self.parts
        if parts is not None and parts.dim() == 2:
            parts = parts[None]
        assert parts is None or (parts.shape[1:] == self.x.shape and parts.is_contiguous()), "parts [S, M, H]"
        args = (self.x, parts if parts is not None else self.x, self.bias if self.bias is not None else self.weight,
                self.weight, self.x_out)
        return args, dict(SPLITS=0 if parts is None else parts.shape[0], HAS_PB=self.bias is not None)


def add_norm(inp: NormedInput) -> torch.Tensor:
    """``h = RMSNorm(x + y) * w`` into memory (``inp.x_out`` = x + y)."""
    M, H = inp.x.shape
    (x, part, pb, nw, xo), const = inp.launch_args()
    h = torch.empty_like(x)
    # one row per program, the whole row in one block: each pass is one round of loads (four rows
    # per program in 128-column steps took 10.6 us on the H200 at 32 rows)
    _parts_add_rms_kernel[(M,)](x, part, pb, nw, xo, h, M, inp.eps, x.stride(0), xo.stride(0), h.stride(0), H=H,
                                BLOCK_M=1, BLOCK_K=triton.next_power_of_2(H), num_warps=4, **const)
    return h


def projection_input(inp: NormedInput):
    """What a projection of ``inp`` takes: ``inp`` itself where its kernel makes the norm in its
    prologue (at most NORM_PROLOGUE_ROWS rows: one row block, so the norm is made once per column
    block), else ``h`` made by `add_norm` first. Either way ``inp.x_out`` is the new residual
    once the projection ran."""
    return inp if inp.x.shape[0] <= min(NORM_PROLOGUE_ROWS, 16) else add_norm(inp)


def _input_args(inp, M: int):
    """Kernel args for a projection input: a tensor, or a `NormedInput` made in the kernel."""
    if isinstance(inp, NormedInput):
        assert M <= 16, "a NormedInput prologue serves one row block of 16"
        (x, part, pb, nw, xo), const = inp.launch_args()
        return (x, part, pb, nw, xo), xo.stride(0), dict(NORM=True, **const)
    return (inp, inp, inp, inp, inp), 0, dict(NORM=False, SPLITS=0, HAS_PB=False)


def gate_up_silu(inp, w: torch.Tensor, bias: Optional[torch.Tensor], block_n: int = 32,
                 num_warps: int = 4, block_m: Optional[int] = None) -> torch.Tensor:
    """``inp [M, K]`` (a tensor or a `NormedInput`) through the stacked gate/up weight ``[2I, K]``
    -> ``silu(gate) * up`` ``[M, I]``."""
    x0 = inp.x if isinstance(inp, NormedInput) else inp
    M, K = x0.shape
    inter = w.shape[0] // 2
    (x, part, pb, nw, xo), stride_xo, const = _input_args(inp, M)
    eps = inp.eps if isinstance(inp, NormedInput) else 0.0
    out = torch.empty(M, inter, dtype=x.dtype, device=x.device)
    bm = 16 if isinstance(inp, NormedInput) else (block_m or _block_m(M))
    _gate_up_silu_kernel[(triton.cdiv(inter, block_n), triton.cdiv(M, bm))](
        x, w, bias if bias is not None else w, out, part, pb, nw, xo, M, inter, x.stride(0), w.stride(0),
        out.stride(0), stride_xo, eps, K=K, HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=block_n,
        BLOCK_K=_block_k(K), IEEE=x.dtype == torch.float32, num_warps=num_warps, **const)
    return out


def qkv_rope(inp, w: torch.Tensor, bias: Optional[torch.Tensor], pos: torch.Tensor, cos: torch.Tensor,
             sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, nh: int, nkv: int,
             q_norm: Optional[torch.Tensor] = None, k_norm: Optional[torch.Tensor] = None,
             eps: float = 0.0, block_n: int = 16, num_warps: int = 4, block_m: Optional[int] = None) -> torch.Tensor:
    """``inp [M, K]`` (a tensor or a `NormedInput`) through the stacked q/k/v weight -> rotated
    queries ``[M, nh, D]``; keys (rotated) and values go to row m, position ``pos[m]`` of the
    layer's caches ``[rows, nkv, max_len, D]``."""
    x0 = inp.x if isinstance(inp, NormedInput) else inp
    M, K = x0.shape
    D = k_cache.shape[-1]
    half = D // 2
    norm = q_norm is not None
    block_n = half if norm else min(block_n, half)   # q/k norm: the whole head in one program
    if isinstance(inp, NormedInput):
        if norm and inp.eps != eps:
            raise ValueError(f"one eps serves the input norm and q/k norm: {inp.eps} != {eps}")
        eps = inp.eps
    (x, part, pb, nw, xo), stride_xo, const = _input_args(inp, M)
    q = torch.empty(M, nh, D, dtype=x.dtype, device=x.device)
    bm = 16 if isinstance(inp, NormedInput) else (block_m or _block_m(M))
    _qkv_rope_kernel[((nh + 2 * nkv) * (half // block_n), triton.cdiv(M, bm))](
        x, w, bias if bias is not None else w, pos, cos, sin, q_norm if norm else w, k_norm if norm else w, q,
        k_cache, v_cache, part, pb, nw, xo, M, x.stride(0), w.stride(0), q.stride(0), k_cache.stride(0),
        k_cache.stride(1), k_cache.stride(2), cos.stride(0), stride_xo, nh, nkv, eps, K=K, HALF=half,
        HAS_BIAS=bias is not None, QK_NORM=norm, BLOCK_M=bm, BLOCK_N=block_n, BLOCK_K=_block_k(K),
        IEEE=x.dtype == torch.float32, num_warps=num_warps, **const)
    return q


def supported(head_dim: int) -> bool:
    """Can `qkv_rope` serve this head size? (half a head is at least one 16-column dot block)"""
    return head_dim >= 32
