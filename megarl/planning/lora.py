"""LoRA in the memory plan: the adapters' parameters per GPU, and the trained state they replace.

With ``actor.lora.rank > 0`` the actor's base weights are frozen: they cost their parameter bytes
only (no fp32 gradient buffer, no master copy, no Adam moments); the adapters are trained as
ordinary dense parameters. The reference role is not built (the actor with adapters off is the
reference), so the plan has no ``ref`` role.

Adapter parameters of one projection with input width ``i`` and output width ``o`` on a GPU of a
tensor-parallel group of ``t`` ranks, as megarl lays them out (``megarl/models/lora.py``):
column-parallel (q, k, v, gate, up): ``r * i + r * o / t``; row-parallel (o, down):
``r * i / t + r * o``. Adapted: attention q/k/v/o (MLA: o only) of every layer, dense MLP
gate/up/down (MoE layers' experts are not adapted).
"""
from __future__ import annotations

from typing import Any, Iterable

from megarl.planning.params import MLA_V, head_dim, is_mla, is_moe_layer

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")


def projection_shapes(arch: Any, index: int) -> dict[str, tuple[int, int]]:
    """(input, output) width of each adaptable HF projection of layer ``index``."""
    h, nh = arch.hidden_size, arch.num_attention_heads
    out: dict[str, tuple[int, int]] = {}
    if is_mla(arch):
        out["o_proj"] = (nh * MLA_V, h)
    else:
        hd = head_dim(arch)
        out.update(q_proj=(h, nh * hd), k_proj=(h, arch.num_kv_heads * hd), v_proj=(h, arch.num_kv_heads * hd),
                   o_proj=(nh * hd, h))
    if not is_moe_layer(arch, index):
        f = arch.ffn_hidden_size
        out.update(gate_proj=(h, f), up_proj=(h, f), down_proj=(f, h))
    return out


def adapter_params(arch: Any, lora: Any, tp: int, layers: Iterable[int]) -> int:
    """Adapter parameters one GPU holds for ``layers`` (its pipeline stage) at tensor-parallel ``tp``."""
    r, total = lora.rank, 0
    for index in layers:
        for name, (i, o) in projection_shapes(arch, index).items():
            if name not in lora.target_modules:
                continue
            total += r * i + r * o // tp if name in COLUMN else r * i // tp + r * o
    return total


def lora_state_bytes(arch: Any, lora: Any, tp: int, layers: Iterable[int], base_params: int, weight_bytes: int,
                     dp_shards: int) -> tuple[int, int, int, int]:
    """(params, grads, optimizer, trainable) bytes/count of a LoRA actor's stage on one GPU: the
    frozen base and the adapters in the model dtype, fp32 gradients, fp32 master (non-fp32 models)
    and Adam moments for the adapters only (over ``dp_shards`` with the distributed optimizer)."""
    trainable = adapter_params(arch, lora, tp, layers)
    master = 0 if weight_bytes == 4 else 4
    return ((base_params + trainable) * weight_bytes, trainable * 4,
            int(trainable * (master + 8) / dp_shards), trainable)
