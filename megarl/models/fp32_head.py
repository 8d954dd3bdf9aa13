"""The trainer's fp32 LM head: megatron's output layer computed in fp32, as the rollout's
(SGLang ``--enable-fp32-lm-head``, the embedded server's flag of the same name).

The bf16 hidden states and the bf16 output weight (or the tied embedding) are upcast -- exact --
and multiplied in fp32, so the logits are never rounded to bf16; the log-softmax of
``workers/vocab_parallel.py`` is fp32 already. Gradients flow back through the casts to the bf16
parameters unchanged in meaning. Cost: the logits ``[tokens, V/tp]`` are fp32 (twice the bf16
memory) and each forward makes an fp32 copy of this rank's ``[V/tp, hidden]`` weight shard.
"""
from __future__ import annotations

from typing import Any

import torch


def _fp32_pre_hook(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict]:
    """Forward pre-hook of a megatron ``ColumnParallelLinear`` output layer: call it with fp32
    input and an fp32 weight (megatron accepts a ``weight=`` argument: tied embeddings use it)."""
    hidden = args[0] if args else kwargs.pop("input_")
    weight = kwargs.get("weight")
    if weight is None:
        weight = module.weight
    kwargs["weight"] = weight.float()
    return (hidden.float(),) + tuple(args[1:]), kwargs


def use_fp32_output_layer(model: torch.nn.Module) -> None:
    """Make ``model.output_layer`` (a megatron GPTModel's LM head) compute in fp32 (idempotent)."""
    layer = getattr(model, "output_layer", None)
    if layer is None or getattr(layer, "_megarl_fp32", False):
        return
    layer.register_forward_pre_hook(_fp32_pre_hook, with_kwargs=True)
    layer._megarl_fp32 = True
