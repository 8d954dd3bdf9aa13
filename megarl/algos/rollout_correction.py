"""Rollout/training mismatch correction: importance weights from the rollout engine's policy to the
trainer's, truncated or masked, per token, per sequence or per sequence's geometric mean.

Why: the tokens were sampled by the inference engine's ``pi_rollout`` (other kernels, FP8 weights,
older weights in async runs), while the PPO ratio and clip are taken against the trainer's own
``pi_old``. The per-token ratio ``rho_t = pi_old(y_t) / pi_rollout(y_t)`` corrects the sampling
distribution (decoupled PPO); its variance is what each setting bounds differently.

Levels (the ratio every token of a sequence is weighted by; ``registry.ROLLOUT_RATIO_LEVELS``):

``token``      ``rho_t`` itself.
``sequence``   ``prod_t rho_t`` over the sequence's response tokens (unbiased, high variance).
``geometric``  ``(prod_t rho_t)^(1/|y|) = exp(mean_t log rho_t)`` (length-normalised, GSPO-like).

Modes, with bounds ``lower`` / ``upper`` (``None`` = that side unbounded):

``truncate``   ``w = clamp(ratio, lower, upper)``. Token-level with ``upper = C`` and no lower bound
    is TIS (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL
    Training"; verl's ``rollout_is``); slime also clamps from below.
``mask``       ``w = ratio * 1[lower <= ratio <= upper]``: masked importance sampling (MIS, Liu, Li
    et al. 2025, "When Speed Kills Stability") with ``lower`` unset; IcePop (Ling team 2025, Ring-1T)
    is token level with both bounds (their ``[0.5, 5]``). A masked token keeps its place in the loss
    denominator (IcePop's ``1/|y|``), so it adds exactly zero, gradient included. ``reweight=False``
    keeps ``1`` instead of the ratio inside the band: pure rejection (verl's ``rollout_rs``).

Ratios are formed in log space and clamped to ``[-log_ratio_clamp, log_ratio_clamp]`` before
``exp``; bound decisions are taken on the unclamped log ratio. Weights are detached.

Metrics (0-dim tensors, no host sync): ``metrics.logprob_mismatch`` measures the mismatch whether
or not a correction is on (KL(rollout || train) in k1 and k3, chi-square, the token ratio's
extremes); :func:`correction_weights` adds the applied weights' mean and max, their effective
sample size ``1 / E[(w / E w)^2]`` (a fraction of the tokens; 1 = every token weighs the same), the
fraction of tokens truncated or masked, and the level ratio's extremes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch
from torch import Tensor

from .masked import masked_mean, masked_means, masked_sum, sanitize
from .metrics import logprob_mismatch, masked_max, masked_min
from .registry import ROLLOUT_RATIO_LEVELS, register_rollout_ratio_level

MODES = ("truncate", "mask")
# the metric of the share of tokens whose weight a bound changed, per mode
_BOUNDED_FRAC = {"truncate": "rollout_is_truncated_frac", "mask": "rollout_is_masked_frac"}


@register_rollout_ratio_level("token")
def token_log_ratio(log_rho: Tensor, mask: Tensor) -> Tensor:
    """``log rho_t`` per token."""
    return log_rho


@register_rollout_ratio_level("sequence")
def sequence_log_ratio(log_rho: Tensor, mask: Tensor) -> Tensor:
    """``sum_t log rho_t`` of each sequence, on every token of it."""
    return masked_sum(log_rho, mask, dim=-1).unsqueeze(-1).expand_as(log_rho)


@register_rollout_ratio_level("geometric")
def geometric_log_ratio(log_rho: Tensor, mask: Tensor) -> Tensor:
    """``mean_t log rho_t`` of each sequence (log of the geometric mean), on every token of it."""
    return masked_mean(log_rho, mask, dim=-1).unsqueeze(-1).expand_as(log_rho)


@dataclass(frozen=True)
class RolloutCorrection:
    """One correction setting (see the module docstring). ``RolloutCorrection.from_tis_cap(C)`` is
    the earlier ``algorithm.tis_cap: C`` (token level, truncate, ``upper = C``)."""

    level: str = "token"
    mode: str = "truncate"
    lower: Optional[float] = None
    upper: Optional[float] = 2.0
    reweight: bool = True
    log_ratio_clamp: float = 20.0

    def __post_init__(self) -> None:
        if self.level not in ROLLOUT_RATIO_LEVELS:
            raise ValueError(f"unknown rollout correction level {self.level!r}; known: {ROLLOUT_RATIO_LEVELS.names()}")
        if self.mode not in MODES:
            raise ValueError(f"unknown rollout correction mode {self.mode!r}; known: {MODES}")
        if self.lower is None and self.upper is None:
            raise ValueError("a rollout correction needs a lower or an upper bound")
        if self.upper is not None and self.upper <= 0:
            raise ValueError(f"upper must be > 0, got {self.upper}")
        if self.lower is not None and self.lower < 0:
            raise ValueError(f"lower must be >= 0, got {self.lower}")
        if self.lower is not None and self.upper is not None and self.lower >= self.upper:
            raise ValueError(f"lower {self.lower} must be < upper {self.upper}")
        if not self.reweight and self.mode != "mask":
            raise ValueError("reweight=False (weight 1 inside the bounds) needs mode 'mask'")

    @classmethod
    def from_tis_cap(cls, cap: float) -> "RolloutCorrection":
        """Truncated importance sampling at ``cap``: ``min(rho_t, cap)``."""
        return cls(level="token", mode="truncate", lower=None, upper=cap)

    def log_bounds(self) -> Tuple[float, float]:
        """``(log lower, log upper)``, infinite where unbounded."""
        lo = -math.inf if not self.lower else math.log(self.lower)   # lower 0 bounds nothing
        hi = math.inf if self.upper is None else math.log(self.upper)
        return lo, hi


@torch.no_grad()
def correction_weights(log_rho: Tensor, mask: Tensor, corr: RolloutCorrection) -> Tuple[Tensor, Dict[str, Tensor]]:
    """From ``log rho_t = log pi_old - log pi_rollout`` (0 on padding): the per-token weights
    ``[B, T]`` of ``corr`` (0 on padding) and their metrics: ``rollout_is_weight_mean`` / ``_max``, ``rollout_is_ess``, ``rollout_is_truncated_frac`` or
    ``rollout_is_masked_frac`` (share of tokens whose weight a bound changed), and
    ``rollout_is_ratio_min`` / ``_max`` (the level's ratio before the bounds)."""
    level_log = ROLLOUT_RATIO_LEVELS.get(corr.level)(log_rho, mask)
    ratio = torch.exp(level_log.clamp(-corr.log_ratio_clamp, corr.log_ratio_clamp))
    lo, hi = corr.log_bounds()
    below, above = level_log < lo, level_log > hi
    outside = below | above
    if corr.mode == "truncate":
        w = ratio
        if corr.upper is not None:
            w = torch.where(above, torch.full_like(w, corr.upper), w)
        if corr.lower:
            w = torch.where(below, torch.full_like(w, corr.lower), w)
    else:
        inside = ratio if corr.reweight else torch.ones_like(ratio)
        w = torch.where(outside, torch.zeros_like(ratio), inside)
    w = sanitize(w, mask)
    weight_mean = masked_mean(w, mask)
    normalised = w / weight_mean.clamp(min=1e-12)
    out = masked_means({"rollout_is_weight_mean": w, _BOUNDED_FRAC[corr.mode]: outside,
                        "ess_denominator": normalised * normalised}, mask)
    out["rollout_is_ess"] = 1.0 / out.pop("ess_denominator").clamp(min=1e-12)
    out["rollout_is_weight_max"] = masked_max(w, mask)
    out["rollout_is_ratio_min"] = masked_min(ratio, mask)
    out["rollout_is_ratio_max"] = masked_max(ratio, mask)
    return w, out


def apply_rollout_correction(loss_mat: Tensor, old: Tensor, mask: Tensor, rollout_logprobs: Optional[Tensor],
                             corr: Optional[RolloutCorrection], metrics: Dict[str, Tensor]) -> Tensor:
    """``loss_mat`` weighted by ``corr``'s per-token weights (unchanged when ``corr`` is None), the
    mismatch metrics added to ``metrics`` whenever the rollout's logprobs are given."""
    if rollout_logprobs is None:
        if corr is not None:
            raise ValueError("a rollout correction is set but rollout_logprobs were not given")
        return loss_mat
    if rollout_logprobs.shape != loss_mat.shape:
        raise ValueError("rollout_logprobs must have the shape of logprobs")
    roll = rollout_logprobs.detach().to(old.dtype)
    metrics.update(logprob_mismatch(old, roll, mask))
    if corr is None:
        return loss_mat
    w, corr_metrics = correction_weights(sanitize(old.detach() - roll, mask), mask, corr)
    metrics.update(corr_metrics)
    return loss_mat * w.to(loss_mat.dtype)


__all__ = ["MODES", "RolloutCorrection", "apply_rollout_correction", "correction_weights", "geometric_log_ratio",
           "sequence_log_ratio", "token_log_ratio"]
