"""On-policy distillation: a teacher's log-probabilities of the student's own tokens as the signal.

The student samples a response; a teacher scores exactly those tokens. For a sampled token ``x_t``
the single-sample estimate of the reverse KL ``KL(pi_student || pi_teacher)`` at that position is
``log pi_student(x_t) - log pi_teacher(x_t)``, and its negative is the token's advantage (GKD,
Agarwal et al. 2024, with on-policy samples; Thinking Machines, "On-Policy Distillation", 2025).
With that advantage the policy gradient ``-A_t grad log pi_student(x_t)`` is, in expectation over
the student's samples, the gradient of the per-token reverse KL (the ``E[grad log pi]`` term is
zero), so the student moves toward what the teacher would have said at every position it visits,
a dense signal where a task reward gives one number per response. Reverse KL is mode seeking: the
student is pushed off tokens the teacher finds unlikely, not toward covering all of the teacher.

Why the student's log-probabilities are the *old* ones: they are the trainer's log-probabilities of
the sampled tokens before the update (or the servers', ``algorithm.old_logprobs: rollout``), the
same numbers the PPO ratio divides by; the advantage is then a constant of the step, as a reward
is. Beside a task reward the two advantages add: ``reward_weight * A_task + coef * A_distill``;
``reward_weight = 0`` is distillation alone.

Variance: the per-token signal has a large mean wherever the student is far from the teacher (every
sampled token looks worse to the teacher than to the student), and ``mean * grad log pi`` is zero in
expectation but not in a batch of a few hundred tokens, where it mostly pushes down whatever was
sampled. :func:`subtract_batch_mean` removes it (a constant baseline: the expected gradient is
unchanged, up to the ``1/N`` share of a token's own value in the mean). Large batches can do
without; small ones (CPU tests, short steps) learn much faster with it.

Pure torch over padded ``[B, T]`` tensors with a mask of the tokens the model sampled (an agent's
environment tokens are 0 there): padded positions may hold garbage and never reach a result.
"""
from __future__ import annotations

from typing import Dict

import torch
from torch import Tensor

from .masked import as_bool_mask, masked_mean, sanitize
from .registry import get_distill_advantage, register_distill_advantage


@register_distill_advantage("reverse_kl")
@torch.no_grad()
def reverse_kl_advantages(student_logprobs: Tensor, teacher_logprobs: Tensor, mask: Tensor) -> Tensor:
    """``[B, T]`` advantage ``-(log pi_student - log pi_teacher)`` of every sampled token, 0 elsewhere.

    Positive where the teacher likes the token more than the student does (reinforced), negative
    where less (suppressed). No discount and no baseline: each token is credited with its own
    position's divergence only."""
    m = as_bool_mask(mask)
    return sanitize(teacher_logprobs.detach().float() - student_logprobs.detach().float(), m)


@torch.no_grad()
def subtract_batch_mean(advantages: Tensor, mask: Tensor) -> Tensor:
    """``advantages`` minus their mean over every sampled token of the batch (0 on the rest)."""
    m = as_bool_mask(mask)
    a = sanitize(advantages.detach().float(), m)
    return sanitize(a - masked_mean(a, m), m)


@torch.no_grad()
def mix_advantages(task: Tensor, distill: Tensor, mask: Tensor, *, coef: float, reward_weight: float) -> Tensor:
    """``reward_weight * task + coef * distill`` on the sampled tokens, 0 on the rest. A weight of 0
    drops its term exactly (a ``nan`` on a padded position of it never leaks through ``0 * nan``)."""
    m = as_bool_mask(mask)
    out = torch.zeros(m.shape, dtype=torch.float32, device=m.device)
    if reward_weight:
        out = out + reward_weight * sanitize(task.detach().float(), m)
    if coef:
        out = out + coef * sanitize(distill.detach().float(), m)
    return sanitize(out, m)


@torch.no_grad()
def distill_metrics(student_logprobs: Tensor, teacher_logprobs: Tensor, mask: Tensor) -> Dict[str, float]:
    """What the run logs every step, means over the sampled tokens of the batch:

    * ``distill/reverse_kl``: ``log pi_student - log pi_teacher`` (k1, unbiased for the reverse KL
      on the student's samples; one token's value may be negative, the expectation is not);
    * ``distill/reverse_kl_k3``: ``exp(r) - 1 - r`` with ``r = log pi_teacher - log pi_student``
      (Schulman 2020: unbiased too, never negative, lower variance);
    * ``distill/teacher_logprob_mean`` and ``distill/student_logprob_mean``.
    """
    m = as_bool_mask(mask)
    s = sanitize(student_logprobs.detach().double(), m)
    t = sanitize(teacher_logprobs.detach().double(), m)
    r = t - s
    return {"distill/reverse_kl": float(masked_mean(s - t, m)),
            "distill/reverse_kl_k3": float(masked_mean(torch.expm1(r) - r, m)),
            "distill/teacher_logprob_mean": float(masked_mean(t, m)),
            "distill/student_logprob_mean": float(masked_mean(s, m))}


@torch.no_grad()
def distilled_advantages(task: Tensor, student_logprobs: Tensor, teacher_logprobs: Tensor, mask: Tensor, *,
                         advantage: str = "reverse_kl", baseline: str = "none", coef: float = 1.0,
                         reward_weight: float = 1.0) -> tuple[Tensor, Dict[str, float]]:
    """A step's advantages with the teacher's signal mixed in, and the distillation metrics.

    The whole composition of ``algorithm.distill`` in one pure function: the registered signal
    ``advantage`` of the student's and the teacher's log-probabilities of the sampled tokens,
    minus its batch mean when ``baseline == "batch_mean"``, then ``reward_weight * task + coef *
    signal``. The student's log-probabilities are the step's old ones (what the PPO ratio divides by)."""
    signal = get_distill_advantage(advantage)(student_logprobs, teacher_logprobs, mask)
    if baseline == "batch_mean":
        signal = subtract_batch_mean(signal, mask)
    mixed = mix_advantages(task, signal, mask, coef=coef, reward_weight=reward_weight)
    return mixed, distill_metrics(student_logprobs, teacher_logprobs, mask)
