"""Log-probabilities and entropy of tokens from vocab-parallel logits (Megatron TP), fused.

With tensor parallelism each rank holds a slice of the vocabulary; gathering full logits would cost
``b * s * V`` memory per rank. Instead the log-sum-exp and the entropy are assembled from per-rank
partial sums (one MAX and one SUM all-reduce in the forward); the backward is local, because
with the global log-sum-exp known, ``d logp / d z_j = [j == target] - p_j`` and
``d H / d z_j = -p_j (z_j - E_p[z])`` involve only this rank's columns.

Why a hand-written autograd function: the plain-autograd version materialised fp32 copies of the
``[tokens, V]`` logits (upcast, shifted, exp, their products) and kept two of them for the backward.
At a 152k vocabulary and 4k tokens that is 2.5 GB per tensor and ~25 full passes over it per
micro-batch, which made it the largest single cost of a 0.5B actor step. Here the logits are kept
in their own dtype (bf16 on GPU: the output layer saves nothing bigger), the fp32 work runs in row
chunks of bounded size, and the backward writes the gradient straight into one tensor of the
logits' dtype. On CUDA the per-chunk math is compiled (one fused kernel per pass) when
:func:`megarl.models.fusions.fusions_enabled` (``MEGARL_FUSIONS``). Vocabulary padding columns (added to make V divisible by TP) are
left out of the softmax and get a zero gradient.
"""
from __future__ import annotations

import logging
import os
from typing import Optional

import torch
import torch.distributed as dist

log = logging.getLogger("megarl.vocab_parallel")

# Elements of one row chunk. Eager: bounds each fp32 temporary (~128 MiB) at any vocab size.
# Compiled: the fused kernels keep no fp32 temporaries (only the chunk's gradient in the logits'
# dtype), so chunks are 8x larger: fewer launches, which matters where a step is host-bound.
_CHUNK_ELEMENTS = 1 << 25
_COMPILED_CHUNK_ELEMENTS = 1 << 28


def _tp():
    from megatron.core import parallel_state as mpu

    if not mpu.model_parallel_is_initialized():
        return 1, 0, None
    return (mpu.get_tensor_model_parallel_world_size(), mpu.get_tensor_model_parallel_rank(),
            mpu.get_tensor_model_parallel_group())


def _forward_chunk(z: torch.Tensor, row_max: torch.Tensor, with_entropy: bool):
    """Partial softmax sums of one row chunk: ``sum exp(z - m)`` and ``sum exp(z - m) (z - m)``."""
    shifted = z.float() - row_max.unsqueeze(-1)
    e = shifted.exp()
    sum_exp = e.sum(-1)
    sum_exp_z = (e * shifted).sum(-1) if with_entropy else sum_exp
    return sum_exp, sum_exp_z


def _backward_chunk(z: torch.Tensor, row_max: torch.Tensor, log_sum_exp: torch.Tensor,
                    expected_z: torch.Tensor, grad_logprob: torch.Tensor, grad_entropy: torch.Tensor):
    """Gradient of one row chunk except the ``+grad_logprob`` at the target column:
    ``p * (-g_lp - g_H * (z - E[z]))`` with ``z`` shifted by the row max."""
    shifted = z.float() - row_max.unsqueeze(-1)
    p = (shifted - log_sum_exp.unsqueeze(-1)).exp()
    g = p * (-grad_logprob.unsqueeze(-1) - grad_entropy.unsqueeze(-1) * (shifted - expected_z.unsqueeze(-1)))
    return g.to(z.dtype)


def _use_compiled(device: torch.device) -> bool:
    """Compiled chunk kernels on CUDA while fusions are on (``MEGARL_FUSIONS=force``: also on CPU)."""
    from megarl.models.fusions import fusions_enabled

    return fusions_enabled() and (device.type == "cuda" or os.environ.get("MEGARL_FUSIONS") == "force")


def _kernels(device: torch.device):
    """(forward_chunk, backward_chunk) for this device."""
    if not _use_compiled(device):
        return _forward_chunk, _backward_chunk
    from megarl.models.fusions import compiled

    return compiled("logprob_forward_chunk", _forward_chunk), compiled("logprob_backward_chunk", _backward_chunk)


def _chunk_rows(rows: int, cols: int, device: torch.device) -> int:
    elements = _COMPILED_CHUNK_ELEMENTS if _use_compiled(device) else _CHUNK_ELEMENTS
    return max(1, min(rows, elements // max(cols, 1)))


class _LogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, vocab_start, valid_cols, with_entropy, group):
        rows = logits.shape[0]
        z = logits[:, :valid_cols]
        fwd, _ = _kernels(logits.device)
        if valid_cols > 0:
            row_max = z.amax(dim=-1).float()
        else:
            row_max = torch.full((rows,), float("-inf"), device=logits.device)
        if group is not None:
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        sums = torch.zeros(3, rows, dtype=torch.float32, device=logits.device)  # sum_exp, sum_exp_z, picked
        step = _chunk_rows(rows, valid_cols, logits.device)
        if valid_cols > 0:
            for r0 in range(0, rows, step):
                s, sz = fwd(z[r0:r0 + step], row_max[r0:r0 + step], with_entropy)
                sums[0, r0:r0 + step] = s
                sums[1, r0:r0 + step] = sz
        local_t = targets - vocab_start
        in_range = (local_t >= 0) & (local_t < valid_cols)
        idx = local_t.clamp(0, max(valid_cols - 1, 0))
        if valid_cols > 0:
            picked = z.gather(-1, idx.unsqueeze(-1)).squeeze(-1).float() - row_max
            sums[2] = torch.where(in_range, picked, torch.zeros_like(picked))
        if group is not None:
            dist.all_reduce(sums, group=group)
        sum_exp, sum_exp_z, picked = sums[0], sums[1], sums[2]
        log_sum_exp = sum_exp.log()
        logprob = picked - log_sum_exp
        expected_z = sum_exp_z / sum_exp
        entropy = log_sum_exp - expected_z if with_entropy else None
        ctx.save_for_backward(logits, row_max, log_sum_exp, expected_z, idx, in_range)
        ctx.valid_cols = valid_cols
        return logprob, entropy if entropy is not None else torch.zeros_like(logprob)

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy):
        logits, row_max, log_sum_exp, expected_z, idx, in_range = ctx.saved_tensors
        valid = ctx.valid_cols
        rows = logits.shape[0]
        grad = torch.zeros_like(logits)
        if grad_logprob is None:
            grad_logprob = torch.zeros(rows, device=logits.device)
        if grad_entropy is None:
            grad_entropy = torch.zeros(rows, device=logits.device)
        grad_logprob, grad_entropy = grad_logprob.float().contiguous(), grad_entropy.float().contiguous()
        if valid > 0:
            _, bwd = _kernels(logits.device)
            z = logits[:, :valid]
            step = _chunk_rows(rows, valid, logits.device)
            for r0 in range(0, rows, step):
                sl = slice(r0, r0 + step)
                grad[sl, :valid] = bwd(z[sl], row_max[sl], log_sum_exp[sl], expected_z[sl],
                                       grad_logprob[sl], grad_entropy[sl])
            at_target = torch.where(in_range, grad_logprob, torch.zeros_like(grad_logprob)).to(grad.dtype)
            grad.scatter_add_(-1, idx.unsqueeze(-1), at_target.unsqueeze(-1))
        return grad, None, None, None, None, None


def logprobs_and_entropy(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int,
                         with_entropy: bool = True) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``logits`` ``[..., V/tp]`` (this rank's slice, any float dtype), ``targets`` ``[...]`` global
    token ids. Returns (log p(target), entropy or None) of shape ``[...]``, fp32, differentiable."""
    tp, rank, group = _tp()
    lead = logits.shape[:-1]
    local_v = logits.shape[-1]
    start = rank * local_v
    valid = max(0, min(local_v, vocab_size - start))
    flat = logits.reshape(-1, local_v)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    lp, ent = _LogprobEntropy.apply(flat, targets.reshape(-1).to(logits.device), start, valid, with_entropy,
                                    group if tp > 1 else None)
    return lp.reshape(lead), (ent.reshape(lead) if with_entropy else None)
