"""Staleness of off-policy tokens: pure tensor functions over per-token weight versions.

In an off-policy run (one-step-off or async rollouts, partial rollouts) every response token
carries the weight version ``v`` that sampled it; the trainer at step ``k`` holds version ``k``, so
the token is ``k - v`` versions stale. The behaviour policy of a token is its rollout logprob
(whatever version produced it): the importance weights of ``policy_loss`` (TIS) already use it.
What lives here is the bookkeeping around it: metrics, the oldest token of each sample (the
staleness bound applies to it), and the down-weighting of tokens past the bound.

``versions`` ``[B, T]`` (any integer dtype, right-padded), ``mask`` ``[B, T]`` of real tokens.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .masked import as_bool_mask


def token_staleness(versions: Tensor, current: int) -> Tensor:
    """``current - v`` per token (versions a token is behind the trainer)."""
    return (current - versions).to(torch.int64)


def oldest_version(versions: Tensor, mask: Tensor) -> Tensor:
    """Per sample, the oldest version among its tokens (``[B]``; a sample without tokens gets the
    largest int64, i.e. it is never too stale)."""
    big = torch.iinfo(torch.int64).max
    if versions.shape[-1] == 0:
        return torch.full((versions.shape[0],), big, dtype=torch.int64)
    v = versions.to(torch.int64)
    return torch.where(as_bool_mask(mask), v, torch.full_like(v, big)).min(dim=-1).values


def staleness_stats(versions: Tensor, mask: Tensor, current: int) -> dict[str, float]:
    """Token-mean and max staleness, the share of tokens from older weights, and the share of
    samples whose tokens come from more than one version (partial rollouts)."""
    m = as_bool_mask(mask)
    n = int(m.sum())
    if n == 0:
        return {"staleness_mean": 0.0, "staleness_max": 0.0, "offpolicy_token_frac": 0.0, "mixed_version_frac": 0.0}
    s = token_staleness(versions, current)[m].to(torch.float64)
    v = versions.to(torch.int64)
    big = torch.iinfo(torch.int64).max
    lo = torch.where(m, v, torch.full_like(v, big)).min(dim=-1).values
    hi = torch.where(m, v, torch.full_like(v, -big)).max(dim=-1).values
    has = m.any(dim=-1)
    return {"staleness_mean": float(s.mean()), "staleness_max": float(s.max()),
            "offpolicy_token_frac": float((s > 0).to(torch.float64).mean()),
            "mixed_version_frac": float(((hi > lo) & has).to(torch.float64).sum() / max(int(has.sum()), 1))}


def staleness_weights(versions: Tensor, mask: Tensor, current: int, max_staleness: int, factor: float) -> Tensor:
    """Loss weight per token: 1 up to ``max_staleness`` versions behind, then ``factor`` per
    version beyond (``factor ** (staleness - max_staleness)``); 0 on padding. Multiplying a
    token's advantage by it scales that token's policy-gradient term by it (the clip decision of
    PPO depends only on the sign of the advantage, which a positive weight keeps)."""
    if not 0.0 < factor <= 1.0:
        raise ValueError(f"factor must be in (0, 1], got {factor}")
    if max_staleness < 0:
        raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
    m = as_bool_mask(mask)
    excess = (token_staleness(versions, current) - max_staleness).clamp(min=0).to(torch.float32)
    w = torch.pow(torch.tensor(float(factor)), excess)
    return torch.where(m, w, torch.zeros_like(w))


def logprob_diff_by_staleness(versions: Tensor, mask: Tensor, current: int, trainer_lp: Tensor,
                              rollout_lp: Tensor) -> dict[str, float]:
    """Mean |trainer - rollout| logprob over the tokens sampled by the trainer's own weights
    (``fresh``: staleness 0) and over the older ones (``stale``). ``fresh`` is the per-step proof
    that a pushed version reached the servers (it sits at the dtype noise floor, like step 0's
    check); ``stale`` is how far the policy moved since (what the importance ratio corrects).
    A key is absent when no token of its kind is in the batch."""
    m = as_bool_mask(mask)
    behind = token_staleness(versions, current)
    diff = (trainer_lp.to(torch.float64) - rollout_lp.to(torch.float64)).abs()
    out: dict[str, float] = {}
    for name, sel in (("fresh_logprob_diff_mean", m & (behind == 0)), ("stale_logprob_diff_mean", m & (behind > 0))):
        if bool(sel.any()):
            out[name] = float(diff[sel].mean())
    return out


def offpolicy_step(versions: Tensor, mask: Tensor, current: int, trainer_lp: Optional[Tensor], rollout_lp: Tensor,
                   max_staleness: int, downweight: Optional[float]) -> tuple[dict[str, float], Optional[Tensor]]:
    """One off-policy batch at trainer version ``current``: staleness metrics, rollout vs trainer
    logprobs of fresh and stale tokens (not when ``trainer_lp`` is None: no trainer pass ran) and,
    with ``downweight`` (the factor of ``rollout.stale_samples: downweight``), per-token weights
    ``[B, T]`` for tokens past ``max_staleness`` (None otherwise)."""
    metrics = {f"offpolicy/{k}": v for k, v in staleness_stats(versions, mask, current).items()}
    if trainer_lp is not None:
        metrics.update({f"offpolicy/{k}": v for k, v in
                        logprob_diff_by_staleness(versions, mask, current, trainer_lp, rollout_lp).items()})
    if downweight is None:
        return metrics, None
    weights = staleness_weights(versions, mask, current, max_staleness, downweight)
    metrics["offpolicy/downweighted_token_frac"] = float(((weights < 1) & mask.bool()).sum() / mask.sum().clamp(min=1))
    return metrics, weights
