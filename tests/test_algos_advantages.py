"""Advantage estimators against hand-computed examples (values written out, not recomputed)."""
import math

import pytest
import torch

from megarl.algos import (
    discounted_returns,
    get_advantage_estimator,
    grpo_advantages,
    masked_whiten,
    token_level_rewards,
)

from tests.helpers.tensors import D, NAN, close, t


# one mask reused below: lengths 3, 2, 1, 3 (right padded to 3)
MASK4 = t([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]])


# ------------------------------------------------------------------------------------ GRPO
def test_grpo_hand_example_with_std():
    # group A = [1, 0, 0, 0]: mean 0.25, unbiased std sqrt((0.75^2 + 3 * 0.25^2) / 3) = 0.5
    # group B = [1, 1, 0, 0]: mean 0.5,  unbiased std sqrt(4 * 0.25 / 3) = 1/sqrt(3)
    r = t([1, 0, 0, 0, 1, 1, 0, 0])
    mask = torch.ones(8, 2, dtype=D)
    adv, ret = get_advantage_estimator("grpo")(r, mask, group_size=4, eps=0.0)
    expect = [1.5, -0.5, -0.5, -0.5, 0.866025, 0.866025, -0.866025, -0.866025]
    close(adv[:, 0], expect)
    close(adv[:, 1], expect)
    close(ret, adv)


def test_grpo_without_std_and_dr_grpo_are_centred_rewards():
    r = t([1, 0, 0, 0, 1, 1, 0, 0])
    mask = torch.ones(8, 1, dtype=D)
    expect = [0.75, -0.25, -0.25, -0.25, 0.5, 0.5, -0.5, -0.5]
    a1, _ = get_advantage_estimator("grpo")(r, mask, group_size=4, norm_std=False)
    a2, _ = get_advantage_estimator("dr_grpo")(r, mask, group_size=4)  # norm_std ignored
    close(a1[:, 0], expect)
    close(a2[:, 0], expect)


def test_grpo_broadcasts_only_on_valid_tokens():
    r = t([1, 0, 3, 2])
    adv, _ = get_advantage_estimator("dr_grpo")(r, MASK4, group_size=2)
    close(adv, [[0.5, 0.5, 0.5], [-0.5, -0.5, 0.0], [0.5, 0.0, 0.0], [-0.5, -0.5, -0.5]])


def test_grpo_group_of_one_has_zero_advantage():
    adv, _ = grpo_advantages(t([3.0, -1.0]), torch.ones(2, 2, dtype=D), group_size=1)
    close(adv, torch.zeros(2, 2, dtype=D))


def test_grpo_group_ids_equal_contiguous_groups():
    r = t([1, 0, 0, 0, 1, 1, 0, 0])
    mask = torch.ones(8, 1, dtype=D)
    ref, _ = grpo_advantages(r, mask, group_size=4)
    perm = torch.tensor([4, 0, 5, 1, 6, 2, 7, 3])
    ids = torch.tensor([70, 10, 70, 10, 70, 10, 70, 10])  # any labels, interleaved
    got, _ = grpo_advantages(r[perm], mask[perm], group_ids=ids)
    close(got, ref[perm])


def test_group_estimators_need_groups():
    with pytest.raises(ValueError):
        grpo_advantages(t([1.0, 0.0]), torch.ones(2, 1, dtype=D))
    with pytest.raises(ValueError):
        grpo_advantages(t([1.0, 0.0, 1.0]), torch.ones(3, 1, dtype=D), group_size=2)


def test_grpo_kl_penalty_reduces_the_sequence_score():
    # scores: 1 - (0.1 + 0.2) = 0.7 and 0 - 0.3 = -0.3 (padded kl entries ignored); mean 0.2
    kl = t([[0.1, 0.2, 9.0], [0.3, NAN, 9.0]])
    mask = t([[1, 1, 0], [1, 0, 0]])
    adv, _ = get_advantage_estimator("dr_grpo")(t([1, 0]), mask, group_size=2, kl=kl)
    close(adv, [[0.5, 0.5, 0.0], [-0.5, 0.0, 0.0]])


def test_grpo_with_group_equal_batch_is_centred_reinforce():
    # REINFORCE with the batch-mean baseline: A_i = r_i - mean(r); with std: / std(r)
    r = t([2.0, -1.0, 0.5, 3.5, 0.0])
    mask = torch.ones(5, 2, dtype=D)
    a, _ = grpo_advantages(r, mask, group_size=5, norm_std=False)
    close(a[:, 0], [1.0, -2.0, -0.5, 2.5, -1.0])  # mean 1.0
    a_std, _ = grpo_advantages(r, mask, group_size=5, eps=0.0)
    # unbiased std of r: sqrt((1 + 4 + 0.25 + 6.25 + 1) / 4) = sqrt(3.125) = 1.767767
    close(a_std[:, 1], [0.565685, -1.131371, -0.282843, 1.414214, -0.565685])
    # ... and, for one-token responses, REINFORCE++'s global whitening gives the same numbers
    a_pp, _ = get_advantage_estimator("reinforce_plus_plus")(r, torch.ones(5, 1, dtype=D), eps=0.0)
    close(a_pp[:, 0], a_std[:, 0])


# ------------------------------------------------------------------------------------ RLOO
def test_rloo_hand_example():
    # group A [1,0,0,0]: sample 0 baseline (0+0+0)/3 = 0 -> 1; others baseline 1/3 -> -1/3
    # group B [1,1,0,0]: ones: baseline 1/3 -> 2/3; zeros: baseline 2/3 -> -2/3
    r = t([1, 0, 0, 0, 1, 1, 0, 0])
    adv, ret = get_advantage_estimator("rloo")(r, torch.ones(8, 1, dtype=D), group_size=4)
    close(adv[:, 0], [1, -1 / 3, -1 / 3, -1 / 3, 2 / 3, 2 / 3, -2 / 3, -2 / 3])
    close(ret, adv)


def test_rloo_is_scaled_dr_grpo_and_needs_two_samples():
    g = torch.Generator().manual_seed(0)
    r = torch.randn(12, generator=g, dtype=D)
    mask = torch.ones(12, 1, dtype=D)
    a_rloo, _ = get_advantage_estimator("rloo")(r, mask, group_size=4)
    a_dr, _ = get_advantage_estimator("dr_grpo")(r, mask, group_size=4)
    close(a_rloo, a_dr * 4 / 3)
    with pytest.raises(ValueError):
        get_advantage_estimator("rloo")(r, mask, group_size=1)


# ------------------------------------------------------------------------------------ GAE
def test_gae_hand_example():
    # seq 0: V = [0.5, 0.6, 0.7], R = 1 on the last token, gamma = 0.9, lam = 0.8 (gamma*lam = 0.72)
    #   t=2: delta = 1 - 0.7 = 0.3                      A2 = 0.3
    #   t=1: delta = 0.9*0.7 - 0.6 = 0.03                A1 = 0.03 + 0.72*0.3   = 0.246
    #   t=0: delta = 0.9*0.6 - 0.5 = 0.04                A0 = 0.04 + 0.72*0.246 = 0.21712
    # seq 1: length 1, V = [0.2], R = -1:  A0 = -1 - 0.2 = -1.2, return -1.0
    values = t([[0.5, 0.6, 0.7], [0.2, 5.0, NAN]])
    mask = t([[1, 1, 1], [1, 0, 0]])
    adv, ret = get_advantage_estimator("gae")(t([1, -1]), mask, values=values, gamma=0.9,
                                             lam=0.8, norm_std=False)
    close(adv, [[0.21712, 0.246, 0.3], [-1.2, 0.0, 0.0]])
    close(ret, [[0.71712, 0.846, 1.0], [-1.0, 0.0, 0.0]])


def test_gae_lambda_limits():
    values = t([[0.5, 0.6, 0.7]])
    mask = torch.ones(1, 3, dtype=D)
    gae = get_advantage_estimator("gae")
    # lam = 1, gamma = 1: Monte Carlo A_t = R - V_t
    a, _ = gae(t([1.0]), mask, values=values, gamma=1.0, lam=1.0, norm_std=False)
    close(a, [[0.5, 0.4, 0.3]])
    # lam = 0: TD(0) A_t = r_t + gamma V_{t+1} - V_t, gamma = 0.5
    a, _ = gae(t([1.0]), mask, values=values, gamma=0.5, lam=0.0, norm_std=False)
    close(a, [[0.5 * 0.6 - 0.5, 0.5 * 0.7 - 0.6, 1 - 0.7]])  # [-0.2, -0.25, 0.3]


def test_gae_with_kl_in_reward():
    # gamma = lam = 1, V = 0: A_t = R - sum_{s >= t} kl_s, kl = [0.1, 0.2, 0.3], R = 1
    a, ret = get_advantage_estimator("gae")(
        t([1.0]), torch.ones(1, 3, dtype=D), values=torch.zeros(1, 3, dtype=D),
        kl=t([[0.1, 0.2, 0.3]]), norm_std=False)
    close(a, [[0.4, 0.5, 0.7]])
    close(ret, [[0.4, 0.5, 0.7]])


def test_gae_skips_holes_in_the_mask():
    # mask [1, 0, 1]: the hole passes values/advantages through; same as GAE on [0.5, 0.7]:
    #   t=1: A = 1 - 0.7 = 0.3;  t=0: delta = 0.9*0.7 - 0.5 = 0.13, A = 0.13 + 0.72*0.3 = 0.346
    a, _ = get_advantage_estimator("gae")(t([1.0]), t([[1, 0, 1]]), values=t([[0.5, 99.0, 0.7]]),
                                         gamma=0.9, lam=0.8, norm_std=False)
    close(a, [[0.346, 0.0, 0.3]])


def test_gae_whitening_and_needs_values():
    values = t([[0.5, 0.6, 0.7], [0.2, 0.0, 0.0]])
    mask = t([[1, 1, 1], [1, 0, 0]])
    a, ret = get_advantage_estimator("gae")(t([1, -1]), mask, values=values, gamma=0.9, lam=0.8,
                                           eps=0.0)
    valid = a[mask.bool()]
    close(valid.mean(), t(0.0))
    close(valid.std(), t(1.0))
    close(a[1, 1:], [0.0, 0.0])
    close(ret, [[0.71712, 0.846, 1.0], [-1.0, 0.0, 0.0]])  # returns are not whitened
    with pytest.raises(ValueError):
        get_advantage_estimator("gae")(t([1.0]), torch.ones(1, 2, dtype=D))


# ------------------------------------------------------------------------------ REINFORCE++
def test_reinforce_pp_global_normalisation_hand_example():
    # returns [[1,1,1],[0,0]]: mean over 5 tokens 0.6, unbiased var (3*0.16 + 2*0.36)/4 = 0.3
    # adv = 0.4/sqrt(0.3) = 0.730297 and -0.6/sqrt(0.3) = -1.095445
    mask = t([[1, 1, 1], [1, 1, 0]])
    adv, ret = get_advantage_estimator("reinforce_plus_plus")(t([1, 0]), mask, eps=0.0)
    close(adv, [[0.730297, 0.730297, 0.730297], [-1.095445, -1.095445, 0.0]])
    close(ret, [[1, 1, 1], [0, 0, 0]])


def test_reinforce_pp_discounted_returns_with_token_kl():
    # token rewards [-0.1, -0.1, 1 - 0.1], gamma 0.5: G2 = 0.9, G1 = -0.1 + 0.45 = 0.35,
    # G0 = -0.1 + 0.175 = 0.075
    _, ret = get_advantage_estimator("reinforce_plus_plus")(
        t([1.0]), torch.ones(1, 3, dtype=D), kl=t([[0.1, 0.1, 0.1]]), gamma=0.5)
    close(ret, [[0.075, 0.35, 0.9]])


def test_reinforce_pp_baseline_removes_group_offsets():
    # two groups [1, 0] and [3, 2], one-token responses
    mask = torch.ones(4, 1, dtype=D)
    r = t([1, 0, 3, 2])
    # baseline: [0.5, -0.5, 0.5, -0.5] -> mean 0, unbiased std sqrt(1/3) -> +-0.866025
    a, ret = get_advantage_estimator("reinforce_plus_plus_baseline")(r, mask, group_size=2,
                                                                     eps=0.0)
    close(a[:, 0], [0.866025, -0.866025, 0.866025, -0.866025])
    close(ret[:, 0], [0.5, -0.5, 0.5, -0.5])
    # without baseline: mean 1.5, unbiased std sqrt(5/3) = 1.290994
    a, _ = get_advantage_estimator("reinforce_plus_plus")(r, mask, eps=0.0)
    close(a[:, 0], [-0.387298, -1.161895, 1.161895, 0.387298])


def test_reinforce_pp_norm_std_false_only_centres():
    mask = t([[1, 1, 1], [1, 1, 0]])
    a, _ = get_advantage_estimator("reinforce_plus_plus")(t([1, 0]), mask, norm_std=False)
    close(a, [[0.4, 0.4, 0.4], [-0.6, -0.6, 0.0]])


# ------------------------------------------------------------------------------------ ReMax
def test_remax_hand_example():
    # seq 0: R = 1, kl [0.1, 0.2], greedy baseline 0.5: G = [0.7, 0.8], A = [0.2, 0.3]
    # seq 1: R = 0, no kl on its single token, baseline 0.5: A = -0.5
    mask = t([[1, 1], [1, 0]])
    adv, ret = get_advantage_estimator("remax")(t([1, 0]), mask, kl=t([[0.1, 0.2], [0.0, 7.0]]),
                                               baseline_rewards=t([0.5, 0.5]))
    close(adv, [[0.2, 0.3], [-0.5, 0.0]])
    close(ret, [[0.7, 0.8], [0.0, 0.0]])
    with pytest.raises(ValueError):
        get_advantage_estimator("remax")(t([1, 0]), mask)


# ------------------------------------------------------------------------------- building blocks
def test_token_level_rewards_and_returns():
    r = token_level_rewards(t([2.0, 3.0, 4.0]), MASK4[:3])
    close(r, [[0, 0, 2], [0, 3, 0], [4, 0, 0]])
    # token-level (process) rewards pass through, padding zeroed
    r2 = token_level_rewards(t([[1, 2, NAN]]), t([[1, 1, 0]]))
    close(r2, [[1, 2, 0]])
    close(discounted_returns(t([[1, 2, 4]]), torch.ones(1, 3, dtype=D), gamma=0.5),
          [[1 + 1 + 1, 2 + 2, 4]])


def test_masked_whiten_scale_only():
    x = t([[1, 3, 100]])
    m = t([[1, 1, 0]])
    # mean 2, unbiased std sqrt(2): shift_mean=False -> (x - 2)/sqrt(2) + 2
    close(masked_whiten(x, m, shift_mean=False, eps=0.0),
          [[2 - 1 / math.sqrt(2), 2 + 1 / math.sqrt(2), 0.0]])


# --------------------------------------------------------------------------- generic properties
ALL_KW = {
    "gae": dict(values=t([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6], [0.7, 0.8, 0.9], [0.0, 0.1, 0.2]]),
                gamma=0.9, lam=0.95),
    "grpo": dict(group_size=2),
    "dr_grpo": dict(group_size=2),
    "rloo": dict(group_size=2),
    "reinforce_plus_plus": dict(gamma=0.99),
    "reinforce_plus_plus_baseline": dict(group_size=2),
    "remax": dict(baseline_rewards=t([0.2, 0.2, 0.1, 0.1])),
}


@pytest.mark.parametrize("name", sorted(ALL_KW))
def test_padding_changes_nothing(name):
    fn = get_advantage_estimator(name)
    r = t([1.0, 0.0, 0.5, 2.0])
    kl = t([[0.01, 0.02, 0.03], [0.01, 0.0, 0.0], [0.05, 0.0, 0.0], [0.0, 0.1, 0.0]])
    base = fn(r, MASK4, kl=kl, **ALL_KW[name])
    # widen by 2 columns of garbage, and put garbage into the existing padded slots
    pad = torch.full((4, 2), NAN, dtype=D)
    kw = dict(ALL_KW[name])
    if "values" in kw:
        v = kw["values"].clone()
        v[~MASK4.bool()] = 1e9
        kw["values"] = torch.cat([v, pad], 1)
    kl_g = kl.clone()
    kl_g[~MASK4.bool()] = NAN
    mask_w = torch.cat([MASK4, torch.zeros(4, 2, dtype=D)], 1)
    out = fn(r, mask_w.bool(), kl=torch.cat([kl_g, pad], 1), **kw)
    for a, b in zip(base, out):
        close(b[:, :3], a)
        close(b[:, 3:], torch.zeros(4, 2, dtype=D))
        assert torch.isfinite(b).all()


@pytest.mark.parametrize("name", sorted(ALL_KW))
def test_advantages_carry_no_gradient(name):
    r = t([1.0, 0.0, 0.5, 2.0]).requires_grad_()
    kw = {k: (v.clone().requires_grad_() if torch.is_tensor(v) else v)
          for k, v in ALL_KW[name].items()}
    adv, ret = get_advantage_estimator(name)(r, MASK4, **kw)
    assert not adv.requires_grad and not ret.requires_grad
