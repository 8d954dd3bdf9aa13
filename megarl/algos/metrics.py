"""Metric helpers: detached, masked statistics that every step logs (ARCHITECTURE.md "The loop").

All return 0-dim float tensors (call ``.item()`` when logging) and ignore padded positions. A
statistic over an empty selection is 0 rather than ``nan``/``inf``, so logs stay finite.
"""
from __future__ import annotations

from typing import Dict, Optional

import torch
from torch import Tensor

from .masked import as_bool_mask, masked_mean, masked_means, masked_var, sanitize


def masked_max(x: Tensor, mask: Tensor) -> Tensor:
    return _masked_extreme(x, mask, largest=True)


def masked_min(x: Tensor, mask: Tensor) -> Tensor:
    return _masked_extreme(x, mask, largest=False)


def _masked_extreme(x: Tensor, mask: Tensor, largest: bool) -> Tensor:
    """Max (min) of ``x`` where ``mask``, 0 when nothing is selected -- without reading the mask on
    the host: these run in every micro-batch's loss, where a host sync stalls the GPU queue."""
    m = as_bool_mask(mask)
    x = x.detach()
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return zero
    if x.is_floating_point():
        bound = float("-inf") if largest else float("inf")
    else:
        bound = torch.iinfo(x.dtype).min if largest else torch.iinfo(x.dtype).max
    fill = torch.full((), bound, dtype=x.dtype, device=x.device)
    kept = torch.where(m, x, fill)
    return torch.where(m.any(), kept.amax() if largest else kept.amin(), zero)


def _stats(x: Tensor, mask: Tensor, prefix: str) -> Dict[str, Tensor]:
    x = x.detach()
    return {
        f"{prefix}_mean": masked_mean(x, mask),
        f"{prefix}_std": masked_var(x, mask).sqrt(),
        f"{prefix}_max": masked_max(x, mask),
        f"{prefix}_min": masked_min(x, mask),
    }


@torch.no_grad()
def clip_fraction(ratio: Tensor, advantages: Tensor, mask: Tensor, clip_low: float,
                  clip_high: float) -> Tensor:
    """Fraction of valid tokens whose PPO objective is clipped (Schulman et al. 2017): the clipped
    term is the active one, i.e. ``A > 0, ratio > 1 + clip_high`` or ``A < 0, ratio < 1 - clip_low``.
    """
    hit = ((advantages > 0) & (ratio > 1 + clip_high)) | ((advantages < 0) & (ratio < 1 - clip_low))
    return masked_mean(hit.to(ratio.dtype), mask)


@torch.no_grad()
def approx_kl(logprobs: Tensor, old_logprobs: Tensor, mask: Tensor, estimator: str = "k1") -> Tensor:
    """Mean per-token KL(old || new) estimate between the behaviour and the current policy,
    samples drawn from ``old`` (Schulman 2020 "Approximating KL Divergence"): ``k1`` is
    ``mean(old - new)`` (what verl logs as ``ppo_kl``), ``k3`` the non-negative low-variance one.
    """
    from .kl import get_kl_estimator

    kl = get_kl_estimator(estimator)(sanitize(old_logprobs.detach(), mask),
                                     sanitize(logprobs.detach(), mask))
    return masked_mean(kl, mask)


@torch.no_grad()
def entropy_mean(entropy: Tensor, mask: Tensor) -> Tensor:
    """Token-mean entropy of the policy over valid tokens (Cui et al. 2025 track it as the
    signal of entropy collapse)."""
    return masked_mean(entropy.detach(), mask)


def ratio_stats(ratio: Tensor, mask: Tensor) -> Dict[str, Tensor]:
    """``ratio_mean/std/max/min`` of the importance ratio pi/pi_old over valid tokens."""
    return _stats(ratio, mask, "ratio")


def advantage_stats(advantages: Tensor, mask: Tensor) -> Dict[str, Tensor]:
    """``adv_mean/std/max/min`` over valid tokens."""
    return _stats(advantages, mask, "adv")


def returns_stats(returns: Tensor, mask: Tensor) -> Dict[str, Tensor]:
    """``returns_mean/std/max/min`` over valid tokens."""
    return _stats(returns, mask, "returns")


def reward_stats(rewards: Tensor) -> Dict[str, Tensor]:
    """``reward_mean/std/max/min`` of ``[batch]`` sequence rewards."""
    r = rewards.detach()
    r = r if r.is_floating_point() else r.to(torch.get_default_dtype())
    return _stats(r, torch.ones_like(r, dtype=torch.bool), "reward")


def response_length_stats(mask: Tensor, max_len: Optional[int] = None) -> Dict[str, Tensor]:
    """``response_length_mean/max/min`` and, with ``max_len``, ``response_clip_ratio`` (the share
    of responses that hit the length limit)."""
    lengths = as_bool_mask(mask).sum(-1).to(torch.get_default_dtype())
    out = {
        "response_length_mean": lengths.mean(),
        "response_length_max": lengths.max(),
        "response_length_min": lengths.min(),
    }
    if max_len is not None:
        out["response_clip_ratio"] = (lengths >= max_len).to(lengths.dtype).mean()
    return out


@torch.no_grad()
def logprob_mismatch(train_logprobs: Tensor, rollout_logprobs: Tensor,
                     mask: Tensor, clamp: float = 20.0) -> Dict[str, Tensor]:
    """Rollout-vs-train mismatch on the sampled tokens (Yao et al. 2025, "Your Efficient RL Framework
    Secretly Brings You Off-Policy RL Training"), with ``rho = pi_train / pi_rollout`` per token:
    ``|log rho|`` mean and max; KL(rollout || train) as k1 ``E[-log rho]`` and k3
    ``E[rho - 1 - log rho]`` (Schulman 2020: the samples are the rollout's); chi-square
    ``E[rho^2] - 1`` (the variance of the token importance weights); ``rho``'s min and max. Large
    values mean the inference engine samples from a visibly different distribution than the
    trainer scores (``clamp`` bounds ``log rho`` before ``exp``).
    """
    log_rho = sanitize(train_logprobs.detach() - rollout_logprobs.detach(), mask)
    log_r = log_rho.clamp(-clamp, clamp)
    rho = torch.exp(log_r)
    out = masked_means({"rollout_logprob_diff_mean": log_rho.abs(), "rollout_kl_k1": -log_rho,
                        "rollout_kl_k3": rho - log_r - 1, "rollout_chi2": rho * rho - 1}, mask)
    out["rollout_logprob_diff_max"] = masked_max(log_rho.abs(), mask)
    out["rollout_ratio_min"] = masked_min(rho, mask)
    out["rollout_ratio_max"] = masked_max(rho, mask)
    return out


def batch_summary(rewards: Tensor, response_lengths: Tensor, clipped: Tensor, advantages: Tensor,
                  mask: Tensor, valid: Optional[Tensor] = None) -> Dict[str, float]:
    """The batch line of every step: rewards (of the ``valid`` samples only: a failed sample has
    no reward, and its nan must not read as one), response lengths and the share cut at the length
    limit (``clipped``: bool per sample), the mean advantage over trained tokens, sizes."""
    lengths = response_lengths.float()
    scored = rewards if valid is None else rewards[valid.to(torch.bool)]
    if scored.numel() == 0:   # every sample failed: no reward statistics (nan, not a fake 0)
        scored = torch.full((1,), float("nan"))
    return {"reward/mean": float(scored.mean()), "reward/std": float(scored.std()) if len(scored) > 1 else 0.0,
            "reward/max": float(scored.max()), "reward/min": float(scored.min()),
            "response/length_mean": float(lengths.mean()), "response/length_max": float(lengths.max()),
            "response/clipped_frac": float(clipped.float().mean()),
            "advantage/mean": float((advantages * mask).sum() / mask.sum().clamp(min=1)),
            "batch/samples": len(rewards), "batch/response_tokens": float(mask.sum())}
