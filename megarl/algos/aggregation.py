"""Loss aggregation: how a ``[batch, T]`` matrix of per-token losses becomes one scalar.

The choice changes the weight each token gets in the gradient, and it is one of the differences
between GRPO, DAPO and Dr.GRPO:

``token-mean``               ``sum_{i,t} m_it l_it / sum_{i,t} m_it``
    Every valid token of the batch weighs the same. DAPO (Yu et al. 2025, "DAPO: An Open-Source
    LLM Reinforcement Learning System at Scale", token-level policy gradient loss) uses it so long
    responses are not under-weighted.
``seq-mean-token-mean``      ``1/B sum_i ( sum_t m_it l_it / sum_t m_it )``
    Original GRPO (Shao et al. 2024, DeepSeekMath): average inside each sequence, then over
    sequences. A token of a short response weighs more than one of a long response.
``seq-mean-token-sum``       ``1/B sum_i sum_t m_it l_it``
    Sum inside each sequence, mean over sequences: long responses weigh proportionally more.
``seq-mean-token-sum-norm``  ``1/B sum_i sum_t m_it l_it / L``
    Dr.GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective"):
    removes the per-response ``1/|o_i|`` length normalisation of GRPO (which biases towards long
    wrong answers) and divides by a *constant* ``L`` (the generation budget) instead. ``L``
    defaults to ``T = mask.shape[-1]``; pass ``norm_len=max_response_length`` so it does not
    depend on how much a batch happened to be padded. Note: older verl releases divide the
    summed loss by ``L`` only (no ``1/B``); megarl, like the paper's ``1/G`` and newer verl, takes
    the mean over responses.

Micro-batches and data parallelism: a scalar that must equal the loss of the *global* batch when
the trainer splits it and sums gradients needs the global denominators. Pass ``num_tokens`` (for
``token-mean``) or ``num_seqs`` (for the ``seq-mean-*`` modes) to replace the local count; the
numerator stays local. With those set, the per-micro-batch losses *sum* to the global loss.
"""
from __future__ import annotations

from typing import Optional

from torch import Tensor

from .masked import as_bool_mask, sanitize

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def aggregate_loss(loss_mat: Tensor, mask: Tensor, mode: str = "token-mean", *,
                   num_tokens: Optional[float] = None, num_seqs: Optional[float] = None,
                   norm_len: Optional[float] = None) -> Tensor:
    """Reduce a per-token loss ``[batch, T]`` to a scalar with ``mode`` (see module docstring).

    Args:
        loss_mat: per-token loss, ``[batch, T]``; padded positions may hold anything.
        mask: ``[batch, T]`` float/bool response mask.
        mode: one of :data:`AGG_MODES`.
        num_tokens: global valid-token count for ``token-mean`` (default: this batch's count).
        num_seqs: global sequence count for ``seq-mean-*`` (default: ``batch``). Sequences
            with no valid token still count in ``batch``; their loss is 0.
        norm_len: the constant ``L`` of ``seq-mean-token-sum-norm`` (default ``T``).
    """
    if loss_mat.shape != mask.shape:
        raise ValueError(f"loss {tuple(loss_mat.shape)} and mask {tuple(mask.shape)} differ")
    if loss_mat.dim() != 2:
        raise ValueError("aggregate_loss expects [batch, T] tensors")
    m = as_bool_mask(mask)
    x = sanitize(loss_mat, m)
    batch = loss_mat.shape[0] if num_seqs is None else num_seqs
    check_agg_mode(mode)
    if mode == "token-mean":
        denom = m.sum().to(x.dtype).clamp(min=1) if num_tokens is None else num_tokens
        return x.sum() / denom
    if mode == "seq-mean-token-sum":
        return x.sum(dim=-1).sum() / batch
    if mode == "seq-mean-token-mean":
        per_seq = x.sum(dim=-1) / m.sum(dim=-1).to(x.dtype).clamp(min=1)
        return per_seq.sum() / batch
    # seq-mean-token-sum-norm
    length = loss_mat.shape[-1] if norm_len is None else norm_len
    return x.sum(dim=-1).sum() / (batch * length)


def check_agg_mode(mode: str) -> None:
    """Raise ``ValueError`` unless ``mode`` is a known aggregation mode."""
    if mode not in AGG_MODES:
        raise ValueError(f"unknown loss aggregation mode {mode!r}; known: {AGG_MODES}")


__all__ = ["AGG_MODES", "aggregate_loss", "check_agg_mode"]
