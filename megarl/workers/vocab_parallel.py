"""Log-probabilities and entropy of tokens from vocab-parallel logits (Megatron TP).

With tensor parallelism each rank holds a slice of the vocabulary; gathering full logits would cost
``b * s * V`` memory per rank. Instead the log-sum-exp and the entropy are assembled from per-rank
partial sums with all-reduces whose backward is the identity (megatron's
``reduce_from_tensor_model_parallel_region``), so gradients are exact. Vocabulary padding rows
(added to make V divisible by TP) are excluded from the softmax.
"""
from __future__ import annotations

import torch


def _tp():
    from megatron.core import parallel_state as mpu

    if not mpu.model_parallel_is_initialized():
        return 1, 0, None
    return (mpu.get_tensor_model_parallel_world_size(), mpu.get_tensor_model_parallel_rank(),
            mpu.get_tensor_model_parallel_group())


def logprobs_and_entropy(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int,
                         with_entropy: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``logits`` ``[..., V/tp]`` (this rank's slice), ``targets`` ``[...]`` global token ids.
    Returns (log p(target), entropy) of shape ``[...]``, fp32, differentiable."""
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    tp, rank, group = _tp()
    logits = logits.float()
    local_v = logits.shape[-1]
    start = rank * local_v
    vocab_ids = torch.arange(start, start + local_v, device=logits.device)
    if start + local_v > vocab_size:
        logits = logits.masked_fill(vocab_ids >= vocab_size, torch.finfo(logits.dtype).min)
    reduce = reduce_from_tensor_model_parallel_region if tp > 1 else (lambda x: x)

    local_max = logits.detach().max(dim=-1).values
    if tp > 1:
        torch.distributed.all_reduce(local_max, op=torch.distributed.ReduceOp.MAX, group=group)
    shifted = logits - local_max.unsqueeze(-1)
    exp = shifted.exp()
    sum_exp = reduce(exp.sum(dim=-1))
    log_z = sum_exp.log()

    in_range = (targets >= start) & (targets < start + local_v)
    local_target = (targets - start).clamp(0, local_v - 1)
    picked = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
    picked = reduce(torch.where(in_range, picked, torch.zeros_like(picked)))
    logprobs = picked - log_z
    entropy = None
    if with_entropy:
        expected = reduce((exp * shifted).sum(dim=-1)) / sum_exp
        entropy = log_z - expected
    return logprobs, entropy
