"""Per-token KL estimators between the policy and a reference policy, and KL coefficient control.

Estimators follow J. Schulman, "Approximating KL Divergence" (blog, 2020). With tokens sampled from
the policy ``pi`` and ``log r = log pi_ref(x) - log pi(x)`` they estimate the *reverse* KL
``KL(pi || pi_ref)``:

* ``k1 = -log r = logp - ref_logp`` - unbiased, high variance, can be negative per token.
* ``k2 = (log r)^2 / 2`` - biased but low variance; always ``>= 0``.
* ``k3 = (r - 1) - log r`` - unbiased *and* low variance, always ``>= 0`` (since ``log x <= x-1``).
  Called ``low_var_kl`` in verl and used as GRPO's KL loss (Shao et al. 2024, DeepSeekMath).

As a *loss* (differentiated w.r.t. the policy) they are not interchangeable: the expected gradient
of ``k1`` is zero, ``k2``'s gradient is the exact gradient of the reverse KL, and ``k3``'s is a
biased one. As a *reward penalty* (no gradient) they are just estimates of the KL value. See
:func:`kl_penalty` (per-token values) and :func:`kl_loss` (aggregated loss term).

Numerical guards (as in verl): the log-ratio is clamped to ``[-20, 20]`` before ``exp`` and, by
default (``clamp="auto"``), ``k3`` values are clamped to ``[-10, 10]`` (one outlier token otherwise
dominates the loss); other estimators are not clamped. Pass ``clamp=None`` for raw values or a
number to clamp any estimator.
"""
from __future__ import annotations

import math
from typing import Optional, Union

import torch
from torch import Tensor

from .aggregation import aggregate_loss
from .masked import sanitize
from .registry import get_kl_estimator, register_kl_estimator

_LOG_RATIO_CLAMP = 20.0
_K3_CLAMP = 10.0
Clamp = Union[None, float, str]


@register_kl_estimator("k1", "kl")
def kl_k1(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k1 = ``logp - ref_logp`` (Schulman 2020): unbiased estimate of KL(pi||ref), high variance."""
    return logprobs - ref_logprobs


@register_kl_estimator("k2", "mse")
def kl_k2(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k2 = ``0.5 (logp - ref_logp)^2`` (Schulman 2020): low variance, biased, non-negative."""
    d = logprobs - ref_logprobs
    return 0.5 * d * d


@register_kl_estimator("k3", "low_var_kl")
def kl_k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k3 = ``exp(ref - logp) - (ref - logp) - 1`` (Schulman 2020): unbiased, low variance, ``>=0``.

    The GRPO KL term (Shao et al. 2024, DeepSeekMath, eq. 4). The log-ratio is clamped to
    ``[-20, 20]`` so ``exp`` cannot overflow.
    """
    log_r = (ref_logprobs - logprobs).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    return torch.exp(log_r) - log_r - 1.0


@register_kl_estimator("abs")
def kl_abs(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """``|logp - ref_logp|``: the absolute log-ratio (used as a penalty by some PPO setups)."""
    return (logprobs - ref_logprobs).abs()


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, estimator: str = "k3",
               mask: Optional[Tensor] = None, clamp: Clamp = "auto") -> Tensor:
    """Per-token KL estimate ``[batch, T]`` between policy and reference (Schulman 2020).

    Args:
        logprobs: log pi(token) under the current policy.
        ref_logprobs: log pi_ref(token) under the frozen reference.
        estimator: a registered name (``k1``, ``k2``, ``k3``/``low_var_kl``, ``abs``).
        mask: if given, padded positions come back exactly 0 (and get zero gradient).
        clamp: ``"auto"`` (clamp k3/low_var_kl to ``[-10, 10]`` as verl does, others raw), ``None``
            (raw), or a number ``c`` (clamp to ``[-c, c]``).
    """
    if mask is not None:
        logprobs = sanitize(logprobs, mask)
        ref_logprobs = sanitize(ref_logprobs, mask)
    kl = get_kl_estimator(estimator)(logprobs, ref_logprobs)
    if clamp == "auto":
        clamp = _K3_CLAMP if get_kl_estimator(estimator) is kl_k3 else None
    if clamp is not None:
        kl = kl.clamp(-float(clamp), float(clamp))
    if mask is not None:
        kl = sanitize(kl, mask)
    return kl


def kl_reward_penalty(logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor, kl_coef: float,
                      estimator: str = "k1", clamp: Clamp = "auto") -> Tensor:
    """The KL-in-reward term ``kl_coef * KL_t`` (detached, ``[batch, T]``) for advantage estimators.

    The reward seen by token ``t`` becomes ``r_t - kl_coef * KL_t`` (Ziegler et al. 2019, "Fine-Tuning
    Language Models from Human Preferences"; Ouyang et al. 2022; REINFORCE++, Hu 2025). Pass the
    result as ``kl=`` to an advantage estimator, which subtracts it. ``k1`` is the classic choice.
    """
    with torch.no_grad():
        return kl_coef * kl_penalty(logprobs.detach(), ref_logprobs.detach(), estimator, mask, clamp)


def kl_loss(logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor, estimator: str = "k3",
            agg_mode: str = "token-mean", clamp: Clamp = "auto", **agg_kwargs) -> Tensor:
    """KL as a loss term (scalar), to be added as ``kl_coef * kl_loss`` (GRPO, Shao et al. 2024).

    Gradient flows into ``logprobs`` only; ``ref_logprobs`` is detached.
    ``agg_kwargs`` go to :func:`~megarl.algos.aggregation.aggregate_loss`.
    """
    kl = kl_penalty(logprobs, ref_logprobs.detach(), estimator, mask, clamp)
    return aggregate_loss(kl, mask, agg_mode, **agg_kwargs)


class FixedKLController:
    """A constant KL coefficient (``update`` is a no-op); same interface as the adaptive one."""

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> float:
        return self.value


class AdaptiveKLController:
    """Adaptive KL coefficient of Ziegler et al. 2019 ("Fine-Tuning Language Models from Human
    Preferences", sec. 2.2): a proportional controller steering the observed KL to ``target``.

    ``e = clip(KL / target - 1, -0.2, 0.2)``; ``beta <- beta * (1 + e * n_steps / horizon)``,
    where ``n_steps`` is the number of samples (or steps) seen since the last update.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: float) -> None:
        if target_kl <= 0 or horizon <= 0:
            raise ValueError("target_kl and horizon must be > 0")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> float:
        err = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + err * n_steps / self.horizon
        if not math.isfinite(self.value):
            raise FloatingPointError(f"KL coefficient became {self.value}")
        return self.value


def make_kl_controller(kind: str = "fixed", kl_coef: float = 0.001, target_kl: float = 0.1,
                       horizon: float = 10000.0):
    """Build a controller by name: ``fixed`` or ``adaptive``."""
    if kind == "fixed":
        return FixedKLController(kl_coef)
    if kind == "adaptive":
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ValueError(f"unknown KL controller {kind!r}; known: ['adaptive', 'fixed']")
