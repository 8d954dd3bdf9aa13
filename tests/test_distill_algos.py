"""On-policy distillation math against a hand computation: the per-token reverse-KL advantage, its
mix with a task advantage, the metrics, and that the policy gradient with it is the reverse KL's."""
from __future__ import annotations

import math

import pytest
import torch

from megarl.algos import (PolicyLossConfig, distill_metrics, get_distill_advantage, get_policy_loss,
                          mix_advantages, register_distill_advantage, reverse_kl_advantages)
from megarl.algos.distill import distilled_advantages, subtract_batch_mean

NAN = float("nan")


def test_reverse_kl_advantage_by_hand_only_on_sampled_tokens():
    student = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, NAN, NAN]])
    teacher = torch.tensor([[-0.5, -2.5, -0.5], [-1.0, 7.0, NAN]])
    # row 0, token 1 is an environment token (agent): not sampled, no advantage
    mask = torch.tensor([[1.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    adv = reverse_kl_advantages(student, teacher, mask)
    # -(log pi_s - log pi_t): token (0,0) the teacher likes more (+0.5), (1,0) far more (+2)
    assert adv.tolist() == [[0.5, 0.0, 0.0], [2.0, 0.0, 0.0]]
    assert get_distill_advantage("reverse_kl") is reverse_kl_advantages


def test_mix_weights_each_term_and_drops_a_zero_weight_exactly():
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    task = torch.tensor([[1.0, 1.0, NAN]])
    distill = torch.tensor([[0.5, -0.25, NAN]])
    assert mix_advantages(task, distill, mask, coef=2.0, reward_weight=0.5).tolist() == [[1.5, 0.0, 0.0]]
    assert mix_advantages(task, distill, mask, coef=1.0, reward_weight=0.0).tolist() == [[0.5, -0.25, 0.0]]
    nan_task = torch.full((1, 3), NAN)   # a weight of 0 never lets a nan through (0 * nan)
    assert mix_advantages(nan_task, distill, mask, coef=1.0, reward_weight=0.0).tolist() == [[0.5, -0.25, 0.0]]


def test_batch_mean_baseline_by_hand():
    adv = torch.tensor([[0.5, NAN, -1.0], [2.0, 9.0, NAN]])
    mask = torch.tensor([[1.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    mean = (0.5 - 1.0 + 2.0) / 3
    assert torch.allclose(subtract_batch_mean(adv, mask),
                          torch.tensor([[0.5 - mean, 0.0, -1.0 - mean], [2.0 - mean, 0.0, 0.0]]))


def test_distilled_advantages_compose_signal_baseline_and_mix_by_hand():
    student = torch.tensor([[-1.0, -2.0, NAN]])
    teacher = torch.tensor([[-0.5, -3.0, NAN]])
    task = torch.tensor([[1.0, 1.0, NAN]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    # signal +0.5, -1.0; batch mean -0.25 -> +0.75, -0.75; mixed 0.5 * 1 + 2 * signal
    adv, metrics = distilled_advantages(task, student, teacher, mask, baseline="batch_mean", coef=2.0,
                                        reward_weight=0.5)
    assert adv.tolist() == [[0.5 + 1.5, 0.5 - 1.5, 0.0]]
    assert metrics["distill/reverse_kl"] == pytest.approx((-0.5 + 1.0) / 2)
    plain, _ = distilled_advantages(task, student, teacher, mask, coef=1.0, reward_weight=0.0)
    assert plain.tolist() == [[0.5, -1.0, 0.0]]


def test_metrics_by_hand():
    student = torch.tensor([[-1.0, -2.0], [-0.5, NAN]])
    teacher = torch.tensor([[-1.5, -1.0], [-0.5, NAN]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    m = distill_metrics(student, teacher, mask)
    assert m["distill/reverse_kl"] == pytest.approx((0.5 - 1.0 + 0.0) / 3)
    k3 = [math.expm1(r) - r for r in (-0.5, 1.0, 0.0)]
    assert m["distill/reverse_kl_k3"] == pytest.approx(sum(k3) / 3)
    assert m["distill/teacher_logprob_mean"] == pytest.approx(-3.0 / 3)
    assert m["distill/student_logprob_mean"] == pytest.approx(-3.5 / 3)


def test_policy_gradient_with_the_advantage_is_the_reverse_kl_gradient():
    """One position, a 4-token vocabulary: the exact reverse KL's gradient equals the expectation,
    over every token the student could sample, of the PPO loss's gradient with the token's
    distillation advantage (ratio 1, on-policy)."""
    torch.manual_seed(0)
    logits = torch.randn(4, requires_grad=True)
    teacher = torch.log_softmax(torch.randn(4), -1)
    log_s = torch.log_softmax(logits, -1)
    exact = torch.autograd.grad((log_s.exp() * (log_s - teacher)).sum(), logits)[0]

    loss_fn = get_policy_loss("ppo")
    expected = torch.zeros(4)
    for tok in range(4):
        lp = torch.log_softmax(logits, -1)[tok].reshape(1, 1)
        mask = torch.ones(1, 1)
        adv = reverse_kl_advantages(lp.detach(), teacher[tok].reshape(1, 1), mask)
        loss, _ = loss_fn(lp, lp.detach(), adv, mask, PolicyLossConfig())
        expected += log_s[tok].exp().detach() * torch.autograd.grad(loss, logits)[0]
    assert torch.allclose(expected, exact, atol=1e-6)


def test_registering_a_distillation_advantage_twice_is_refused():
    with pytest.raises(ValueError, match="distillation advantage 'reverse_kl' is already registered"):
        register_distill_advantage("reverse_kl")(lambda s, t, m: s)
