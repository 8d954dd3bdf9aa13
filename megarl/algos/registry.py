"""Name -> function registries, so a run's config can pick an algorithm by a string.

Each kind (advantage estimator, policy loss, KL estimator, rollout-correction ratio level,
distillation advantage) has its own table. Registering an existing
name raises: a silent overwrite would make a typo in a plugin change every run that uses the name.
"""
from __future__ import annotations

from typing import Callable, Dict, TypeVar

F = TypeVar("F", bound=Callable)


class Registry:
    """A small name -> callable table with aliases and a helpful error on unknown names."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._table: Dict[str, Callable] = {}

    def register(self, name: str, *aliases: str) -> Callable[[F], F]:
        """Decorator: register ``fn`` under ``name`` and every alias."""

        def deco(fn: F) -> F:
            for n in (name, *aliases):
                if n in self._table and self._table[n] is not fn:
                    raise ValueError(f"{self.kind} {n!r} is already registered")
                self._table[n] = fn
            return fn

        return deco

    def get(self, name: str) -> Callable:
        try:
            return self._table[name]
        except KeyError:
            raise KeyError(f"unknown {self.kind} {name!r}; known: {sorted(self._table)}") from None

    def names(self) -> list[str]:
        return sorted(self._table)

    def __contains__(self, name: object) -> bool:
        return name in self._table


ADVANTAGE_ESTIMATORS = Registry("advantage estimator")
POLICY_LOSSES = Registry("policy loss")
KL_ESTIMATORS = Registry("KL estimator")
ROLLOUT_RATIO_LEVELS = Registry("rollout correction level")
DISTILL_ADVANTAGES = Registry("distillation advantage")


def register_advantage_estimator(name: str, *aliases: str) -> Callable[[F], F]:
    """Register an advantage estimator; see ``megarl.algos`` for the signature it must have."""
    return ADVANTAGE_ESTIMATORS.register(name, *aliases)


def register_policy_loss(name: str, *aliases: str) -> Callable[[F], F]:
    """Register a policy loss ``fn(logprobs, old_logprobs, advantages, mask, cfg, **kw)``."""
    return POLICY_LOSSES.register(name, *aliases)


def register_kl_estimator(name: str, *aliases: str) -> Callable[[F], F]:
    """Register a per-token KL estimator ``fn(logprobs, ref_logprobs) -> Tensor``."""
    return KL_ESTIMATORS.register(name, *aliases)


def register_rollout_ratio_level(name: str, *aliases: str) -> Callable[[F], F]:
    """Register a rollout-correction level ``fn(log_rho, mask) -> Tensor``: from the per-token
    ``log(pi_old / pi_rollout)`` ``[B, T]``, the log ratio each token is weighted by."""
    return ROLLOUT_RATIO_LEVELS.register(name, *aliases)


def register_distill_advantage(name: str, *aliases: str) -> Callable[[F], F]:
    """Register a distillation advantage ``fn(student_logprobs, teacher_logprobs, mask) -> Tensor``:
    from the log-probabilities both models give the student's sampled tokens (``[B, T]``), each
    token's advantage (0 on padding)."""
    return DISTILL_ADVANTAGES.register(name, *aliases)


def get_distill_advantage(name: str) -> Callable:
    """The distillation advantage registered as ``name`` (``KeyError`` lists the known names)."""
    return DISTILL_ADVANTAGES.get(name)


def get_advantage_estimator(name: str) -> Callable:
    """The advantage estimator registered as ``name`` (``KeyError`` lists the known names)."""
    return ADVANTAGE_ESTIMATORS.get(name)


def get_policy_loss(name: str) -> Callable:
    """The policy loss registered as ``name`` (``KeyError`` lists the known names)."""
    return POLICY_LOSSES.get(name)


def get_kl_estimator(name: str) -> Callable:
    """The per-token KL estimator registered as ``name`` (``KeyError`` lists the known names)."""
    return KL_ESTIMATORS.get(name)
