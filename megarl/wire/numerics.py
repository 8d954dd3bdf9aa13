"""Logit numerics both ends agree on: the fp32 LM head (SGLang's ``--enable-fp32-lm-head``) is
computed the same way by the trainer and the embedded engine, so their logprobs differ only by
kernel noise."""
from __future__ import annotations

import torch


def fp32_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``hidden @ weight.T`` with fp32 accumulation and fp32 output, from hidden states and weights
    in any dtype (the fp32 LM head: SGLang's ``--enable-fp32-lm-head``). bf16/fp16 values are
    exact in fp32, so this only removes the rounding of the logits to 8 (or 11) mantissa bits --
    at a logit of 20 a bf16 rounding step is 0.125, larger than the whole bf16 noise floor.
    On CUDA it is SGLang's own call, ``torch.mm(..., out_dtype=torch.float32)`` (no fp32 copy of
    the weight); elsewhere both operands are upcast (CPU has no mixed-dtype GEMM)."""
    lead = hidden.shape[:-1]
    flat = hidden.reshape(-1, hidden.shape[-1])
    out = None
    if (flat.is_cuda and flat.dtype == weight.dtype and flat.dtype in (torch.bfloat16, torch.float16)
            and not torch.is_grad_enabled()):
        try:
            out = torch.mm(flat, weight.t(), out_dtype=torch.float32)
        except (RuntimeError, TypeError, NotImplementedError):  # a torch/GPU without the mixed-dtype GEMM
            out = None
    if out is None:
        out = torch.mm(flat.float(), weight.float().t())
    return out.reshape(*lead, weight.shape[0])
