"""KL estimators and controllers, entropy, filters/shaping, metrics, registry, import hygiene."""
import ast
import math
import pathlib

import pytest
import torch

import megarl.algos as A
from megarl.algos import (
    AdaptiveKLController,
    FixedKLController,
    entropy_from_logits,
    filter_groups,
    group_has_signal,
    get_kl_estimator,
    kl_loss,
    kl_penalty,
    kl_reward_penalty,
    length_penalty,
    logprobs_from_logits,
    overlong_penalty,
)
from megarl.algos import metrics as M

from tests.helpers.tensors import D, NAN, t, close, LN


# -------------------------------------------------------------------------------------- KL
def test_kl_estimators_hand_values():
    # token 0: pi = 0.5, ref = 0.25 -> log r = ln(ref/pi) = -ln 2
    #   k1 = ln 2 = 0.693147, k2 = (ln 2)^2 / 2 = 0.240227, k3 = 0.5 + ln 2 - 1 = 0.193147
    # token 1: pi = 0.25, ref = 0.5 -> log r = ln 2
    #   k1 = -0.693147, k2 = 0.240227, k3 = 2 - ln 2 - 1 = 0.306853
    lp = t([[LN(0.5), LN(0.25)]])
    ref = t([[LN(0.25), LN(0.5)]])
    close(kl_penalty(lp, ref, "k1"), [[0.693147, -0.693147]])
    close(kl_penalty(lp, ref, "k2"), [[0.240227, 0.240227]])
    close(kl_penalty(lp, ref, "k3"), [[0.193147, 0.306853]])
    close(kl_penalty(lp, ref, "low_var_kl"), [[0.193147, 0.306853]])
    close(kl_penalty(lp, ref, "abs"), [[0.693147, 0.693147]])


def test_k1_and_k3_are_unbiased_for_a_categorical():
    # p = [.5, .25, .25], q = [.25, .5, .25]: KL(p||q) = .5 ln 2 + .25 ln .5 = 0.25 ln 2 = 0.173287
    p = t([0.5, 0.25, 0.25])
    lp, lq = p.log().unsqueeze(0), t([0.25, 0.5, 0.25]).log().unsqueeze(0)
    for name in ("k1", "k3"):
        close((p * kl_penalty(lp, lq, name)[0]).sum(), 0.173287)


def test_k2_gradient_is_exact_kl_gradient_and_k1_gradient_vanishes():
    theta = t([0.3, -0.2, 0.5]).requires_grad_()
    lq = t([0.25, 0.5, 0.25]).log()
    lp = torch.log_softmax(theta, -1)
    p = lp.exp().detach()
    kl_true = (lp.exp() * (lp - lq)).sum()
    g_true, = torch.autograd.grad(kl_true, theta, retain_graph=True)
    g_k2, = torch.autograd.grad((p * get_kl_estimator("k2")(lp, lq)).sum(), theta,
                                retain_graph=True)
    g_k1, = torch.autograd.grad((p * get_kl_estimator("k1")(lp, lq)).sum(), theta)
    close(g_k2, g_true)
    close(g_k1, torch.zeros(3, dtype=D))


def test_k3_nonnegative_and_k2_nonnegative():
    g = torch.Generator().manual_seed(0)
    lp = 3 * torch.randn(64, 32, generator=g, dtype=D)
    ref = 3 * torch.randn(64, 32, generator=g, dtype=D)
    assert (kl_penalty(lp, ref, "k3", clamp=None) >= 0).all()
    assert (kl_penalty(lp, ref, "k2") >= 0).all()
    close(kl_penalty(lp, lp, "k3"), torch.zeros(64, 32, dtype=D))


def test_k3_clamp_default_and_overflow_guard():
    lp, ref = t([[0.0]]), t([[50.0]])  # exp(50) would be 5e21
    close(kl_penalty(lp, ref, "k3"), [[10.0]])  # "auto" clamps k3 at 10
    close(kl_penalty(lp, ref, "k3", clamp=None), [[math.exp(20) - 20 - 1]], atol=1e-3)
    close(kl_penalty(t([[4.0]]), t([[0.0]]), "k2"), [[8.0]])  # k2 not clamped by default


def test_kl_mask_loss_and_reward_penalty():
    lp = t([[LN(0.5), LN(0.25), NAN]]).requires_grad_()
    ref = t([[LN(0.25), LN(0.5), 3.0]]).requires_grad_()
    mask = t([[1, 1, 0]])
    close(kl_penalty(lp.detach(), ref.detach(), "k3", mask=mask), [[0.193147, 0.306853, 0.0]])
    loss = kl_loss(lp, ref, mask, "k3")
    close(loss, (0.193147 + 0.306853) / 2)
    loss.backward()
    # d k3 / d lp = 1 - exp(ref - lp) -> [1 - 0.5, 1 - 2] / 2 tokens
    close(lp.grad, [[0.25, -0.5, 0.0]])
    assert ref.grad is None
    pen = kl_reward_penalty(lp, ref, mask, kl_coef=0.1, estimator="k1")
    close(pen, [[0.0693147, -0.0693147, 0.0]])
    assert not pen.requires_grad


def test_kl_controllers():
    # Ziegler et al. 2019: e = clip(KL/target - 1, -0.2, 0.2); beta *= 1 + e * n / horizon
    c = AdaptiveKLController(0.1, target_kl=6.0, horizon=10000)
    close(t(c.update(9.0, 256)), 0.1 * 1.00512)  # e = 0.5 -> clipped 0.2
    c = AdaptiveKLController(0.1, target_kl=6.0, horizon=10000)
    close(t(c.update(3.0, 256)), 0.1 * 0.99488)  # e = -0.5 -> -0.2
    c = AdaptiveKLController(0.1, target_kl=6.0, horizon=10000)
    close(t(c.update(6.6, 1000)), 0.101)  # e = 0.1 -> * 1.01
    f = FixedKLController(0.05)
    assert f.update(100.0, 10) == 0.05 and f.value == 0.05
    assert isinstance(A.make_kl_controller("adaptive", 0.1, 6.0, 1e4), AdaptiveKLController)
    with pytest.raises(ValueError):
        A.make_kl_controller("pid")


# ---------------------------------------------------------------------------------- entropy
def test_entropy_and_logprobs_from_logits():
    logits = t([[0.0, 0.0, -1e9, -1e9], [0.0, LN(3), -1e9, -1e9], [0, 0, 0, 0],
                [1000.0, 1000.0, -1e9, -1e9]])
    # ln 2; -(.25 ln .25 + .75 ln .75) = 0.562335; ln 4; ln 2 (large logits stay stable)
    close(entropy_from_logits(logits), [0.693147, 0.562335, 1.386294, 0.693147])
    close(logprobs_from_logits(logits, torch.tensor([0, 1, 3, 1])),
          [LN(0.5), LN(0.75), LN(0.25), LN(0.5)])
    x = logits[:3].clone().requires_grad_()
    entropy_from_logits(x).sum().backward()
    assert torch.isfinite(x.grad).all()
    bf = entropy_from_logits(t([[0.0, 0.0]]).to(torch.bfloat16))
    assert bf.dtype == torch.float32 and abs(bf.item() - 0.693147) < 1e-5


# ---------------------------------------------------------------------------------- filters
def test_filter_groups_drops_identical_reward_groups():
    r = t([1, 1, 1, 0, 1, 0, 0, 0, 0, 0.5, 0.5, 0.5])
    f = filter_groups(r, group_size=3)
    assert f.group_keep.tolist() == [False, True, False, False]
    assert f.sample_index.tolist() == [3, 4, 5]
    assert f.sample_keep.tolist() == [False] * 3 + [True] * 3 + [False] * 6
    f = filter_groups(torch.tensor([1, 0, 1, 1]), group_ids=torch.tensor([5, 9, 5, 9]))
    assert f.group_keep.tolist() == [False, True] and f.sample_index.tolist() == [1, 3]
    assert filter_groups(t([0.0, 1e-9]), 2, atol=1e-6).group_keep.tolist() == [False]


def test_group_has_signal_is_filter_groups_on_one_group():
    """The sources' per-group verdict agrees with the batch filter group by group."""
    rewards = [[1, 1, 1], [1, 0, 1], [0, 0, 0], [0.5, 0.5, 0.5], [0.25, 0.5, 0.5], [2.0]]
    flat = t([r for g in rewards[:5] for r in g])
    assert [group_has_signal(g) for g in rewards[:5]] == filter_groups(flat, group_size=3).group_keep.tolist()
    assert [group_has_signal(g) for g in rewards] == [False, True, False, False, True, False]


def test_overlong_penalty_dapo():
    # L_max = 20, L_cache = 4 -> free up to 16, linear to -1 at 20, -1 beyond
    lengths = torch.tensor([10, 16, 17, 18, 20, 21])
    close(overlong_penalty(lengths, max_len=20, buffer_len=4).to(D),
          [0.0, 0.0, -0.25, -0.5, -1.0, -1.0])
    close(overlong_penalty(lengths.to(D), 20, 4, penalty_factor=0.5),
          [0.0, 0.0, -0.125, -0.25, -0.5, -0.5])
    with pytest.raises(ValueError):
        overlong_penalty(lengths, 20, 0)


def test_length_penalty_kimi():
    # group lengths [10, 20, 30, 10]: lambda = 0.5 - (len - 10) / 20 = [0.5, 0, -0.5, 0.5]
    # correct [1, 1, 0, 0] -> [0.5, 0, min(0, -0.5), min(0, 0.5)] = [0.5, 0, -0.5, 0]
    # group 2: equal lengths -> 0
    lengths = torch.tensor([10, 20, 30, 10, 7, 7])
    correct = torch.tensor([1, 1, 0, 0, 1, 0])
    close(length_penalty(lengths, correct, group_ids=torch.tensor([0, 0, 0, 0, 1, 1])).to(D),
          [0.5, 0.0, -0.5, 0.0, 0.0, 0.0])
    close(A.linear_length_penalty(torch.tensor([5, 10]), max_len=10, coef=0.2).to(D), [-0.1, -0.2])


# ---------------------------------------------------------------------------------- metrics
def test_metric_helpers():
    ratio = t([[1.5, 0.5, 1.1], [0.7, NAN, 0.0]])
    adv = t([[1, 1, -1], [-1, 0, 0]])
    mask = t([[1, 1, 1], [1, 0, 0]])
    close(M.clip_fraction(ratio, adv, mask, 0.2, 0.2), 0.5)  # tokens 0 (high) and 3 (low)
    s = M.ratio_stats(ratio, mask)
    close(s["ratio_mean"], 0.95)
    close(s["ratio_max"], 1.5)
    close(s["ratio_min"], 0.5)
    a = M.advantage_stats(adv, mask)
    close(a["adv_mean"], 0.0)
    close(a["adv_std"], math.sqrt(4 / 3))
    close(M.approx_kl(t([[0.0, LN(2)]]), t([[LN(2), 0.0]]), t([[1, 0]])), 0.693147)
    close(M.entropy_mean(t([[1.0, 3.0, NAN]]), t([[1, 1, 0]])), 2.0)
    mm = M.logprob_mismatch(t([[0.0, -1.0, NAN]]), t([[-0.5, -1.0, 0.0]]), t([[1, 1, 0]]))
    close(mm["rollout_logprob_diff_mean"], 0.25)
    close(mm["rollout_logprob_diff_max"], 0.5)
    ls = M.response_length_stats(mask, max_len=3)
    close(ls["response_length_mean"].to(D), 2.0)
    close(ls["response_clip_ratio"].to(D), 0.5)
    r = M.reward_stats(torch.tensor([1, 0, 0, 1]))
    assert abs(r["reward_mean"].item() - 0.5) < 1e-6
    empty = M.ratio_stats(ratio, torch.zeros(2, 3))
    assert all(torch.isfinite(v) for v in empty.values())


# ---------------------------------------------------------------------------------- registry
def test_registry_names_aliases_and_errors():
    adv = {"gae", "grpo", "dr_grpo", "rloo", "reinforce_plus_plus",
           "reinforce_plus_plus_baseline", "remax"}
    assert adv <= set(A.registry.ADVANTAGE_ESTIMATORS.names())
    assert {"ppo", "gspo", "clip_cov", "kl_cov"} <= set(A.registry.POLICY_LOSSES.names())
    assert {"k1", "k2", "k3", "low_var_kl"} <= set(A.registry.KL_ESTIMATORS.names())
    assert A.get_kl_estimator("low_var_kl") is A.get_kl_estimator("k3")
    with pytest.raises(KeyError, match="grpo"):
        A.get_advantage_estimator("grpoo")
    with pytest.raises(KeyError):
        A.get_policy_loss("nope")


def test_register_custom_and_duplicate_is_refused():
    @A.register_kl_estimator("test_only_zero_kl")
    def zero(lp, ref):
        return torch.zeros_like(lp)

    assert A.get_kl_estimator("test_only_zero_kl") is zero
    close(kl_penalty(t([[1.0]]), t([[0.0]]), "test_only_zero_kl"), [[0.0]])
    with pytest.raises(ValueError):
        A.register_policy_loss("ppo")(lambda *a, **k: None)


def test_algos_imports_only_torch_and_stdlib():
    allowed = {"torch", "__future__", "typing", "dataclasses", "math", "types", "collections",
               "functools", "itertools", "abc", "enum"}
    root = pathlib.Path(A.__file__).parent
    for path in root.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                mods = [node.module]
            else:
                continue
            for mod in mods:
                assert mod.split(".")[0] in allowed, f"{path.name} imports {mod}"


def test_every_public_function_cites_or_documents():
    for name in A.__all__:
        obj = getattr(A, name)
        if callable(obj):
            assert (obj.__doc__ or "").strip(), f"{name} has no docstring"
