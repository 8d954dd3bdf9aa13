"""Triton projections for a decode step's few rows, with the work around them folded in.

Why: at decode, a projection multiplies a handful of rows (M = 1..128) by a weight matrix, so its
time is the weight's bytes plus a fixed cost per kernel. cuBLAS pays that fixed cost more than
once at these sizes (a split-K GEMM and its reduce kernel, 4.4-8 us each on the H200 for bytes
that take ~1 us, benchmarks/RESULTS.md section 16), and the elementwise work between projections
costs a kernel of its own. Here each projection is one kernel that also does its neighbours' work:

- ``qkv_rope``: the q/k/v projection + bias, q/k RMSNorm (qwen3), RoPE, and the key/value cache
  write -- the rotation pairs columns ``j`` and ``j + D/2`` of a head, so one program computes both
  halves of its column block as two accumulators;
- ``gate_up_silu``: the gate/up projection + bias and ``silu(gate) * up``, gate and up columns of
  one block as two accumulators;
- ``linear_parts``: o_proj / down_proj split over K into fp32 partial sums (more programs reading
  the weight at once), summed in a fixed order by the next ``add_parts_rms_norm`` together with
  the bias, the residual add and the RMSNorm -- so the row-parallel output costs no reduce kernel.

Numerics follow the torch body op by op (``DecoderModel._layer``): q/k/v and gate/up round once
after their bias (``F.linear(x, w, b)``), o/down round before their bias and after it (the bias
is added after the TP all-reduce), RoPE and SiLU round where torch rounds. Only the order of the K reduction differs, as between any two GEMM kernels; the
split count depends on K only, never on how many rows the step has.

Every program loads its rows' whole K extent of the activations (a few KB at these M) and its
own column block of the weight; the weight is read once per M block, which at decode is once.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .kernels import _INTERPRET, rope_rotate, round_to

MAX_SPLITS = 8
SPLIT_MIN_K = 256     # a split reads at least this many of K (fewer: the fixed cost dominates)
PARTS_PROGRAMS = 256  # o/down: split K until about this many programs read the weight


@triton.jit
def _dot_block(acc, x_ptr, w_ptr, rows_m, m_mask, rows_n, n_mask, k_lo, K, stride_x, stride_w,
               LEN: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr, INTERPRET: tl.constexpr = _INTERPRET):
    """``acc += x[rows_m, k_lo:k_lo+LEN] @ w[rows_n, k_lo:k_lo+LEN]^T`` (fp32 accumulation), columns
    past K masked; LEN is a multiple of BLOCK_K (constant trip count: Triton's interpreter too)."""
    for k0 in range(0, LEN, BLOCK_K):
        kk = k_lo + k0 + tl.arange(0, BLOCK_K)
        km = kk < K
        x = tl.load(x_ptr + rows_m[:, None] * stride_x + kk[None, :], mask=m_mask[:, None] & km[None, :], other=0.0)
        w = tl.load(w_ptr + rows_n[:, None] * stride_w + kk[None, :], mask=n_mask[:, None] & km[None, :], other=0.0)
        if INTERPRET:   # Triton 3.5's interpreter multiplies 16-bit floats wrongly; the products are exact in fp32
            acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc)
        elif IEEE:
            acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    return acc


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
    k_lo = sp * K_SPLIT
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc = _dot_block(acc, x_ptr, w_ptr, rows, m_mask, cols, n_mask, k_lo, K, stride_x, stride_w,
                     K_SPLIT, BLOCK_K, IEEE)
    tl.store(part_ptr + (sp * M + rows[:, None]) * N + cols[None, :], acc, mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _parts_add_rms_kernel(part_ptr, b_ptr, x_ptr, w_ptr, h_ptr, M, H, eps, stride_x, stride_h,
                          SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """Row ``r``: ``y = sum_s part[s, r]`` (in split order) rounded, plus the bias (rounded);
    ``x[r] += y`` in place (rounded); ``h[r] = w * rmsnorm(x[r])``."""
    r = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    m = offs < H
    dt = x_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(SPLITS):
        acc += tl.load(part_ptr + (s * M + r) * H + offs, mask=m, other=0.0)
    y = round_to(acc, dt)
    if HAS_BIAS:
        y = round_to(y.to(tl.float32) + tl.load(b_ptr + offs, mask=m, other=0.0).to(tl.float32), dt)
    x = round_to(tl.load(x_ptr + r * stride_x + offs, mask=m, other=0.0).to(tl.float32) + y.to(tl.float32), dt)
    tl.store(x_ptr + r * stride_x + offs, x, mask=m)
    xf = x.to(tl.float32)
    normed = round_to(xf * tl.math.rsqrt(tl.sum(xf * xf, axis=0) / H + eps), dt)
    w = tl.load(w_ptr + offs, mask=m, other=0.0)
    tl.store(h_ptr + r * stride_h + offs, round_to(w.to(tl.float32) * normed.to(tl.float32), dt), mask=m)


@triton.jit
def _gate_up_silu_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, I, stride_x, stride_w, stride_o,
                         K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    """Program (column block j, row block): gate columns j and up columns I + j of the stacked
    ``[2I, K]`` weight, then ``out = silu(gate) * up`` (silu rounded before the product)."""
    K_PAD: tl.constexpr = (K + BLOCK_K - 1) // BLOCK_K * BLOCK_K
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask, n_mask = rows < M, cols < I
    dt = out_ptr.dtype.element_ty
    g = _dot_block(tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), x_ptr, w_ptr, rows, m_mask, cols, n_mask,
                   0, K, stride_x, stride_w, K_PAD, BLOCK_K, IEEE)
    u = _dot_block(tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), x_ptr, w_ptr, rows, m_mask, I + cols, n_mask,
                   0, K, stride_x, stride_w, K_PAD, BLOCK_K, IEEE)
    g = _biased(g, b_ptr, cols, n_mask, HAS_BIAS, dt).to(tl.float32)
    u = _biased(u, b_ptr, I + cols, n_mask, HAS_BIAS, dt).to(tl.float32)
    act = round_to(g / (1.0 + tl.exp(-g)), dt).to(tl.float32)
    tl.store(out_ptr + rows[:, None] * stride_o + cols[None, :], round_to(act * u, dt),
             mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _qkv_rope_kernel(x_ptr, w_ptr, b_ptr, pos_ptr, cos_ptr, sin_ptr, qn_ptr, kn_ptr, q_ptr, kc_ptr, vc_ptr,
                     M, stride_x, stride_w, stride_qb, stride_kr, stride_kh, stride_kp, stride_cs, NH, NKV, eps,
                     K: tl.constexpr, HALF: tl.constexpr, HAS_BIAS: tl.constexpr, QK_NORM: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    """Program (head h and column block j of its first half, row block): columns ``j`` and
    ``j + HALF`` of head h of the stacked ``[(NH + 2 NKV) * 2 HALF, K]`` q/k/v weight. A query head
    is rotated into ``q[rows, h]``; a key head rotated into the cache at (row, pos[row]); a value
    head copied there. QK_NORM (BLOCK_N == HALF: the whole head in one program) RMS-normalises
    each q/k head first."""
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
    x1 = _dot_block(tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), x_ptr, w_ptr, rows, m_mask, c1, n_all,
                    0, K, stride_x, stride_w, K_PAD, BLOCK_K, IEEE)
    x2 = _dot_block(tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), x_ptr, w_ptr, rows, m_mask, c2, n_all,
                    0, K, stride_x, stride_w, K_PAD, BLOCK_K, IEEE)
    x1 = _biased(x1, b_ptr, c1, n_all, HAS_BIAS, dt)
    x2 = _biased(x2, b_ptr, c2, n_all, HAS_BIAS, dt)
    p = tl.load(pos_ptr + rows, mask=m_mask, other=0)
    mask = m_mask[:, None] & n_all[None, :]
    if h < NH + NKV:
        f1 = x1.to(tl.float32)
        f2 = x2.to(tl.float32)
        if QK_NORM:   # qwen3: RMSNorm over each head before RoPE
            inv = tl.math.rsqrt((tl.sum(f1 * f1, axis=1) + tl.sum(f2 * f2, axis=1)) / (2 * HALF) + eps)
            if h < NH:
                w1 = tl.load(qn_ptr + j).to(tl.float32)
                w2 = tl.load(qn_ptr + HALF + j).to(tl.float32)
            else:
                w1 = tl.load(kn_ptr + j).to(tl.float32)
                w2 = tl.load(kn_ptr + HALF + j).to(tl.float32)
            f1 = round_to(w1[None, :] * round_to(f1 * inv[:, None], dt).to(tl.float32), dt).to(tl.float32)
            f2 = round_to(w2[None, :] * round_to(f2 * inv[:, None], dt).to(tl.float32), dt).to(tl.float32)
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


def _block_k(K: int) -> int:
    return min(128, max(16, triton.next_power_of_2(K)))


def splits_for(K: int, N: int, block_n: int = 32) -> int:
    """How many K ranges a row-parallel projection splits into: a power of two, each range at least
    SPLIT_MIN_K long, until about PARTS_PROGRAMS programs per row block. A function of the weight's
    shape only, so a row's sum is the same whatever else shares its step."""
    tiles = triton.cdiv(N, block_n)
    s = 1
    while s < MAX_SPLITS and K // (2 * s) >= SPLIT_MIN_K and tiles * s * 2 <= PARTS_PROGRAMS:
        s *= 2
    return s


def linear_parts(x: torch.Tensor, w: torch.Tensor, splits: Optional[int] = None, block_n: int = 32) -> torch.Tensor:
    """``x [M, K] @ w[N, K]^T`` as ``splits`` fp32 partial sums ``[splits, M, N]`` over K ranges
    (their sum in split order is the product; `add_parts_rms_norm` takes it as it is)."""
    M, K = x.shape
    N = w.shape[0]
    S = splits or splits_for(K, N, block_n)
    bk = _block_k(K)
    k_split = triton.cdiv(triton.cdiv(K, S), bk) * bk
    part = torch.empty(S, M, N, dtype=torch.float32, device=x.device)
    bm = _block_m(M)
    _linear_parts_kernel[(triton.cdiv(N, block_n), S, triton.cdiv(M, bm))](
        x, w, part, M, N, x.stride(0), w.stride(0), K=K, K_SPLIT=k_split, BLOCK_M=bm, BLOCK_N=block_n,
        BLOCK_K=bk, IEEE=x.dtype == torch.float32)
    return part


def parts_sum(part: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The product a `linear_parts` result stands for, in ``dtype`` (where its consumer is not
    `add_parts_rms_norm`: a TP all-reduce, an MoE layer's input)."""
    return part.sum(0).to(dtype)


def add_parts_rms_norm(x: torch.Tensor, part: torch.Tensor, bias: Optional[torch.Tensor], w: torch.Tensor,
                       eps: float) -> torch.Tensor:
    """``x += round(sum(part)) (+ bias)`` in place, then RMSNorm(x) * w -> a new ``[M, H]`` tensor."""
    M, H = x.shape
    h = torch.empty_like(x)
    _parts_add_rms_kernel[(M,)](part, bias if bias is not None else w, x, w, h, M, H, eps, x.stride(0), h.stride(0),
                                SPLITS=part.shape[0], HAS_BIAS=bias is not None, BLOCK=triton.next_power_of_2(H))
    return h


def gate_up_silu(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor], block_n: int = 32) -> torch.Tensor:
    """``x [M, K]`` through the stacked gate/up weight ``[2I, K]`` -> ``silu(gate) * up`` ``[M, I]``."""
    M, K = x.shape
    inter = w.shape[0] // 2
    out = torch.empty(M, inter, dtype=x.dtype, device=x.device)
    bm = _block_m(M)
    _gate_up_silu_kernel[(triton.cdiv(inter, block_n), triton.cdiv(M, bm))](
        x, w, bias if bias is not None else w, out, M, inter, x.stride(0), w.stride(0), out.stride(0), K=K,
        HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=block_n, BLOCK_K=_block_k(K), IEEE=x.dtype == torch.float32)
    return out


def qkv_rope(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor], pos: torch.Tensor, cos: torch.Tensor,
             sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, nh: int, nkv: int,
             q_norm: Optional[torch.Tensor] = None, k_norm: Optional[torch.Tensor] = None,
             eps: float = 0.0) -> torch.Tensor:
    """``x [M, K]`` through the stacked q/k/v weight -> rotated queries ``[M, nh, D]``; keys
    (rotated) and values go to row m, position ``pos[m]`` of the layer's caches
    ``[rows, nkv, max_len, D]``."""
    M, K = x.shape
    D = k_cache.shape[-1]
    half = D // 2
    norm = q_norm is not None
    block_n = half if norm else 16
    q = torch.empty(M, nh, D, dtype=x.dtype, device=x.device)
    bm = _block_m(M)
    _qkv_rope_kernel[((nh + 2 * nkv) * (half // block_n), triton.cdiv(M, bm))](
        x, w, bias if bias is not None else w, pos, cos, sin, q_norm if norm else w, k_norm if norm else w, q,
        k_cache, v_cache, M, x.stride(0), w.stride(0), q.stride(0), k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), cos.stride(0), nh, nkv, eps, K=K, HALF=half, HAS_BIAS=bias is not None,
        QK_NORM=norm, BLOCK_M=bm, BLOCK_N=block_n, BLOCK_K=_block_k(K), IEEE=x.dtype == torch.float32)
    return q


def supported(head_dim: int) -> bool:
    """Can `qkv_rope` serve this head size? (half a head is at least one 16-column dot block)"""
    return head_dim >= 32
