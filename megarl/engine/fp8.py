"""Block-FP8 weights in the embedded engine: what a served FP8 checkpoint stores, and its compute copy.

Why: a server started from an FP8 block-quantized checkpoint (DeepSeek-V3's format, or one made by
`megarl convert hf-to-fp8`) receives ``X.weight`` in ``float8_e4m3fn`` and ``X.weight_scale_inv``
(one fp32 scale per 128x128 block) on every push, as SGLang does. The engine keeps exactly those
bytes (so a push is checked and applied like SGLang's loader would) and computes with a
dequantized copy in its own dtype, refreshed once after the weights changed: its outputs are those
of the FP8-rounded weights, which is what rollout-vs-trainer correction has to see.

Which weights: the linear projections (attention q/k/v/o, MLP gate/up/down, routed experts),
as DeepSeek-V3 and SGLang's FP8 linears do; norms, embeddings, the router and the LM head stay in
high precision. Each TP rank stores its slice of the FP8 weight and the FULL scale grid (a few
KB), so shard edges need not fall on block edges.
"""
from __future__ import annotations

from typing import Dict, List, Tuple

import torch

from megarl.quant.fp8_block import dequantize_block_fp8

from .shard import local_shape, split_dim

QUANTIZED = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
             "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
             "mlp.experts.gate_proj", "mlp.experts.up_proj", "mlp.experts.down_proj")
FP8_KEY, SCALE_KEY = "#fp8", "#scale"


def scale_grid(shape: Tuple[int, ...], block: int) -> Tuple[int, ...]:
    """Scale shape of a weight (stacked experts keep their leading dim)."""
    return tuple(shape[:-2]) + (-(-shape[-2] // block), -(-shape[-1] // block))


class Fp8Store:
    """The FP8 storage entries of one rank's model and how they become compute weights."""

    def __init__(self, full_shapes: Dict[str, Tuple[int, ...]], block: int, tp_rank: int, tp_size: int):
        self.block, self.tp_rank, self.tp_size = block, tp_rank, tp_size
        self.full_shapes = {n: tuple(s) for n, s in full_shapes.items() if n.endswith(QUANTIZED)}

    def is_quantized(self, internal: str) -> bool:
        return internal in self.full_shapes

    def entries(self) -> List[Tuple[str, Tuple[int, ...], torch.dtype]]:
        """(storage key, this rank's shape, dtype) of every FP8 weight and scale grid."""
        out = []
        for n, shp in self.full_shapes.items():
            out.append((n + FP8_KEY, tuple(local_shape(n, shp, self.tp_rank, self.tp_size)), torch.float8_e4m3fn))
            out.append((n + SCALE_KEY, scale_grid(shp, self.block), torch.float32))
        return out

    def hf_scale_shape(self, internal: str) -> Tuple[int, ...]:
        """Full shape of one HF scale tensor (one expert's for stacked experts)."""
        grid = scale_grid(self.full_shapes[internal], self.block)
        return grid[-2:]

    def dequantize(self, params: Dict[str, torch.Tensor]) -> None:
        """Write every compute weight from its FP8 bytes and scales (this rank's slice)."""
        for n in self.full_shapes:
            q, s, out = params[n + FP8_KEY], params[n + SCALE_KEY], params[n]
            d = split_dim(n)
            shift = 0 if d is None or self.tp_size == 1 else self.tp_rank * q.shape[d]
            row_dim = q.dim() - 2
            row0 = shift if d == row_dim else 0
            col0 = shift if d == row_dim + 1 else 0
            if q.dim() == 2:
                dequantize_block_fp8(q, s, self.block, out.dtype, row0, col0, out=out)
                continue
            for e in range(q.shape[0]):
                dequantize_block_fp8(q[e], s[e], self.block, out.dtype, row0, col0, out=out[e])

