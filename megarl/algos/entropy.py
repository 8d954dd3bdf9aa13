"""Entropy and log-probs from logits, and the entropy bonus."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .aggregation import aggregate_loss


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy ``H = logsumexp(z) - sum softmax(z) z`` of each categorical over the last dim.

    Works on ``[..., vocab]`` and returns ``[...]``; differentiable. Numerically stable for large
    logits (no ``log(softmax)`` of tiny probabilities). With tensor-parallel vocab shards the
    trainer must reduce across shards itself; this helper expects the full vocabulary.
    """
    logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    p = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (p * logits).sum(dim=-1)


def logprobs_from_logits(logits: Tensor, labels: Tensor) -> Tensor:
    """``log softmax(logits)[label]`` for each position: ``[..., vocab]`` x ``[...]`` -> ``[...]``."""
    logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    lse = torch.logsumexp(logits, dim=-1)
    picked = torch.gather(logits, -1, labels.long().unsqueeze(-1)).squeeze(-1)
    return picked - lse


def entropy_bonus(entropy: Tensor, mask: Tensor, agg_mode: str = "token-mean", *,
                  num_tokens: Optional[float] = None, num_seqs: Optional[float] = None,
                  norm_len: Optional[float] = None) -> Tensor:
    """Aggregated policy entropy, the bonus of PPO (Schulman et al. 2017, eq. 9: the objective
    adds ``c2 * S[pi]``). The trainer's loss is ``pg_loss - entropy_coef * entropy_bonus(...)``;
    use the same ``agg_mode`` as the policy loss so both weigh tokens alike."""
    return aggregate_loss(entropy, mask, agg_mode, num_tokens=num_tokens, num_seqs=num_seqs,
                          norm_len=norm_len)
