"""Weight gradients accumulated straight into megatron's ``main_grad`` without Apex or Transformer
Engine (megatron-core's ``gradient_accumulation_fusion``).

Why: without the fusion, megatron's linear layers compute each weight gradient into a fresh
``param.grad`` (in the model dtype, bf16 on the GPU) and megatron's DDP hook then adds it into the
fp32 ``main_grad`` buffer: two kernels, a weight-sized temporary and a bf16 rounding of every
micro-batch's weight gradient. With the fusion, the weight-gradient GEMM accumulates into
``main_grad`` itself. megatron gates the fusion on Apex's ``fused_weight_gradient_mlp_cuda``
extension; where Apex is missing, :data:`WGRAD_ACCUMULATE` stands in for it with torch's own GEMMs:

* same dtype (fp32 on CPU, or bf16 gradients with a bf16 ``main_grad``): ``main_grad.addmm_``;
* bf16 inputs into an fp32 ``main_grad`` (the GPU's case): ``torch.addmm(..., out_dtype=fp32,
  out=main_grad)``, cuBLAS accumulating in fp32 -- used only after a probe on the device checked it
  against ``main_grad + g.float().T @ x.float()`` (:func:`mixed_accumulate_works`); otherwise the GEMM
  goes to bf16 first and is added (the unfused path's numbers and kernels, without its hook).

:func:`install_wgrad_accumulation` turns the fusion on, after DDP has given every trainable weight
its ``main_grad``, for the local (non-TE) ``ColumnParallelLinear`` / ``RowParallelLinear`` layers
that own a trainable weight. Left alone: frozen weights (LoRA's base, whose ``main_grad`` does not
exist), layers that borrow their weight at call time (the output layer tied to the embedding), the
fp32 LM head (``models/fp32_head.py`` calls the layer with an fp32 copy of its weight, which has no
``main_grad``: megatron's fused backward would fail on it), and everything when megatron already has
Apex's extension (its kernel is then used). A train phase
bound by kernel launches (benchmarks/RESULTS.md, train phase host cost) saves one launch per linear layer per
micro-batch: four per transformer layer.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Iterable

import torch


@lru_cache(maxsize=None)
def mixed_accumulate_works(device: str, in_dtype: torch.dtype, acc_dtype: torch.dtype) -> bool:
    """Whether ``torch.addmm(c, a, b, out_dtype=acc_dtype, out=c)`` accumulates ``in_dtype`` inputs
    into ``c`` correctly on ``device`` (checked once per process and combination)."""
    try:
        g = torch.Generator(device="cpu").manual_seed(0)
        a = torch.randn(16, 8, generator=g).to(device=device, dtype=in_dtype)
        b = torch.randn(8, 24, generator=g).to(device=device, dtype=in_dtype)
        c = torch.randn(16, 24, generator=g).to(device=device, dtype=acc_dtype)
        want = c.double() + a.double() @ b.double()
        torch.addmm(c, a, b, out_dtype=acc_dtype, out=c)
        return bool(torch.allclose(c.double(), want, rtol=1e-5, atol=1e-5))
    except (RuntimeError, TypeError, NotImplementedError):
        return False


def accumulate_wgrad(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """``main_grad += grad_output^T @ total_input`` over the flattened leading dimensions."""
    x = total_input.reshape(-1, total_input.shape[-1])
    g = grad_output.reshape(-1, grad_output.shape[-1])
    if g.dtype == main_grad.dtype:
        main_grad.addmm_(g.t(), x)
    elif mixed_accumulate_works(str(main_grad.device), g.dtype, main_grad.dtype):
        torch.addmm(main_grad, g.t(), x, out_dtype=main_grad.dtype, out=main_grad)
    else:
        main_grad.add_(torch.mm(g.t(), x))


class _WgradAccumulate:
    """The two functions megatron calls on Apex's ``fused_weight_gradient_mlp_cuda``."""

    @staticmethod
    def wgrad_gemm_accum_fp32(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
        accumulate_wgrad(total_input, grad_output, main_grad)

    @staticmethod
    def wgrad_gemm_accum_fp16(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
        accumulate_wgrad(total_input, grad_output, main_grad)


WGRAD_ACCUMULATE = _WgradAccumulate()


def install_wgrad_accumulation(modules: Iterable[torch.nn.Module]) -> int:
    """Turn megatron's ``gradient_accumulation_fusion`` on for every local linear layer under
    ``modules`` whose own weight is trainable and has a ``main_grad`` (call after DDP wraps the
    model). Returns how many layers were switched."""
    from megatron.core.tensor_parallel import layers

    if getattr(layers, "fused_weight_gradient_mlp_cuda", None) is None:
        layers.fused_weight_gradient_mlp_cuda = WGRAD_ACCUMULATE
    switched = 0
    for root in modules:
        for module in root.modules():
            if not isinstance(module, (layers.ColumnParallelLinear, layers.RowParallelLinear)):
                continue
            weight = getattr(module, "weight", None)
            if getattr(module, "_megarl_fp32", False):   # called with an fp32 copy of its weight
                continue
            if isinstance(weight, torch.nn.Parameter) and weight.requires_grad and hasattr(weight, "main_grad"):
                module.gradient_accumulation_fusion = True
                switched += 1
    return switched
