"""Block-FP8 quantization and the float8 finiteness check as single-pass Triton kernels.

Why: the torch form of `fp8_block.quantize_block_fp8` reads a weight three times (block max, block
min, the scaled copy) and writes an fp32 temporary on the way, and the server's float8 check made
a mask and a bool copy of every bucket. An FP8 push of a 7B model then cost 2.2-2.3x the bf16
push on an H100 while moving 0.57x the bytes (benchmarks/RESULTS.md, "Weight push"). Here a
quantization reads each weight once and writes its float8 bytes and scale once; the check reads
each byte once.

The bytes are the torch form's, bit for bit (tests/test_fp8_kernels.py checks both on CPU under
Triton's interpreter; ``benchmarks/bench_fp8_push_kernels.py --check`` on the GPU):

* the block scale is ``amax / 448`` (or its power-of-two ceiling for ``ue8m0``) as torch divides
  a tensor by a number on that device: on CUDA torch multiplies by the fp32 reciprocal of 448
  (one bit less exact than a division), on CPU it divides; the inverse ``1 / scale`` is an
  IEEE-rounded division on both (`tl.div_rn`);
* the product is in fp32, and the fp32 -> float8_e4m3fn conversion is done in integer arithmetic
  (round to nearest even, subnormals included, 448 the largest finite value). The hardware cast
  would do the same on the GPU, but Triton's interpreter flushes float8 subnormals, and the kernel
  must be the same code on both;
* a block holding a NaN gets a NaN scale and every value of the block NaN, as the torch form's
  NaN-propagating block max gives: a non-finite weight never arrives finite.

Pure tensor functions; the callers choose them for CUDA tensors (`fp8_block.quantize_block_fp8`,
`engine.weights`).
"""
from __future__ import annotations

from typing import Tuple

import torch
import triton
import triton.language as tl

FP8_MAX = 448.0
INV_FP8_MAX = float(torch.tensor(1.0, dtype=torch.float32) / FP8_MAX)   # the fp32 value torch uses on CUDA
CHECK_CHUNK = 1 << 14        # bytes one program of the finiteness check reads


@triton.jit
def _e4m3fn_bits(y):
    """fp32 -> float8_e4m3fn bit pattern (int32 in 0..255), round to nearest even; |y| beyond the
    largest finite value rounds to 448 as long as it is finite (the products here are at most
    448 up to one rounding); inf and NaN become the NaN pattern."""
    b = y.to(tl.int32, bitcast=True)
    sign = (b >> 24) & 0x80
    a = b & 0x7FFFFFFF
    # normals (|y| >= 2^-6): keep 3 mantissa bits, rounding half to even; the carry may bump the
    # exponent, which is the right answer. Rebias the exponent from 127 to 7.
    r = a + 0x7FFFF + ((a >> 20) & 1)
    normal = tl.minimum((r >> 20) - (120 << 3), 0x7E)
    # subnormals: a multiple of 2^-9; |y| * 512 is exact, and adding and removing 1.5 * 2^23
    # rounds it to the nearest integer, half to even (8 is 2^-6, the smallest normal: same bits)
    t = a.to(tl.float32, bitcast=True) * 512.0
    sub = ((t + 12582912.0) - 12582912.0).to(tl.int32)
    mag = tl.where(a >= 0x3C800000, normal, sub)
    mag = tl.where(a >= 0x7F800000, 0x7F, mag)
    return sign | mag


@triton.jit
def _quantize_block_kernel(w_ptr, q_ptr, s_ptr, M, N, stride_w, stride_q, scale_cols, inv_max,
                           UE8M0: tl.constexpr, BY_RECIPROCAL: tl.constexpr, BLOCK: tl.constexpr):
    """One program per (BLOCK x BLOCK) block: its max |x|, its scale, its float8 bytes. A partial
    tail block reads zeros past the edge (the torch form's zero padding) and writes only inside."""
    bi = tl.program_id(0).to(tl.int64)
    bj = tl.program_id(1).to(tl.int64)
    rows = bi * BLOCK + tl.arange(0, BLOCK)[:, None]
    cols = bj * BLOCK + tl.arange(0, BLOCK)[None, :]
    inside = (rows < M) & (cols < N)
    x = tl.load(w_ptr + rows * stride_w + cols, mask=inside, other=0.0).to(tl.float32)
    amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
    has_nan = tl.max(tl.max((x != x).to(tl.int32), axis=1), axis=0)
    lo = 1e-4 if UE8M0 else 1e-12
    if BY_RECIPROCAL:
        s = tl.maximum(amax, lo) * inv_max
    else:
        s = tl.div_rn(tl.maximum(amax, lo), FP8_MAX)
    if UE8M0:
        # the smallest power of two >= s, from its exponent bits (as fp8_block._ceil_pow2)
        bits = s.to(tl.int32, bitcast=True)
        exp = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
        exp = tl.minimum(tl.maximum(exp, 1), 254)
        scale = (exp << 23).to(tl.float32, bitcast=True)
    else:
        scale = s
    scale = tl.where(has_nan > 0, float("nan"), scale)
    inv = tl.div_rn(1.0, scale)
    q = _e4m3fn_bits(x * inv)
    tl.store(q_ptr + rows * stride_q + cols, q.to(tl.uint8), mask=inside)
    tl.store(s_ptr + bi * scale_cols + bj, scale)


def quantize_block_fp8_kernel(w: torch.Tensor, block: int = 128, scale_format: str = "ue8m0",
                              out: torch.Tensor | None = None,
                              by_reciprocal: bool | None = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight of w's shape, fp32 scale grid ceil(m/b) x ceil(n/b)): the bytes of
    `fp8_block.quantize_block_fp8`, in one pass over ``w`` (rows may be strided, columns must be
    contiguous). ``out``: a float8 (or uint8) tensor of w's shape to write into. ``by_reciprocal``:
    the scale as ``amax * fp32(1/448)`` (torch's division by a number on CUDA) instead of a true
    division; default: on CUDA tensors."""
    if w.dim() != 2:
        raise ValueError(f"block FP8 quantizes 2-D weights, got shape {tuple(w.shape)}")
    if scale_format not in ("ue8m0", "fp32"):
        raise ValueError(f"scale_format must be 'ue8m0' or 'fp32', got {scale_format!r}")
    if w.stride(1) != 1:
        w = w.contiguous()
    m, n = w.shape
    gm, gn = -(-m // block), -(-n // block)
    q = out if out is not None else torch.empty((m, n), dtype=torch.float8_e4m3fn, device=w.device)
    if tuple(q.shape) != (m, n) or q.element_size() != 1 or q.stride(1) != 1:
        raise ValueError(f"out must be a 1-byte tensor of shape {(m, n)} with contiguous rows")
    scale = torch.empty((gm, gn), dtype=torch.float32, device=w.device)
    if m and n:
        _quantize_block_kernel[(gm, gn)](w, q.view(torch.uint8), scale, m, n, w.stride(0), q.stride(0), gn,
                                         INV_FP8_MAX, UE8M0=scale_format == "ue8m0",
                                         BY_RECIPROCAL=w.is_cuda if by_reciprocal is None else by_reciprocal,
                                         BLOCK=block, num_warps=8)
    return q, scale


@triton.jit
def _any_byte_matches_kernel(raw_ptr, flags_ptr, n, MASK: tl.constexpr, VALUE: tl.constexpr,
                             CHUNK: tl.constexpr):
    """flags[p] = 1 if some byte b of chunk p has ``b & MASK == VALUE``."""
    p = tl.program_id(0).to(tl.int64)
    offs = p * CHUNK + tl.arange(0, CHUNK)
    b = tl.load(raw_ptr + offs, mask=offs < n, other=0).to(tl.int32)
    hit = ((b & MASK) == VALUE).to(tl.int32)
    tl.store(flags_ptr + p, tl.max(hit, axis=0).to(tl.int8))


def any_byte_matches(raw: torch.Tensor, mask: int, value: int) -> torch.Tensor:
    """A one-element bool tensor (no host sync): whether some byte ``b`` of the contiguous uint8
    tensor ``raw`` has ``b & mask == value`` -- for float8 bytes, whether a value is NaN or inf
    (`engine.weights.FP8_NON_FINITE` holds each type's pattern)."""
    if raw.dtype != torch.uint8 or raw.dim() != 1 or not raw.is_contiguous():
        raise ValueError("raw must be a contiguous 1-D uint8 tensor")
    n = raw.numel()
    programs = max(1, -(-n // CHECK_CHUNK))
    flags = torch.zeros(programs, dtype=torch.int8, device=raw.device)
    if n:
        _any_byte_matches_kernel[(programs,)](raw, flags, n, MASK=mask, VALUE=value, CHUNK=CHECK_CHUNK,
                                              num_warps=8)
    return flags.any().reshape(1)
