"""Block-quantized FP8 (`float8_e4m3fn` + one `weight_scale_inv` per 128x128 block).

Why: DeepSeek-V3's checkpoints and SGLang serve weights in this layout, so a push to an FP8
server must produce exactly these bytes. Pure tensor functions; no engine or transport here.

Two scale conventions exist:
- ``"ue8m0"``: scales rounded up to a power of two (DeepGEMM, and SGLang's
  ``per_block_cast_to_fp8``); amax is clamped at 1e-4.
- ``"fp32"``: scale = amax / 448 in fp32 (the DeepSeek-V3 checkpoint convention).
The padded tail block (dims not a multiple of 128) counts only the real elements, as zeros pad it.
"""

from __future__ import annotations

from typing import Literal

import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn
BLOCK = 128
ScaleFormat = Literal["ue8m0", "fp32"]


def _ceil_pow2(x: torch.Tensor) -> torch.Tensor:
    """Smallest power of two >= x for positive fp32 x, by exponent bits (exact, no log2 rounding)."""
    bits = x.float().abs().view(torch.int32)
    exp = (bits >> 23) & 0xFF
    exp = (exp + ((bits & 0x7FFFFF) != 0).to(torch.int32)).clamp(1, 254)
    return (exp << 23).view(torch.float32)


# fp32 elements of the scaled copy made at a time: the multiply runs in fp32 (as SGLang's does), so
# a whole 7B projection at once would be a 272 MB temporary beside the push's buckets
_SCALE_CHUNK_ELEMENTS = 1 << 24


def _block_amax(view: torch.Tensor) -> torch.Tensor:
    """max |x| of each block, in fp32: the larger of the block's max and -min, read in place (no
    |x| copy of the weight); equal to ``view.abs().float().amax(...)`` bit for bit (max and min of
    the stored values are exact, NaN propagates through both)."""
    high = view.amax(dim=(1, 3), keepdim=True)
    low = view.amin(dim=(1, 3), keepdim=True)
    return torch.maximum(high, low.neg()).float()


def _scale_to_fp8(view: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    """``(view * inv).to(float8_e4m3fn)`` with the product in fp32, a band of block rows at a time."""
    out = torch.empty(view.shape, dtype=torch.float8_e4m3fn, device=view.device)
    rows = max(1, _SCALE_CHUNK_ELEMENTS // max(1, view[0].numel()))
    for i in range(0, view.shape[0], rows):
        out[i:i + rows] = view[i:i + rows] * inv[i:i + rows]
    return out


def quantize_block_fp8(w: torch.Tensor, block: int = BLOCK,
                       scale_format: ScaleFormat = "ue8m0") -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight of w's shape, fp32 weight_scale_inv of shape ceil(m/b) x ceil(n/b)).

    CUDA tensors go through the single-pass kernel of `fp8_kernels` (the same bytes, tested);
    others through `quantize_block_fp8_torch`."""
    if w.dim() == 2 and w.is_cuda:
        from .fp8_kernels import quantize_block_fp8_kernel
        return quantize_block_fp8_kernel(w, block, scale_format)
    return quantize_block_fp8_torch(w, block, scale_format)


def quantize_block_fp8_torch(w: torch.Tensor, block: int = BLOCK,
                             scale_format: ScaleFormat = "ue8m0") -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_block_fp8` in torch operations: the reference the kernel is tested against.

    The bytes are SGLang's ``per_block_cast_to_fp8`` (tests/test_fp8_block.py runs SGLang's own
    function): a weight whose dims are whole blocks is read where it lies (no padded copy, no
    slice copied out at the end); only a partial tail block pads with zeros."""
    if w.dim() != 2:
        raise ValueError(f"block FP8 quantizes 2-D weights, got shape {tuple(w.shape)}")
    m, n = w.shape
    pm, pn = -(-m // block) * block, -(-n // block) * block
    aligned = (pm, pn) == (m, n)
    if aligned:
        padded = w.contiguous()
    else:
        padded = torch.zeros((pm, pn), dtype=w.dtype, device=w.device)
        padded[:m, :n] = w
    view = padded.view(pm // block, block, pn // block, block)
    amax = _block_amax(view)
    if scale_format == "ue8m0":
        scale = _ceil_pow2(amax.clamp(1e-4) / FP8_MAX)
    else:
        scale = amax.clamp(1e-12) / FP8_MAX
    q = _scale_to_fp8(view, 1.0 / scale).view(pm, pn)
    return (q if aligned else q[:m, :n].contiguous()), scale.view(pm // block, pn // block)


def dequantize_block_fp8(q: torch.Tensor, scale_inv: torch.Tensor, block: int = BLOCK,
                         dtype: torch.dtype = torch.bfloat16, row0: int = 0, col0: int = 0,
                         out: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse of `quantize_block_fp8` up to FP8 rounding: each block times its scale.

    ``q`` may be a slice of the quantized matrix starting at (``row0``, ``col0``) while
    ``scale_inv`` is the FULL matrix's scale grid (a tensor-parallel rank's shard of a weight whose
    shard edges need not fall on block edges). ``out``: write there (same shape) instead of
    allocating."""
    m, n = q.shape
    rows = torch.arange(row0, row0 + m, device=q.device) // block
    cols = torch.arange(col0, col0 + n, device=q.device) // block
    s = scale_inv.float().index_select(0, rows).index_select(1, cols)
    w = q.float() * s
    if out is None:
        return w.to(dtype)
    return out.copy_(w)
