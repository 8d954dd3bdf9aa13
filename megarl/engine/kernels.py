"""Triton kernels of the embedded engine's fused decode step (`fused_decode.py`).

Why: a decode step of a small model is ~37 tiny kernels per layer in plain torch (RMSNorm alone
is six, RoPE ten); inside a CUDA graph each still costs a few microseconds, so the step was
launch-bound at 6% of the memory-bandwidth bound (benchmarks/RESULTS.md, sections 2 and 8). These
kernels fold each elementwise chain into one kernel and replace attention over the padded key
length with a split-K flash-decoding kernel that reads only the positions each row holds.

Numerics follow the torch path op by op (fp32 math, rounded to the model dtype where torch rounds):
RMSNorm is ``w * (x * rsqrt(mean(x^2) + eps)).to(dtype)``, RoPE is ``x*cos + rotate_half(x)*sin``
with each product rounded, SiLU-and-mul rounds ``silu(g)`` before the product. Only reduction
orders differ (the norm's mean, attention's softmax), as they do between any two kernels.

The same kernels run on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``), which is
how the tests check them against the torch path on a machine without a GPU.
"""
from __future__ import annotations

import os
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"   # kernels run on CPU tensors (tests)


@triton.jit
def _add_rms_kernel(x_ptr, y_ptr, w_ptr, h_ptr, H, eps, stride_x, stride_y, stride_h,
                    HAS_Y: tl.constexpr, BLOCK: tl.constexpr):
    """Row ``r``: ``x[r] += y[r]`` (in place, rounded to x's dtype) when HAS_Y, then
    ``h[r] = w * rmsnorm(x[r])`` (row offsets in int64, as in `_silu_mul_kernel`)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    m = offs < H
    x = tl.load(x_ptr + row * stride_x + offs, mask=m, other=0.0)
    if HAS_Y:
        y = tl.load(y_ptr + row * stride_y + offs, mask=m, other=0.0)
        x = (x.to(tl.float32) + y.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(x_ptr + row * stride_x + offs, x, mask=m)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / H
    normed = (xf * tl.math.rsqrt(var + eps)).to(h_ptr.dtype.element_ty)
    w = tl.load(w_ptr + offs, mask=m, other=0.0)
    tl.store(h_ptr + row * stride_h + offs, (w.to(tl.float32) * normed.to(tl.float32)).to(h_ptr.dtype.element_ty),
             mask=m)


@triton.jit
def round_to(x, dt: tl.constexpr, INTERPRET: tl.constexpr = _INTERPRET):
    """fp32 ``x`` rounded to ``dt`` to nearest even, as compiled Triton (and torch) round. Spelled
    out for bf16 under Triton's interpreter, which truncates there: the CPU tests then check the
    kernels' bf16 rounding against torch's own."""
    if INTERPRET and dt == tl.bfloat16:
        b = x.to(tl.uint32, bitcast=True)
        x = ((b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    return x.to(dt)


@triton.jit
def head_rms_norm(x1, x2, w1, w2, eps, HALF: tl.constexpr, AXIS: tl.constexpr, dt: tl.constexpr):
    """qwen3's q/k RMSNorm of a head given as its halves of HALF (fp32; AXIS 0: one head, 1: a head
    per row): ``w * (x * rsqrt(mean(x^2) + eps)).to(dt)``, rounded as torch's body rounds -> fp32."""
    inv = tl.math.rsqrt((tl.sum(x1 * x1, axis=AXIS) + tl.sum(x2 * x2, axis=AXIS)) / (2 * HALF) + eps)
    if AXIS == 1:
        inv = tl.expand_dims(inv, 1)
    return (round_to(w1 * round_to(x1 * inv, dt).to(tl.float32), dt).to(tl.float32),
            round_to(w2 * round_to(x2 * inv, dt).to(tl.float32), dt).to(tl.float32))


@triton.jit
def rope_rotate(x1, x2, c, s, dt: tl.constexpr):
    """RoPE on a head's halves (fp32 in, ``dt`` out): ``x*cos + rotate_half(x)*sin`` with
    ``rotate_half(x) = (-x2, x1)``, each product rounded to ``dt`` as torch's body rounds it."""
    o1 = round_to(round_to(x1 * c, dt).to(tl.float32) + round_to(-x2 * s, dt).to(tl.float32), dt)
    o2 = round_to(round_to(x2 * c, dt).to(tl.float32) + round_to(x1 * s, dt).to(tl.float32), dt)
    return o1, o2


@triton.jit
def _rope_store_kernel(qkv_ptr, pos_ptr, row_ptr, cos_ptr, sin_ptr, qn_ptr, kn_ptr, q_ptr, kc_ptr, vc_ptr,
                       stride_qkv, stride_qb, stride_kr, stride_kh, stride_kp, stride_cs, NH, NKV, eps,
                       HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_KV: tl.constexpr, QK_NORM: tl.constexpr,
                       HAS_ROWS: tl.constexpr):
    """Program b (token b): its query heads, q-normed (qwen3) and rotated at position ``pos[b]``, into
    ``q[b]``; its key heads, rotated, into the cache at row b (HAS_ROWS: row ``rows[b]``, a prefill's
    token b; -1: not stored), position pos[b], the value heads copied beside them. Every head of a
    token is one tile: one program per token and head took 6-7x its bytes at a 4096-token prefill,
    and this layout took 0.90x the admission time at 32 x 512 tokens, the same at the other sizes
    measured (H100, benchmarks/RESULTS.md sections 30-31). (Token offsets in int64, as in
    `_silu_mul_kernel`.)"""
    b = tl.program_id(0).to(tl.int64)
    p = tl.load(pos_ptr + b)
    dt = q_ptr.dtype.element_ty
    src = qkv_ptr + b * stride_qkv
    dd = tl.arange(0, 2 * HALF)
    hq = tl.arange(0, BLOCK_H)
    qm = hq < NH
    q = _rotated_heads(src, cos_ptr, sin_ptr, qn_ptr, p, hq, qm, stride_cs, eps, BLOCK_H, HALF, QK_NORM, dt)
    tl.store(q_ptr + b * stride_qb + hq[:, None] * (2 * HALF) + dd[None, :], q, mask=qm[:, None])
    r = b
    if HAS_ROWS:
        r = tl.load(row_ptr + b)
    if r >= 0:   # row -1: a padding sequence of a captured prefill bucket, nothing stored
        hk = tl.arange(0, BLOCK_KV)
        km = hk < NKV
        k = _rotated_heads(src + NH * (2 * HALF), cos_ptr, sin_ptr, kn_ptr, p, hk, km, stride_cs, eps, BLOCK_KV,
                           HALF, QK_NORM, dt)
        dst = r * stride_kr + hk[:, None] * stride_kh + p * stride_kp + dd[None, :]
        tl.store(kc_ptr + dst, k, mask=km[:, None])
        v = tl.load(src + (NH + NKV + hk[:, None]) * (2 * HALF) + dd[None, :], mask=km[:, None], other=0.0)
        tl.store(vc_ptr + dst, v, mask=km[:, None])


@triton.jit
def _attend_block(q, kc_ptr, vc_ptr, base, n0, end, stride_kp, scale, m_i, l_i, acc,
                  D: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    """One block of keys ``[n0, n0 + BLOCK_N)`` (masked at ``end``) into the online softmax. (Loading
    the values with the keys, before the scores, measured no faster on the H100: benchmarks/RESULTS.md,
    decode and prefill kernel choices.)"""
    n = n0 + tl.arange(0, BLOCK_N)
    d = tl.arange(0, D)
    nm = n < end
    k = tl.load(kc_ptr + base + n[:, None] * stride_kp + d[None, :], mask=nm[:, None], other=0.0)
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = tl.where(nm[None, :], s * scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)   # a block with no key yet: no -inf - -inf
    alpha = tl.exp(m_i - m_ref)
    p = tl.exp(s - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = tl.load(vc_ptr + base + n[:, None] * stride_kp + d[None, :], mask=nm[:, None], other=0.0)
    if IEEE:
        pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc * alpha[:, None] + pv


@triton.jit
def _rotated_heads(q_ptr, cos_ptr, sin_ptr, qn_ptr, p, heads, gm, stride_cs, eps,
                   BLOCK_G: tl.constexpr, HALF: tl.constexpr, QK_NORM: tl.constexpr, dt: tl.constexpr):
    """Heads ``heads`` (masked by ``gm``) of one token's queries or keys, straight from the q/k/v
    projection (``q_ptr`` at the first of them), RMS-normed with ``qn_ptr``'s weights (QK_NORM:
    qwen3) and rotated at position ``p`` -> ``[BLOCK_G, 2 HALF]`` in ``dt``. The attention kernel
    rotates its query group with it, `_rope_store_kernel` a token's query and key heads."""
    j = tl.arange(0, HALF)
    src = q_ptr + heads[:, None] * (2 * HALF) + j[None, :]
    x1 = tl.load(src, mask=gm[:, None], other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=gm[:, None], other=0.0).to(tl.float32)
    if QK_NORM:
        x1, x2 = head_rms_norm(x1, x2, tl.load(qn_ptr + j).to(tl.float32)[None, :],
                               tl.load(qn_ptr + HALF + j).to(tl.float32)[None, :], eps, HALF, 1, dt)
    c = tl.load(cos_ptr + p * stride_cs + j).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + p * stride_cs + j).to(tl.float32)[None, :]
    o1, o2 = rope_rotate(x1, x2, c, s, dt)
    return tl.reshape(tl.permute(tl.join(o1, o2), (0, 2, 1)), (BLOCK_G, 2 * HALF))


@triton.jit
def _rotated_head(src, nw_ptr, cos_ptr, sin_ptr, p, stride_cs, eps, HALF: tl.constexpr, QK_NORM: tl.constexpr,
                  dt: tl.constexpr):
    """One q or k head at ``src`` as its two halves in ``dt``: RMS-normed with ``nw_ptr``'s weights
    (QK_NORM: qwen3) and rotated at position ``p``."""
    j = tl.arange(0, HALF)
    x1 = tl.load(src + j).to(tl.float32)
    x2 = tl.load(src + HALF + j).to(tl.float32)
    if QK_NORM:
        x1, x2 = head_rms_norm(x1, x2, tl.load(nw_ptr + j).to(tl.float32), tl.load(nw_ptr + HALF + j).to(tl.float32),
                               eps, HALF, 0, dt)
    return rope_rotate(x1, x2, tl.load(cos_ptr + p * stride_cs + j).to(tl.float32),
                       tl.load(sin_ptr + p * stride_cs + j).to(tl.float32), dt)


@triton.jit
def _store_new_key(qkv_ptr, cos_ptr, sin_ptr, kn_ptr, kc_ptr, vc_ptr, off, p, kh, NH, NKV, stride_cs, eps,
                   HALF: tl.constexpr, QK_NORM: tl.constexpr, dt: tl.constexpr):
    """Key head ``kh`` of one row's q/k/v (``qkv_ptr`` at the row), k-normed and rotated at
    position ``p``, and its value head, into the caches at ``off`` -- as `_rope_store_kernel` does."""
    j = tl.arange(0, HALF)
    o1, o2 = _rotated_head(qkv_ptr + (NH + kh) * (2 * HALF), kn_ptr, cos_ptr, sin_ptr, p, stride_cs, eps, HALF,
                           QK_NORM, dt)
    tl.store(kc_ptr + off + j, o1)
    tl.store(kc_ptr + off + HALF + j, o2)
    vsrc = qkv_ptr + (NH + NKV + kh) * (2 * HALF)
    tl.store(vc_ptr + off + j, tl.load(vsrc + j))
    tl.store(vc_ptr + off + HALF + j, tl.load(vsrc + HALF + j))


@triton.jit
def _decode_attn_kernel(q_ptr, kc_ptr, vc_ptr, pos_ptr, out_ptr, part_ptr, ml_ptr,
                        cos_ptr, sin_ptr, qn_ptr, kn_ptr, scale, NH, NKV, eps,
                        stride_qb, stride_ob, stride_kr, stride_kh, stride_kp, stride_cs,
                        GROUP: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
                        NUM_SPLITS: tl.constexpr, ROPE: tl.constexpr, QK_NORM: tl.constexpr, IEEE: tl.constexpr,
                        ROW_SPLIT_KEYS: tl.constexpr, INTERPRET: tl.constexpr, INTERPRET_BLOCKS: tl.constexpr):
    """Program (b, kv head, split): the GROUP query heads of one kv head over its split of the keys
    ``[0, pos[b]]``, online softmax. A row's keys are split evenly (in whole blocks) by its own
    length over ROW_SPLIT_KEYS > 0: as many splits as `attention_splits` gives its own length (at
    most NUM_SPLITS; the programs past them hold none), 0: all NUM_SPLITS. So with ROW_SPLIT_KEYS a
    row's partition -- and its output, bit for bit -- does not depend on the other rows of the step
    or on the key length it was shaped for (a graph serves a whole class of lengths). One split: the output;
    several: unnormalised partial sums + (max, sum), merged by `_combine_kernel`. (Merging them in
    the last program to finish, through a counter per (b, kv head), measured no faster on the H100:
    benchmarks/RESULTS.md, decode and prefill kernel choices.) ROPE: ``q_ptr`` is the q/k/v projection's
    output, not rotated yet: each program rotates its queries, and the program whose split holds
    pos[b] rotates the new key and stores it and its value into the caches before it reads them (no
    `_rope_store_kernel`)."""
    b = tl.program_id(0)
    kh = tl.program_id(1)
    sp = tl.program_id(2)
    n_ctx = tl.load(pos_ptr + b) + 1
    row_splits = NUM_SPLITS
    if ROW_SPLIT_KEYS > 0:   # attention_splits(n_ctx), capped at NUM_SPLITS (powers of two)
        row_splits = 1
        for k in tl.static_range(1, 5):
            if (1 << k) <= NUM_SPLITS:
                row_splits = tl.where(n_ctx >= (1 << k) * ROW_SPLIT_KEYS, 1 << k, row_splits)
    split_len = tl.cdiv(tl.cdiv(n_ctx, row_splits), BLOCK_N) * BLOCK_N
    start = sp * split_len
    end = tl.minimum(start + split_len, n_ctx)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, D)
    gm = g < GROUP
    heads = kh * GROUP + g
    base = b * stride_kr + kh * stride_kh
    if ROPE:
        dt = out_ptr.dtype.element_ty
        q = _rotated_heads(q_ptr + b * stride_qb, cos_ptr, sin_ptr, qn_ptr, n_ctx - 1, heads, gm, stride_cs, eps,
                           BLOCK_G, D // 2, QK_NORM, dt)
        if (n_ctx - 1 >= start) & (n_ctx - 1 < end):
            _store_new_key(q_ptr + b * stride_qb, cos_ptr, sin_ptr, kn_ptr, kc_ptr, vc_ptr,
                           base + (n_ctx - 1) * stride_kp, n_ctx - 1, kh, NH, NKV, stride_cs, eps, D // 2, QK_NORM, dt)
            tl.debug_barrier()   # the new key and value stored before this program reads them back
    else:
        q = tl.load(q_ptr + b * stride_qb + heads[:, None] * D + d[None, :], mask=gm[:, None], other=0.0)
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, D], dtype=tl.float32)
    if INTERPRET:   # Triton's interpreter needs host loop bounds: every block, masked past `end`
        for j in range(0, INTERPRET_BLOCKS):
            m_i, l_i, acc = _attend_block(q, kc_ptr, vc_ptr, base, start + j * BLOCK_N, end, stride_kp, scale,
                                          m_i, l_i, acc, D, BLOCK_N, IEEE)
    else:           # compiled: only the blocks this row holds keys in
        for j in range(0, tl.cdiv(tl.maximum(end - start, 0), BLOCK_N)):
            m_i, l_i, acc = _attend_block(q, kc_ptr, vc_ptr, base, start + j * BLOCK_N, end, stride_kp, scale,
                                          m_i, l_i, acc, D, BLOCK_N, IEEE)
    if NUM_SPLITS == 1:
        tl.store(out_ptr + b * stride_ob + heads[:, None] * D + d[None, :],
                 (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=gm[:, None])
    else:
        # partials [B, NH, NUM_SPLITS, D] and [B, NH, NUM_SPLITS, 2] (fp32)
        row = (b * NH + heads) * NUM_SPLITS + sp
        tl.store(part_ptr + row[:, None] * D + d[None, :], acc, mask=gm[:, None])
        tl.store(ml_ptr + row * 2, m_i, mask=gm)
        tl.store(ml_ptr + row * 2 + 1, l_i, mask=gm)


@triton.jit
def _combine_kernel(part_ptr, ml_ptr, out_ptr, NH, stride_ob, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
                    NUM_SPLITS: tl.constexpr, D: tl.constexpr):
    """Program (b, kv head): merge the splits' partial softmax sums of its GROUP query heads into
    their output rows, in split order. A fixed order (not a tree over NUM_SPLITS, which the GPU
    shapes by NUM_SPLITS) keeps a row's output the same bits whatever split count its step was
    shaped for: the splits a row does not use hold l = 0 and add exact zeros."""
    b = tl.program_id(0)
    kh = tl.program_id(1)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, D)
    gm = g < GROUP
    heads = kh * GROUP + g
    first = (b * NH + heads) * NUM_SPLITS
    mx = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    for s in tl.static_range(NUM_SPLITS):
        mx = tl.maximum(mx, tl.load(ml_ptr + (first + s) * 2, mask=gm, other=float("-inf")))
    num = tl.zeros([BLOCK_G, D], dtype=tl.float32)
    den = tl.zeros([BLOCK_G], dtype=tl.float32)
    for s in tl.static_range(NUM_SPLITS):
        m = tl.load(ml_ptr + (first + s) * 2, mask=gm, other=0.0)
        lsum = tl.load(ml_ptr + (first + s) * 2 + 1, mask=gm, other=0.0)
        w = tl.where(lsum > 0, tl.exp(m - mx), 0.0)
        num += tl.load(part_ptr + (first + s)[:, None] * D + d[None, :], mask=gm[:, None], other=0.0) * w[:, None]
        den += lsum * w
    out = num / tl.where(gm, den, 1.0)[:, None]
    tl.store(out_ptr + b * stride_ob + heads[:, None] * D + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=gm[:, None])


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, I, stride_gu, stride_o, BLOCK: tl.constexpr):
    """``out[b] = silu(gate[b]) * up[b]`` where ``gu[b] = [gate | up]`` (the fused gate/up GEMM).
    Row offsets in int64: a prefill's rows x 2I passes 2^31 (7B: 57k padded tokens)."""
    b = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < I
    g = tl.load(gu_ptr + b * stride_gu + offs, mask=m, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + b * stride_gu + I + offs, mask=m, other=0.0).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    act = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    tl.store(out_ptr + b * stride_o + offs, (act * u).to(dt), mask=m)


@triton.jit
def _hash32(x):
    """sampler._hash32 on uint32 (wrapping multiplications, logical shifts)."""
    x = ((x >> 16) ^ x) * 0x45D9F3B
    x = ((x >> 16) ^ x) * 0x45D9F3B
    return (x >> 16) ^ x


@triton.jit
def _gumbel_exact(bits):
    """sampler.seeded_gumbel's noise for 32-bit hash ``bits``: u = (bits + 0.5) / 2^32,
    -log(-log(u)) in fp64, rounded to fp32 -- the definition every sampler follows."""
    u = (bits.to(tl.float64) + 0.5) / 4294967296.0
    return (-tl.log(-tl.log(u))).to(tl.float32)


# |_gumbel_approx - _gumbel_exact| is below ~1e-4 (fp32 rounding of u or 1 - u, the series' cut-off,
# two fp32 logs); scores this close to a block's best are re-decided with the exact noise.
GUMBEL_SLACK: tl.constexpr = tl.constexpr(1e-3)


@triton.jit
def _gumbel_approx(bits):
    """`_gumbel_exact` in fp32 (~1e-5 off; fp64 logs cost ~4x the rest of the sampler): -log(u)
    from u itself where u <= 1 - 2^-7, else from w = 1 - u by its series w + w^2/2 + w^3/3 (u's
    fp32 rounding would swamp -log(u) there)."""
    w = ((4294967295 - bits).to(tl.float32) + 0.5) * 2.3283064365386963e-10
    u = (bits.to(tl.float32) + 0.5) * 2.3283064365386963e-10
    neg_log_u = tl.where(w < 0.0078125, w * (1.0 + w * (0.5 + w * 0.3333333333)), -tl.log(u))
    return -tl.log(neg_log_u)


@triton.jit
def online_max_sumexp(m, ssum, z):
    """One block ``z`` into a running (max, sum of exp(z - max)) -- masked ids read as -inf; a block
    wholly past the vocabulary leaves the pair as it was."""
    m_new = tl.maximum(m, tl.max(z, axis=0))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    return m_new, ssum * tl.exp(m - m_ref) + tl.sum(tl.exp(z - m_ref), axis=0)


@triton.jit
def merged_lse(m, ssum):
    """log-sum-exp of a row from its chunks' (max, sum exp) pairs (a chunk with no id: sum 0)."""
    mx = tl.max(m, axis=0)
    return mx, mx + tl.log(tl.sum(tl.where(ssum > 0, ssum * tl.exp(m - mx), 0.0), axis=0))


@triton.jit
def _noisy_score(z, g, greedy, drawable):
    """A block's scores: z + noise (z for a greedy row), -inf where the id may not be drawn."""
    return tl.where(drawable, tl.where(greedy, z, z + g), float("-inf"))


@triton.jit
def _row_key(seed_ptr, step_ptr, r):
    """sampler._row_keys of row r, from its int64 seed and step: only their low 32 bits enter the
    hash (the multiplication wraps modulo 2^32, as the reference masks it). Made here rather than by
    the ~25 tiny torch ops of the reference, each a graph node of its own per decode step."""
    seed = tl.load(seed_ptr + r).to(tl.uint32)
    step = tl.load(step_ptr + r).to(tl.uint32)
    return _hash32(_hash32(seed) ^ (step * 0x27D4EB2D))


@triton.jit
def _sample_part_kernel(logits_ptr, temp_ptr, greedy_ptr, seed_ptr, step_ptr, thr_ptr, part_ptr, idx_ptr, stride,
                        V: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr, NOISE: tl.constexpr,
                        HAS_THR: tl.constexpr, EXACT: tl.constexpr):
    """Program (row r, chunk c) over vocabulary ids ``[c * CHUNK, (c + 1) * CHUNK)``: z = logits / T,
    running (max, sum exp) of z, and the best of z + gumbel (z for greedy rows; first id on ties)
    with its z. The noise is sampler.seeded_gumbel's: bits = hash32(row key ^ hash32(token id)),
    u = (bits + 0.5) / 2^32, -log(-log(u)) in fp64, rounded to fp32 -- scored in fp32 first
    (`_gumbel_approx`), the chosen score always the exact one (EXACT: fp64 for every id). HAS_THR: a sampled row draws
    only among the ids with z >= thr[r] (its top-k / top-p / min-p keep-set, `filter_kernels.filter_thresholds`);
    the (max, sum exp) stay those of every id, so the logprob is of the unfiltered distribution."""
    r = tl.program_id(0)
    c = tl.program_id(1)
    S = tl.num_programs(1)
    t = tl.load(temp_ptr + r)
    greedy = tl.load(greedy_ptr + r) != 0
    if HAS_THR:
        thr = tl.load(thr_ptr + r)
    key = _row_key(seed_ptr, step_ptr, r)
    m = tl.full([1], float("-inf"), tl.float32)
    ssum = tl.zeros([1], tl.float32)
    best = tl.full([1], float("-inf"), tl.float32)
    best_i = tl.zeros([1], tl.int32)
    best_z = tl.zeros([1], tl.float32)
    lane = tl.arange(0, BLOCK)
    for j in range(0, CHUNK // BLOCK):
        v0 = c * CHUNK + j * BLOCK
        v = v0 + lane
        ok = v < V
        z = tl.load(logits_ptr + r * stride + v, mask=ok, other=float("-inf")).to(tl.float32) / t
        m, ssum = online_max_sumexp(m, ssum, z)
        drawable = ok
        if HAS_THR:   # (a greedy row's argmax is always kept: every filter keeps the top id)
            drawable = drawable & (z >= thr)
        if NOISE:
            bits = _hash32(key ^ _hash32(v.to(tl.uint32)))
            if EXACT:
                g = _gumbel_exact(bits)
            else:
                g = _gumbel_approx(bits)
            score = _noisy_score(z, g, greedy, drawable)
        else:
            score = tl.where(drawable, z, float("-inf"))
        i = tl.argmax(score, axis=0, tie_break_left=True)
        sc = tl.max(score, axis=0)
        zi = tl.sum(tl.where(lane == i, z, 0.0), axis=0)
        if NOISE and not EXACT:
            # the approximate best is the exact best unless another score is within twice the
            # noise's error of it (then, rarely, the whole block is scored exactly); either way the
            # chosen score is the exact one, so tokens equal the fp64 definition's
            if sc > float("-inf"):
                slack = 2.0 * (GUMBEL_SLACK + tl.abs(sc) * 1e-6)
                if tl.sum((score >= sc - slack).to(tl.int32), axis=0) > 1:
                    score = _noisy_score(z, _gumbel_exact(bits), greedy, drawable)
                    i = tl.argmax(score, axis=0, tie_break_left=True)
                    sc = tl.max(score, axis=0)
                    zi = tl.sum(tl.where(lane == i, z, 0.0), axis=0)
                else:
                    g_one = _gumbel_exact(tl.sum(tl.where(lane == i, bits, 0), axis=0))
                    sc = tl.where(greedy, zi, zi + g_one)
        take = sc > best
        best_i = tl.where(take, v0 + i, best_i)
        best_z = tl.where(take, zi, best_z)
        best = tl.where(take, sc, best)
    o = (r * S + c) * 4 + tl.arange(0, 1)
    tl.store(part_ptr + o, m)
    tl.store(part_ptr + o + 1, ssum)
    tl.store(part_ptr + o + 2, best)
    tl.store(part_ptr + o + 3, best_z)
    tl.store(idx_ptr + r * S + c + tl.arange(0, 1), best_i)


@triton.jit
def _sample_combine_kernel(part_ptr, idx_ptr, tok_ptr, lp_ptr, S, BLOCK_S: tl.constexpr):
    """Row r: merge its chunks -- logsumexp of z, the best score (first chunk on ties) -> token
    and logprob z[token] - logsumexp(z)."""
    r = tl.program_id(0)
    c = tl.arange(0, BLOCK_S)
    ok = c < S
    base = (r * S + c) * 4
    m = tl.load(part_ptr + base, mask=ok, other=float("-inf"))
    ssum = tl.load(part_ptr + base + 1, mask=ok, other=0.0)
    best = tl.load(part_ptr + base + 2, mask=ok, other=float("-inf"))
    best_z = tl.load(part_ptr + base + 3, mask=ok, other=0.0)
    _, lse = merged_lse(m, ssum)
    w = tl.argmax(best, axis=0, tie_break_left=True)
    tok = tl.sum(tl.where(c == w, tl.load(idx_ptr + r * S + c, mask=ok, other=0), 0), axis=0)
    z = tl.sum(tl.where(c == w, best_z, 0.0), axis=0)
    tl.store(tok_ptr + r, tok.to(tl.int64))
    tl.store(lp_ptr + r, z - lse)


# ------------------------------------------------------------------------------------ wrappers
def sample_rows_fused(logits: torch.Tensor, temperature: torch.Tensor, greedy: torch.Tensor,
                      seeds: torch.Tensor, steps: torch.Tensor, noise: bool = True,
                      threshold: Optional[torch.Tensor] = None,
                      exact_noise: bool = False, block: int = 1024,
                      num_warps: int = 4) -> Tuple[torch.Tensor, torch.Tensor]:
    """sampler.sample_rows in one pass over ``logits [B, V]``
    (fp32, or the model's bf16/fp16 logits: upcast exactly as they are read, so no fp32 copy of
    ``[B, V]`` is written and read again), split into 4096-id chunks so that even one row spreads over the GPU: (tokens int64
    [B], logprobs fp32 [B]); ``seeds``, ``steps`` (int64): each row's noise key, as sampler's
    ``_row_keys`` makes it (made in the kernel); ``noise`` False: every
    row is greedy; ``threshold`` (`filter_kernels.filter_thresholds`): sampled rows draw among ``logits / T >= threshold``.
    The noise is scored in fp32 and only a block's likely best re-scored in fp64; ``exact_noise``
    scores every id in fp64 instead (the same tokens: the benchmark's baseline). ``block``: ids a
    program holds at once (a divisor of the chunk; 4096 with 8 warps measured 1.13x at one row and
    0.99-1.00x from 32 rows, benchmarks/results/h100_h200_pdl_sampler_grid_sync.jsonl -- the per-block
    reductions are not what bounds it)."""
    B, V = logits.shape
    logits = logits.contiguous()
    chunk = 4096
    S = triton.cdiv(V, chunk)
    dev = logits.device
    part = torch.empty(B, S, 4, dtype=torch.float32, device=dev)
    idx = torch.empty(B, S, dtype=torch.int32, device=dev)
    _sample_part_kernel[(B, S)](logits, temperature, greedy, seeds, steps,
                                threshold if threshold is not None else temperature, part, idx,
                                logits.stride(0), V=V, CHUNK=chunk, BLOCK=block, NOISE=noise,
                                HAS_THR=threshold is not None, EXACT=exact_noise, num_warps=num_warps)
    tokens = torch.empty(B, dtype=torch.int64, device=dev)
    lps = torch.empty(B, dtype=torch.float32, device=dev)
    _sample_combine_kernel[(B,)](part, idx, tokens, lps, S, BLOCK_S=triton.next_power_of_2(S))
    return tokens, lps


def add_rms_norm(x: torch.Tensor, y: Optional[torch.Tensor], w: torch.Tensor, eps: float) -> torch.Tensor:
    """``x += y`` in place (when ``y`` is given), then RMSNorm(x) * w -> a new ``[B, H]`` tensor."""
    B, H = x.shape
    h = torch.empty_like(x)
    _add_rms_kernel[(B,)](x, y if y is not None else x, w, h, H, eps, x.stride(0),
                          y.stride(0) if y is not None else 0, h.stride(0),
                          HAS_Y=y is not None, BLOCK=triton.next_power_of_2(H))
    return h


def rope_and_store(qkv: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, nh: int, nkv: int,
                   q_norm: Optional[torch.Tensor] = None, k_norm: Optional[torch.Tensor] = None,
                   eps: float = 0.0, rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``qkv [B, (nh + 2 nkv) * D]`` -> rotated queries ``[B, nh, D]``; keys (rotated) and values go
    to row b (``rows[b]`` when given: a prefill's tokens, many per row), position ``pos[b]`` of the
    layer's caches ``[rows, nkv, max_len, D]``."""
    B = qkv.shape[0]
    D = k_cache.shape[-1]
    q = torch.empty(B, nh, D, dtype=qkv.dtype, device=qkv.device)
    norm = q_norm is not None
    _rope_store_kernel[(B,)](qkv, pos, rows if rows is not None else pos, cos, sin,
                             q_norm if norm else qkv, k_norm if norm else qkv, q,
                             k_cache, v_cache, qkv.stride(0), q.stride(0), k_cache.stride(0),
                             k_cache.stride(1), k_cache.stride(2), cos.stride(0), nh, nkv, eps,
                             HALF=D // 2, BLOCK_H=triton.next_power_of_2(nh),
                             BLOCK_KV=triton.next_power_of_2(nkv), QK_NORM=norm, HAS_ROWS=rows is not None)
    return q


# Attention variants of the fused step, each tested on CPU under the interpreter against SDPA and
# the torch body, and compiled on the GPU (`run_gpu.sh decode_tests`). Measured on the H100 in one
# run (`run_gpu.sh attn_rope`, greedy, batch 1 / 32 / 128 / 512): RoPE inside attention 1.03-1.04x
# the separate kernel at every batch size (the default repeated in the run moved <= 1%), so it is on;
# 64- and 16-key splits were slower than 256-key splits at 128 rows and up, 128- and 512-key splits
# no faster at 2k-8k keys, so SPLIT_KEYS stays 256.
# Merging the splits in the attention kernel and loading values with the keys gained nothing at
# 160- or 2k-key contexts (benchmarks/RESULTS.md sections 27-28) and were taken out.
SPLIT_KEYS = 256           # keys per split of a decode step's attention (see `attention_splits`)
# One attention program walks its split in blocks of at most ATTN_BLOCK_KEYS keys (half that past 128
# dims), one dependent round of loads per block, with ATTN_WARPS warps and ATTN_STAGES pipeline stages.
ATTN_BLOCK_KEYS = 64
ATTN_WARPS = 4
ATTN_STAGES = 3
ROPE_IN_ATTENTION = True   # the fused step rotates q/k inside the attention kernel (no `_rope_store_kernel`)


def attention_splits(key_len: int) -> int:
    """How many key ranges a decode step splits into (flash-decoding): one per SPLIT_KEYS keys, at
    most 16, a power of two. It depends on the key length only, so a row's result does not depend
    on how many other rows share its step."""
    return 1 << (min(16, max(1, key_len // SPLIT_KEYS)).bit_length() - 1)


def attention_len_class(key_len: int, max_len: int) -> int:
    """The longest key length (at most ``max_len``) split as ``key_len`` is. The attention kernel
    splits and reads only the keys each row has, so a step shaped for this length gives what one
    shaped for ``key_len`` gives, bit for bit: one decode graph serves the whole class (every
    context under 2 SPLIT_KEYS keys, then each doubling), not one per 64-key bucket."""
    splits = attention_splits(key_len)
    return max_len if splits >= 16 else min(max_len, 2 * splits * SPLIT_KEYS - 1)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos: torch.Tensor,
                     key_len: int, scale: float, splits: Optional[int] = None, rope: Optional[tuple] = None,
                     per_row: bool = True) -> torch.Tensor:
    """``q [B, nh, D]`` over keys ``[0, pos[b]]`` of cache rows ``[0, B)`` -> ``[B, nh * D]``.
    ``key_len`` bounds every pos[b] + 1 (it sets how many split programs run, not the work: each
    row splits and reads only the keys it has). ``per_row``: each row takes as many of the
    ``splits`` as its own length gives (`attention_splits`) and blocks of SPLIT_KEYS' size, so its
    output does not depend on the other rows (seeded sampling stays batch-invariant); False: every
    row over all ``splits``, blocks sized by ``key_len`` (tests of a forced partition).
    ``rope``: ``q`` is the q/k/v projection's output ``[B, (nh + 2 nkv) * D]`` and rope is
    ``(nh, cos, sin, q_norm, k_norm, eps)``: the kernel does what `rope_and_store` would have done
    first."""
    nkv, D = k_cache.shape[1], k_cache.shape[-1]
    B = q.shape[0]
    if rope is not None:
        nh, cos, sin, q_norm, k_norm, eps = rope
    else:
        nh, cos, sin, q_norm, k_norm, eps = q.shape[1], q, q, None, None, 0.0
    group = nh // nkv
    splits = splits or attention_splits(key_len)
    # keys per block: up to ATTN_BLOCK_KEYS (half past 128 dims), down to what one split holds (short splits: no
    # half-masked blocks, so a split of 32 keys reads 32, not 64)
    held = SPLIT_KEYS if per_row else triton.cdiv(key_len, splits)
    block_n = min(ATTN_BLOCK_KEYS if D <= 128 else ATTN_BLOCK_KEYS // 2, max(16, triton.next_power_of_2(held)))
    # the interpreter's loop bound: every block of the longest row's (longest) split
    blocks = triton.cdiv(key_len, block_n) if per_row else triton.cdiv(triton.cdiv(key_len, splits), block_n)
    out = torch.empty(B, nh, D, dtype=q.dtype, device=q.device)
    ieee = q.dtype == torch.float32
    if splits == 1:
        part = ml = out
    else:
        part = torch.empty(B, nh, splits, D, dtype=torch.float32, device=q.device)
        ml = torch.empty(B, nh, splits, 2, dtype=torch.float32, device=q.device)
    norm = q_norm is not None
    block_g = max(16, triton.next_power_of_2(group))
    _decode_attn_kernel[(B, nkv, splits)](q, k_cache, v_cache, pos, out, part, ml,
                                          cos, sin, q_norm if norm else q, k_norm if norm else q, scale,
                                          nh, nkv, eps, q.stride(0), out.stride(0), k_cache.stride(0),
                                          k_cache.stride(1), k_cache.stride(2), cos.stride(0) if rope else 0,
                                          GROUP=group, BLOCK_G=block_g, D=D,
                                          BLOCK_N=block_n, NUM_SPLITS=splits,
                                          ROPE=rope is not None, QK_NORM=norm, IEEE=ieee,
                                          ROW_SPLIT_KEYS=SPLIT_KEYS if per_row else 0, INTERPRET=_INTERPRET,
                                          INTERPRET_BLOCKS=blocks if _INTERPRET else 0,
                                          num_warps=ATTN_WARPS, num_stages=ATTN_STAGES)
    if splits > 1:
        _combine_kernel[(B, nkv)](part, ml, out, nh, out.stride(0), GROUP=group,
                                  BLOCK_G=block_g, NUM_SPLITS=splits, D=D)
    return out.view(B, nh * D)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``[B, 2I]`` (gate | up) -> ``silu(gate) * up`` ``[B, I]``."""
    B, two_i = gate_up.shape
    inter = two_i // 2
    out = torch.empty(B, inter, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_mul_kernel[(B, triton.cdiv(inter, block))](gate_up, out, inter, gate_up.stride(0), out.stride(0),
                                                      BLOCK=block)
    return out


def supported(head_dim: int, dtype: torch.dtype) -> Tuple[bool, str]:
    """Can the fused decode step serve this shape? (why not, in words)"""
    if head_dim < 16 or head_dim & (head_dim - 1):
        return False, f"head_dim {head_dim} is not a power of two >= 16"
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False, f"dtype {dtype}"
    return True, ""
