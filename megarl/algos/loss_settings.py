"""The loss settings of one training pass, typed: what the driver hands every training rank.

Why a frozen dataclass and not the config: a rank needs a handful of numbers, one of which (the
KL-loss coefficient of an adaptive controller) changes every step, and the same object must pickle
through Ray unchanged. ``from_algorithm`` reads them from ``cfg.algorithm`` (duck-typed: ``algos``
imports nothing of megarl's config).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from .policy_loss import PolicyLossConfig
from .rollout_correction import RolloutCorrection


@dataclass(frozen=True)
class LossSettings:
    """Actor: ``policy_loss`` (registered name) with ``policy``, minus ``entropy_coef`` x entropy,
    plus ``kl_loss_coef`` x KL(``kl_estimator``) to the reference. Critic: clipped value loss with
    ``value_clip``. Both aggregate with ``agg_mode``."""

    policy_loss: str = "ppo"
    policy: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    entropy_coef: float = 0.0
    kl_loss_coef: float = 0.0
    kl_estimator: str = "k3"
    value_clip: float = 0.2

    @property
    def agg_mode(self) -> str:
        return self.policy.agg_mode

    @classmethod
    def from_algorithm(cls, algorithm: Any, max_new_tokens: int, kl_loss_coef: float = 0.0) -> "LossSettings":
        """From ``cfg.algorithm`` (its rollout correction: :func:`rollout_correction_of`);
        ``max_new_tokens`` is the constant of ``seq-mean-token-sum-norm`` and ``kl_loss_coef`` the
        controller's current value (0 unless ``kl.mode`` is ``loss``)."""
        a = algorithm
        policy = PolicyLossConfig(clip_low=a.clip_low, clip_high=a.clip_high, dual_clip_c=a.dual_clip_c,
                                  agg_mode=a.loss_agg, rollout_correction=rollout_correction_of(a),
                                  norm_len=float(max_new_tokens))
        return cls(policy_loss=a.policy_loss, policy=policy, entropy_coef=a.entropy_coef,
                   kl_loss_coef=kl_loss_coef if a.kl.mode == "loss" else 0.0, kl_estimator=a.kl.estimator,
                   value_clip=a.value_clip)


def rollout_correction_of(algorithm: Any) -> Optional[RolloutCorrection]:
    """The correction ``cfg.algorithm`` asks for: the legacy ``tis_cap`` when set (``C > 0``: token
    truncation at ``C``; 0: none), else ``rollout_correction`` when enabled. ``enabled: null`` (not
    yet resolved against the served checkpoint and rollout mode) applies none."""
    if algorithm.tis_cap is not None:
        return RolloutCorrection.from_tis_cap(algorithm.tis_cap) if algorithm.tis_cap > 0 else None
    rc = algorithm.rollout_correction
    if not rc.enabled:
        return None
    return RolloutCorrection(level=rc.level, mode=rc.mode, lower=rc.lower, upper=rc.upper, reweight=rc.reweight)
