"""Worker side of LoRA: attach the actor's adapters, run the base model as the reference, hand out
the adapters in PEFT's names.

Why in the worker: adapters must be attached after the base weights are loaded and before
megatron's DDP wraps the chunks (so the frozen base gets no gradient buffer and no optimizer
state); the reference pass is the same ranks and weights with the adapters switched off, so a LoRA
run builds no reference role at all.
"""
from __future__ import annotations

from typing import Any

import torch


def attach_adapters(worker: Any) -> int:
    """Freeze the loaded base and attach adapters (actor with ``actor.lora.rank > 0``); returns this
    rank's trainable parameter count (0 when LoRA is off)."""
    from megarl.models.lora import apply_lora, spec_from_config

    spec = spec_from_config(worker.cfg.actor.lora, worker.cfg.seed)
    if spec is None or worker.spec.role != "actor":
        return 0

    return apply_lora(worker.chunks, spec)


def reference_logprobs(worker: Any, shard: Any, with_entropy: bool = False):
    """``compute_logprobs`` of the base model: the actor's ranks with every adapter off."""
    from megarl.models.lora import adapters_disabled

    with adapters_disabled(worker.chunks):
        return worker.compute_logprobs(shard, with_entropy)


def adapter_tensors(worker: Any) -> dict[str, torch.Tensor]:
    """This rank's adapters in PEFT's names (full tensors) from the rank that owns them for export:
    tp_rank 0 and dp_rank 0 of each pipeline stage; empty elsewhere. Every TP rank gathers."""
    from megatron.core import parallel_state as mpu

    from megarl.models.lora import peft_state_dict

    tensors = peft_state_dict(worker.chunks)
    owner = mpu.get_tensor_model_parallel_rank() == 0 and mpu.get_data_parallel_rank(with_context_parallel=True) == 0
    return tensors if owner else {}
