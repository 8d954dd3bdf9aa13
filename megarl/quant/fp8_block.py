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


def quantize_block_fp8(w: torch.Tensor, block: int = BLOCK,
                       scale_format: ScaleFormat = "ue8m0") -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight of w's shape, fp32 weight_scale_inv of shape ceil(m/b) x ceil(n/b))."""
    if w.dim() != 2:
        raise ValueError(f"block FP8 quantizes 2-D weights, got shape {tuple(w.shape)}")
    m, n = w.shape
    pm, pn = -(-m // block) * block, -(-n // block) * block
    padded = torch.zeros((pm, pn), dtype=w.dtype, device=w.device)
    padded[:m, :n] = w
    view = padded.view(pm // block, block, pn // block, block)
    amax = view.abs().float().amax(dim=(1, 3), keepdim=True)
    if scale_format == "ue8m0":
        scale = _ceil_pow2(amax.clamp(1e-4) / FP8_MAX)
    else:
        scale = amax.clamp(1e-12) / FP8_MAX
    q = (view * (1.0 / scale)).to(torch.float8_e4m3fn)
    return q.view(pm, pn)[:m, :n].contiguous(), scale.view(pm // block, pn // block)


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
