"""Which slice of each HF weight a tensor-parallel rank of the embedded server keeps.

Megatron-style TP over the decoder (the layout SGLang's TP ranks use too):
  * attention: q/k/v projections column-parallel (rank r keeps query heads
    [r*H/N, (r+1)*H/N) and kv heads [r*KV/N, (r+1)*KV/N) -- whole heads, so a query head's kv
    head stays on its rank); o_proj row-parallel, partial outputs all-reduced;
  * MLP: gate/up column-parallel, down row-parallel + all-reduce; Qwen3-MoE experts the same on
    their intermediate dim, every rank holding a slice of every expert (routing is replicated);
  * replicated: embeddings, lm_head, norms (incl. q/k norms over head_dim), the router, and the
    o_proj / down_proj biases (added once, after the all-reduce).
Weights always arrive as FULL HF tensors (checkpoint names and shapes); each rank verifies the full
tensor and copies in its slice.
"""
from __future__ import annotations

from typing import List, Optional

import torch

# HF names (and the server's stacked expert names) split along dim 0 / dim 1 / dim 2
_DIM0 = ("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias",
         "gate_proj.weight", "gate_proj.bias", "up_proj.weight", "up_proj.bias")
_DIM1 = ("o_proj.weight", "down_proj.weight", "experts.gate_proj", "experts.up_proj")
_DIM2 = ("experts.down_proj",)


def split_dim(name: str) -> Optional[int]:
    """The dim along which `name` is split over TP ranks; None = replicated."""
    if name.endswith(_DIM2):
        return 2
    if name.endswith(_DIM1):
        return 1
    if name.endswith(_DIM0):
        return 0
    return None


def local_shape(name: str, full_shape, rank: int, size: int) -> tuple:
    """Shape of rank `rank`'s slice of a tensor of `full_shape`."""
    shape = list(full_shape)
    d = split_dim(name)
    if d is not None and size > 1:
        shape[d] //= size
    return tuple(shape)


def local_part(name: str, full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Rank `rank`'s slice of the full tensor `full` (a view: no copy)."""
    d = split_dim(name)
    if d is None or size == 1:
        return full
    n = full.shape[d] // size
    return full.narrow(d, rank * n, n)


def tp_problems(spec, size: int) -> List[str]:
    """Why `size` ranks cannot split this model evenly (empty when they can). `spec` is a
    `model.Spec`; checked before anything loads."""
    if size < 1:
        return [f"--tp-size must be >= 1, got {size}"]
    out = []
    checks = [("num_attention_heads", spec.num_heads), ("num_key_value_heads", spec.num_kv_heads)]
    if len(spec.moe_layers) < spec.num_layers:
        checks.append(("intermediate_size", spec.intermediate_size))
    if spec.moe_layers:
        checks.append(("moe_intermediate_size", spec.moe_intermediate_size))
    for field, value in checks:
        if value % size:
            out.append(f"{field}={value}")
    return out
