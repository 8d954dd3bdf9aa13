"""The single-pass FP8 kernels (megarl/quant/fp8_kernels.py) against torch's own float8 cast and the
torch form of the block quantizer (itself checked against SGLang's quantizer in test_fp8_block.py).

Run on CPU under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1): the same kernel
code the GPU compiles. On the GPU, ``benchmarks/bench_fp8_push_kernels.py --check`` compares the
compiled kernels with the torch form on CUDA, on 7B-shaped weights.
"""
from __future__ import annotations

import os

import pytest
import torch
import triton
import triton.language as tl

from megarl.engine.weights import FP8_NON_FINITE
from megarl.quant.fp8_block import quantize_block_fp8_torch
from megarl.quant.fp8_kernels import (CHECK_CHUNK, _e4m3fn_bits, any_byte_matches,
                                      quantize_block_fp8_kernel)


@pytest.fixture(autouse=True)
def _interpreted():
    assert os.environ.get("TRITON_INTERPRET") == "1", "run under tests/conftest.py (TRITON_INTERPRET=1)"


@triton.jit
def _cast_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    tl.store(out_ptr + offs, _e4m3fn_bits(x).to(tl.uint8), mask=offs < n)


def _kernel_cast(x: torch.Tensor) -> torch.Tensor:
    out = torch.empty(x.numel(), dtype=torch.uint8)
    _cast_kernel[(triton.cdiv(x.numel(), 8192),)](x, out, x.numel(), BLOCK=8192)
    return out


def test_integer_cast_equals_torchs_float8_cast_on_every_bf16_value_in_range():
    """Every bf16 bit pattern whose value lies in [-448, 448] (normals, subnormals, zeros, the
    round-half-even ties between float8 neighbours), plus fp32 values between them: the kernel's
    integer conversion gives the bytes of torch's own ``.to(torch.float8_e4m3fn)``."""
    every = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    every = every[every.abs() <= 448.0]
    ties = torch.arange(0, 256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    ties = ties[torch.isfinite(ties)].unique()
    mids = (ties[1:] + ties[:-1]) / 2                      # exact halves: the tie-breaking cases
    rand = torch.empty(200_000).uniform_(-448, 448, generator=torch.Generator().manual_seed(0))
    tiny = torch.empty(50_000).uniform_(-2 ** -6, 2 ** -6, generator=torch.Generator().manual_seed(1))
    x = torch.cat([every, mids, -mids, rand, tiny]).contiguous()
    want = x.to(torch.float8_e4m3fn).view(torch.uint8)
    got = _kernel_cast(x)
    bad = (got != want).nonzero().flatten()
    assert bad.numel() == 0, f"{bad.numel()} mismatches, e.g. {x[bad[:3]].tolist()}: {got[bad[:3]].tolist()} vs {want[bad[:3]].tolist()}"


def test_integer_cast_of_nan_and_inf_is_a_nan_pattern():
    got = _kernel_cast(torch.tensor([float("nan"), float("inf"), -float("inf")]))
    assert all((b & 0x7F) == 0x7F for b in got.tolist())


def _weight(shape, seed: int, dtype=torch.bfloat16) -> torch.Tensor:
    """A weight whose columns span 10 decades: most blocks hold values that land on float8
    subnormals beside their block's largest value."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * torch.logspace(-9, 1, shape[1])
    w[0, : min(5, shape[1])] = 0.0
    return w.to(dtype)


@pytest.mark.parametrize("scale_format", ["fp32", "ue8m0"])
@pytest.mark.parametrize("shape", [(256, 384), (200, 300), (130, 7), (1, 129)])
def test_block_kernel_writes_the_torch_forms_bytes_and_scales(shape, scale_format):
    w = _weight(shape, seed=shape[0] + shape[1])
    q, s = quantize_block_fp8_kernel(w, 128, scale_format)
    rq, rs = quantize_block_fp8_torch(w, 128, scale_format)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))
    assert torch.equal(s, rs)


def test_block_kernel_by_reciprocal_is_torchs_cuda_division():
    """On CUDA torch divides a tensor by a number as a product with the number's fp32 reciprocal;
    the kernel does the same there (here forced on CPU, checked against that product)."""
    w = _weight((256, 256), seed=3, dtype=torch.float32)
    _, s = quantize_block_fp8_kernel(w, 128, "fp32", by_reciprocal=True)
    amax = w.abs().view(2, 128, 2, 128).amax(dim=(1, 3))
    assert torch.equal(s, amax.clamp(1e-12) * (torch.tensor(1.0) / 448.0))


def test_block_kernel_reads_strided_rows_and_writes_into_a_given_buffer():
    """A row-strided view (a slice of a fused weight) is read in place; ``out`` may be a bucket's
    bytes."""
    base = _weight((300, 520), seed=5)
    w = base[:, 8:264]
    assert not w.is_contiguous()
    bucket = torch.full((w.numel() + 64,), 0xAB, dtype=torch.uint8)
    out = bucket[32:32 + w.numel()].view(w.shape)
    q, s = quantize_block_fp8_kernel(w, 128, "fp32", out=out)
    rq, rs = quantize_block_fp8_torch(w.contiguous(), 128, "fp32")
    assert torch.equal(out, rq.view(torch.uint8)) and torch.equal(s, rs)
    assert bucket[:32].eq(0xAB).all() and bucket[32 + w.numel():].eq(0xAB).all()


def test_a_nan_weight_makes_its_block_non_finite_and_no_other():
    w = _weight((256, 256), seed=7)
    w[3, 200] = float("nan")
    q, s = quantize_block_fp8_kernel(w, 128, "fp32")
    assert torch.isnan(s[0, 1]) and torch.isfinite(s[[0, 1, 1], [0, 0, 1]]).all()
    assert torch.isnan(q[:128, 128:].float()).all()
    assert torch.isfinite(q[:128, :128].float()).all() and torch.isfinite(q[128:].float()).all()
    w[3, 200] = float("inf")
    q, s = quantize_block_fp8_kernel(w, 128, "fp32")
    assert not torch.isfinite(s[0, 1]) and not torch.isfinite(q[3, 200].float())


def test_shape_errors_are_named():
    with pytest.raises(ValueError, match="2-D"):
        quantize_block_fp8_kernel(torch.zeros(4, 4, 4), 128)
    with pytest.raises(ValueError, match="scale_format"):
        quantize_block_fp8_kernel(torch.zeros(4, 4), 128, "e8")
    with pytest.raises(ValueError, match="out must be"):
        quantize_block_fp8_kernel(torch.zeros(4, 4), 128, out=torch.empty(4, 5, dtype=torch.uint8))


@pytest.mark.parametrize("dtype", sorted(FP8_NON_FINITE, key=str))
def test_byte_check_finds_every_non_finite_pattern_anywhere(dtype):
    """Against torch's own cast to fp32, for each float8 type: a bucket of every finite byte value
    passes; each non-finite byte value is found at the first byte, at a chunk's last and the next
    chunk's first byte, and at the end."""
    mask, value = FP8_NON_FINITE[dtype]
    every = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    finite = torch.isfinite(every.view(dtype).float())
    assert 0 < int((~finite).sum()) < 256
    n = 2 * CHECK_CHUNK + 17
    ok = every[finite].repeat(n // int(finite.sum()) + 1)[:n].contiguous()
    assert not bool(any_byte_matches(ok, mask, value).item())
    for byte in every[~finite].tolist():
        for pos in (0, CHECK_CHUNK - 1, CHECK_CHUNK, n - 1):
            raw = ok.clone()
            raw[pos] = byte
            assert bool(any_byte_matches(raw, mask, value).item()), (dtype, byte, pos)
    with pytest.raises(ValueError, match="uint8"):
        any_byte_matches(torch.zeros(4, dtype=torch.int8), mask, value)
