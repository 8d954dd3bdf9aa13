"""Policy / value losses and aggregation against hand-computed examples; masks and gradients."""
import math

import pytest
import torch

from megarl.algos import (
    AGG_MODES,
    PolicyLossConfig,
    RolloutCorrection,
    aggregate_loss,
    entropy_bonus,
    get_policy_loss,
    value_loss,
)

from tests.helpers.tensors import D, NAN, t, close, LN


# ------------------------------------------------------------------------------- aggregation
LOSS = t([[1, 2, 3], [4, 99, NAN]])
MASK = t([[1, 1, 1], [1, 0, 0]])


def test_aggregation_modes_on_unequal_lengths():
    # token-mean:               (1+2+3+4) / 4          = 2.5
    # seq-mean-token-sum:       (6 + 4) / 2            = 5
    # seq-mean-token-mean:      (6/3 + 4/1) / 2        = 3
    # seq-mean-token-sum-norm:  (6 + 4) / (2 * T=3)    = 1.666667 ; with L=5: 10 / 10 = 1
    close(aggregate_loss(LOSS, MASK, "token-mean"), 2.5)
    close(aggregate_loss(LOSS, MASK, "seq-mean-token-sum"), 5.0)
    close(aggregate_loss(LOSS, MASK, "seq-mean-token-mean"), 3.0)
    close(aggregate_loss(LOSS, MASK, "seq-mean-token-sum-norm"), 10 / 6)
    close(aggregate_loss(LOSS, MASK, "seq-mean-token-sum-norm", norm_len=5), 1.0)


def test_aggregation_gradient_weights_per_mode():
    # d loss / d l_it: token-mean 1/4 everywhere valid; seq-mean-token-mean 1/(B*|o_i|) =
    # 1/6 on row 0 and 1/2 on row 1; seq-mean-token-sum 1/B; sum-norm 1/(B*T)
    expect = {
        "token-mean": [[0.25, 0.25, 0.25], [0.25, 0, 0]],
        "seq-mean-token-mean": [[1 / 6, 1 / 6, 1 / 6], [0.5, 0, 0]],
        "seq-mean-token-sum": [[0.5, 0.5, 0.5], [0.5, 0, 0]],
        "seq-mean-token-sum-norm": [[1 / 6, 1 / 6, 1 / 6], [1 / 6, 0, 0]],
    }
    for mode, w in expect.items():
        x = LOSS.clone().requires_grad_()
        aggregate_loss(x, MASK, mode).backward()
        close(x.grad, w)


def test_aggregation_equal_lengths_relations():
    x = t([[1, 2], [3, 6]])
    m = torch.ones(2, 2, dtype=D)
    tm = aggregate_loss(x, m, "token-mean")
    close(tm, 3.0)
    close(aggregate_loss(x, m, "seq-mean-token-mean"), tm)
    close(aggregate_loss(x, m, "seq-mean-token-sum"), 2 * tm)  # T * token-mean
    close(aggregate_loss(x, m, "seq-mean-token-sum-norm"), tm)  # L = T


def test_aggregation_microbatches_sum_to_global():
    for mode, kw in [("token-mean", dict(num_tokens=4)), ("seq-mean-token-mean", dict(num_seqs=2)),
                     ("seq-mean-token-sum", dict(num_seqs=2)),
                     ("seq-mean-token-sum-norm", dict(num_seqs=2, norm_len=3))]:
        parts = sum(aggregate_loss(LOSS[i:i + 1], MASK[i:i + 1], mode, **kw) for i in range(2))
        close(parts, aggregate_loss(LOSS, MASK, mode))


def test_aggregation_bool_mask_and_errors():
    close(aggregate_loss(LOSS, MASK.bool(), "token-mean"), 2.5)
    with pytest.raises(ValueError):
        aggregate_loss(LOSS, MASK, "token-sum")
    with pytest.raises(ValueError):
        aggregate_loss(LOSS, MASK[:, :2], "token-mean")


# ------------------------------------------------------------------------------------- PPO
# four tokens, old logprob 0, ratios 1.5, 0.5, 1.1 (row 0) and 0.7 (row 1), advantages 1,1,-1,-1
#  tok0: r=1.5, A=+1: max(-1.5, -1.2) = -1.2 (clipped high)
#  tok1: r=0.5, A=+1: max(-0.5, -0.8) = -0.5
#  tok2: r=1.1, A=-1: max( 1.1,  1.1) =  1.1
#  tok3: r=0.7, A=-1: max( 0.7,  0.8) =  0.8 (clipped low)
def ppo_case():
    lp = t([[LN(1.5), LN(0.5), LN(1.1)], [LN(0.7), NAN, 5.0]]).requires_grad_()
    old = t([[0, 0, 0], [0, 1e9, NAN]])
    adv = t([[1, 1, -1], [-1, NAN, 3.0]])
    return lp, old, adv, MASK


def test_ppo_hand_example_token_mean():
    lp, old, adv, mask = ppo_case()
    loss, m = get_policy_loss("ppo")(lp, old, adv, mask, PolicyLossConfig())
    close(loss, (-1.2 - 0.5 + 1.1 + 0.8) / 4)  # 0.05
    close(m["clip_frac"], 0.5)
    close(m["clip_frac_high"], 0.25)
    close(m["clip_frac_low"], 0.25)
    close(m["ratio_mean"], 0.95)
    close(m["ratio_max"], 1.5)
    # approx_kl = mean(old - lp) = -(ln1.5 + ln0.5 + ln1.1 + ln0.7)/4 = 0.549047/4
    close(m["approx_kl"], 0.137262)
    for v in m.values():
        assert v.dim() == 0 and not v.requires_grad
    loss.backward()
    # d/dlp of -A r / 4 = -A r / 4 on unclipped tokens, 0 on clipped ones and on padding
    close(lp.grad, [[0.0, -0.125, 0.275], [0.0, 0.0, 0.0]])


def test_ppo_seq_mean_token_mean():
    lp, old, adv, mask = ppo_case()
    loss, _ = get_policy_loss("ppo")(lp, old, adv, mask,
                                     PolicyLossConfig(agg_mode="seq-mean-token-mean"))
    close(loss, ((-1.2 - 0.5 + 1.1) / 3 + 0.8) / 2)  # 0.3


def test_ppo_clip_higher():
    # clip_high 0.6: tok0 (r=1.5) is no longer clipped -> -1.5
    lp, old, adv, mask = ppo_case()
    loss, m = get_policy_loss("ppo")(lp, old, adv, mask, PolicyLossConfig(clip_high=0.6))
    close(loss, (-1.5 - 0.5 + 1.1 + 0.8) / 4)
    close(m["clip_frac"], 0.25)
    loss.backward()
    close(lp.grad[0, 0], -1.5 / 4)


def test_ppo_dual_clip():
    # A = -1: r = 5 -> max(5, 1.2) = 5, dual-clipped to c = 3 (no gradient);
    #         r = 2 -> max(2, 1.2) = 2 < 3, kept (gradient -A r = 2 per token, /3 tokens);
    # A = +1, r = 5 -> -1.2 (ordinary clip; dual clip only acts on A < 0)
    lp = t([[LN(5), LN(2), LN(5)]]).requires_grad_()
    old = torch.zeros(1, 3, dtype=D)
    adv = t([[-1, -1, 1]])
    cfg = PolicyLossConfig(dual_clip_c=3.0)
    loss, m = get_policy_loss("ppo")(lp, old, adv, torch.ones(1, 3, dtype=D), cfg)
    close(loss, (3 + 2 - 1.2) / 3)
    close(m["dual_clip_frac"], 1 / 3)
    loss.backward()
    close(lp.grad, [[0.0, 2 / 3, 0.0]])
    # without dual clip the first token costs 5
    loss2, _ = get_policy_loss("ppo")(lp, old, adv, torch.ones(1, 3, dtype=D))
    close(loss2, (5 + 2 - 1.2) / 3)
    with pytest.raises(ValueError):
        PolicyLossConfig(dual_clip_c=1.0)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_ppo_at_ratio_one_is_minus_mean_advantage(mode):
    g = torch.Generator().manual_seed(1)
    lp = torch.randn(3, 4, generator=g, dtype=D).requires_grad_()
    adv = torch.randn(3, 4, generator=g, dtype=D)
    mask = t([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]])
    loss, m = get_policy_loss("ppo")(lp, lp.detach(), adv, mask, PolicyLossConfig(agg_mode=mode))
    close(loss, -aggregate_loss(adv, mask, mode))
    close(m["clip_frac"], 0.0)
    close(m["approx_kl"], 0.0)
    close(m["ratio_mean"], 1.0)
    # and the gradient is the vanilla policy gradient -A * d(log pi) with the mode's weights
    loss.backward()
    w = torch.zeros_like(adv).requires_grad_()
    aggregate_loss(w, mask, mode).backward()
    close(lp.grad, -adv * w.grad)


def test_ppo_single_token_value():
    # token-mean with a single token at r = 1.1 (inside the clip range), A = 2: loss = -2.2
    loss, _ = get_policy_loss("ppo")(t([[LN(1.1)]]), t([[0.0]]), t([[2.0]]), t([[1.0]]))
    close(loss, -2.2)


def test_ppo_microbatches_sum_to_global_loss_and_grad():
    g = torch.Generator().manual_seed(2)
    lp = torch.randn(4, 5, generator=g, dtype=D).requires_grad_()
    old = lp.detach() + 0.3 * torch.randn(4, 5, generator=g, dtype=D)
    adv = torch.randn(4, 5, generator=g, dtype=D)
    mask = (torch.rand(4, 5, generator=g) > 0.3).to(D)
    mask[:, 0] = 1
    full, _ = get_policy_loss("ppo")(lp, old, adv, mask)
    full.backward()
    g_full = lp.grad.clone()
    lp.grad = None
    n = mask.sum()
    total = 0
    for sl in (slice(0, 1), slice(1, 4)):
        part, _ = get_policy_loss("ppo")(lp[sl], old[sl], adv[sl], mask[sl], num_tokens=n)
        part.backward()
        total = total + part.detach()
    close(total, full.detach())
    close(lp.grad, g_full)


# ------------------------------------------------------------------------------------- TIS
def test_tis_weights_and_mismatch_metrics():
    # lp = old = 0 (ratio 1), A = 1; rollout logprobs give pi_old/pi_rollout = 3 and 0.5
    # TIS cap 2: weights [2, 0.5] -> per-token loss [-2, -0.5] -> token-mean -1.25
    lp = torch.zeros(1, 3, dtype=D).requires_grad_()
    old = torch.zeros(1, 3, dtype=D)
    roll = t([[-LN(3), LN(2), NAN]]).requires_grad_()
    mask = t([[1, 1, 0]])
    cfg = PolicyLossConfig(rollout_correction=RolloutCorrection.from_tis_cap(2.0))
    loss, m = get_policy_loss("ppo")(lp, old, t([[1, 1, 1]]), mask, cfg, rollout_logprobs=roll)
    close(loss, -1.25)
    close(m["rollout_is_truncated_frac"], 0.5)
    close(m["rollout_is_weight_max"], 2.0)
    close(m["rollout_is_weight_mean"], 1.25)
    close(m["rollout_logprob_diff_mean"], (1.098612 + 0.693147) / 2)
    close(m["rollout_logprob_diff_max"], 1.098612)
    loss.backward()
    close(lp.grad, [[-1.0, -0.25, 0.0]])
    assert roll.grad is None
    # rollout logprobs without a cap: metrics only, loss unchanged (-1)
    loss, m = get_policy_loss("ppo")(lp, old, t([[1, 1, 1]]), mask, rollout_logprobs=roll)
    close(loss, -1.0)
    assert "rollout_logprob_diff_max" in m and "rollout_is_weight_mean" not in m
    with pytest.raises(ValueError):
        get_policy_loss("ppo")(lp, old, t([[1, 1, 1]]), mask, cfg)


# ------------------------------------------------------------------------------------- GSPO
def gspo_case():
    # seq 0 (2 tokens): lp - old = [ln 2, 0] -> s = exp(ln2 / 2) = sqrt 2 = 1.414214, A = +1
    # seq 1 (1 token):  lp - old = [ln 0.9]  -> s = 0.9, A = -1
    lp = t([[LN(2), 0.0, NAN], [LN(0.9), 7.0, 7.0]]).requires_grad_()
    old = torch.zeros(2, 3, dtype=D)
    adv = t([[1, 1, 0], [-1, 0, 0]])
    mask = t([[1, 1, 0], [1, 0, 0]])
    return lp, old, adv, mask


def test_gspo_sequence_ratio_clipped():
    lp, old, adv, mask = gspo_case()
    # seq 0: s = 1.414 > 1.2 with A > 0: clipped, -1.2 per token; seq 1: max(0.9, 0.9) = 0.9
    loss, m = get_policy_loss("gspo")(lp, old, adv, mask,
                                      PolicyLossConfig(agg_mode="seq-mean-token-mean"))
    close(loss, (-1.2 + 0.9) / 2)
    close(m["clip_frac"], 2 / 3)  # both tokens of seq 0
    close(m["seq_ratio_max"], math.sqrt(2))
    loss.backward()
    # only seq 1 has gradient: 1/2 (seq mean) * 1 (its token mean) * (-A) * s = 0.45
    close(lp.grad, [[0.0, 0.0, 0.0], [0.45, 0.0, 0.0]])


def test_gspo_gradient_is_sequence_level():
    lp, old, adv, mask = gspo_case()
    cfg = PolicyLossConfig(clip_high=1.0, agg_mode="seq-mean-token-mean")
    loss, _ = get_policy_loss("gspo")(lp, old, adv, mask, cfg)
    close(loss, (-math.sqrt(2) + 0.9) / 2)  # -0.257107
    loss.backward()
    # J = 1/2 sum_i -A_i s_i, d s_i / d lp_t = s_i / |y_i|: seq 0 tokens -1 * 1.414214 / 2 / 2
    close(lp.grad, [[-0.353553, -0.353553, 0.0], [0.45, 0.0, 0.0]])
    # PPO on the same data instead weights tokens by their own ratio (2 and 1)
    lp2 = lp.detach().clone().requires_grad_()
    loss2, _ = get_policy_loss("ppo")(lp2, old, adv, mask, cfg)
    loss2.backward()
    close(lp2.grad[0, :2], [-2 / 4, -1 / 4])


def test_gspo_default_config_is_seq_mean_token_mean():
    lp, old, adv, mask = gspo_case()
    a, _ = get_policy_loss("gspo")(lp, old, adv, mask)
    b, _ = get_policy_loss("gspo")(lp, old, adv, mask,
                                   PolicyLossConfig(agg_mode="seq-mean-token-mean"))
    close(a, b)


# ---------------------------------------------------------------------------- clip_cov/kl_cov
# A = [3, -1, -1, -1] (mean 0), lp = [-0.5, -2.5, -2.5, -2.5] (mean -2)
# cov_t = A_t (lp_t + 2) = [4.5, 0.5, 0.5, 0.5]: only token 0 lies in (lb=1, ub=5)
COV_LP = [-0.5, -2.5, -2.5, -2.5]
COV_ADV = [3.0, -1.0, -1.0, -1.0]


def cov_case():
    lp = t([COV_LP[:3], [COV_LP[3], NAN, NAN]]).requires_grad_()
    adv = t([COV_ADV[:3], [COV_ADV[3], 50.0, 50.0]])
    return lp, adv, MASK


def test_clip_cov_drops_high_covariance_token():
    lp, adv, mask = cov_case()
    cfg = PolicyLossConfig(clip_cov_ratio=0.25)  # max(1, int(0.25 * 4)) = 1 token
    loss, m = get_policy_loss("clip_cov")(lp, lp.detach(), adv, mask, cfg,
                                          generator=torch.Generator().manual_seed(0))
    # ratio 1: per-token -A = [-3, 1, 1, 1]; token 0 removed -> (0 + 1 + 1 + 1) / 4
    close(loss, 0.75)
    close(m["cov_clip_frac"], 0.25)
    loss.backward()
    close(lp.grad, [[0.0, 0.25, 0.25], [0.25, 0.0, 0.0]])
    # ub = 4 excludes token 0: plain PPO, (-3 + 3) / 4 = 0
    loss, m = get_policy_loss("clip_cov")(lp, lp.detach(), adv, mask,
                                          PolicyLossConfig(clip_cov_ub=4.0))
    close(loss, 0.0)
    close(m["cov_clip_frac"], 0.0)


def test_kl_cov_penalises_top_covariance_token():
    lp, adv, mask = cov_case()
    old = lp.detach() - t([[0.1, 0, 0], [0, 0, 0]])  # token 0: ratio e^0.1 = 1.105171
    cfg = PolicyLossConfig(kl_cov_ratio=0.25, kl_cov_coef=1.0)
    loss, m = get_policy_loss("kl_cov")(lp, old, adv, mask, cfg)
    # token 0: -3 * 1.105171 + |0.1| = -3.215513 ; others 1 -> (-3.215513 + 3) / 4
    close(loss, -0.053878)
    close(m["kl_cov_frac"], 0.25)
    close(m["clip_frac"], 0.0)
    loss.backward()
    # token 0: (-3 * 1.105171 + 1) / 4 = -0.578878 ; others -(-1) * 1 / 4
    close(lp.grad, [[-0.578878, 0.25, 0.25], [0.25, 0.0, 0.0]])


def test_kl_cov_is_unclipped_pg_without_selected_tokens():
    lp, adv, mask = cov_case()
    old = lp.detach() - 1.0  # ratio e for every token, far outside any clip range
    loss, _ = get_policy_loss("kl_cov")(lp, old, adv, mask, PolicyLossConfig(kl_cov_ratio=0.0))
    close(loss, -math.e * sum(COV_ADV) / 4)


# ---------------------------------------------------------------------- generic loss properties
@pytest.mark.parametrize("name", ["ppo", "gspo", "clip_cov", "kl_cov"])
def test_policy_loss_padding_changes_nothing_and_no_grad_leaks(name):
    g = torch.Generator().manual_seed(3)
    lp = torch.randn(3, 4, generator=g, dtype=D)
    old = lp + 0.2 * torch.randn(3, 4, generator=g, dtype=D)
    roll = old + 0.1 * torch.randn(3, 4, generator=g, dtype=D)
    adv = torch.randn(3, 4, generator=g, dtype=D)
    mask = t([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]])
    cfg = PolicyLossConfig(rollout_correction=RolloutCorrection.from_tis_cap(2.0), dual_clip_c=3.0)
    x = lp.clone().requires_grad_()
    base, mb = get_policy_loss(name)(x, old, adv, mask, cfg, rollout_logprobs=roll,
                                     generator=torch.Generator().manual_seed(0))
    base.backward()
    # now garbage in every padded slot plus two extra padded columns
    def widen(a, fill):
        a = a.clone()
        a[~mask.bool()] = fill
        return torch.cat([a, torch.full((3, 2), fill, dtype=D)], 1)
    mask_w = torch.cat([mask, torch.zeros(3, 2, dtype=D)], 1)
    y = widen(lp, NAN).requires_grad_()
    out, mo = get_policy_loss(name)(y, widen(old, 1e30), widen(adv, NAN), mask_w, cfg,
                                    rollout_logprobs=widen(roll, -1e30),
                                    generator=torch.Generator().manual_seed(0))
    out.backward()
    # token-mean (default) does not depend on T; every metric identical
    close(out, base)
    for k in mb:
        close(mo[k], mb[k])
    close(y.grad[:, :4], x.grad)
    assert (y.grad[:, 4:] == 0).all() and (y.grad[~mask_w.bool()] == 0).all()
    assert torch.isfinite(y.grad).all()


@pytest.mark.parametrize("name", ["ppo", "gspo", "clip_cov", "kl_cov"])
def test_policy_loss_gradient_only_into_logprobs(name):
    lp = torch.randn(2, 3, dtype=D).requires_grad_()
    old = (lp.detach() + 0.1).requires_grad_()
    adv = torch.randn(2, 3, dtype=D).requires_grad_()
    loss, metrics = get_policy_loss(name)(lp, old, adv, torch.ones(2, 3, dtype=D))
    loss.backward()
    assert lp.grad is not None and old.grad is None and adv.grad is None
    assert {"clip_frac", "approx_kl", "ratio_mean", "ratio_max"} <= set(metrics)


# ------------------------------------------------------------------------------ value loss
def test_value_loss_hand_example():
    # t0: v=1.0, old=0.8, R=1.5: v_clip = v (|v-old| = 0.2 <= 0.2); l = 0.25
    # t1: v=2.0, old=1.0, R=1.0: v_clip = 1.2, l1 = 1, l2 = 0.04 -> 1 (unclipped term larger)
    # t2: v=0.5, old=0.5, R=2.0: l = 2.25
    # t3: v=0.0, old=1.0, R=0.0: v_clip = 0.8, l1 = 0, l2 = 0.64 -> 0.64 (clipped, no gradient)
    v = t([[1.0, 2.0, 0.5], [0.0, NAN, NAN]]).requires_grad_()
    old = t([[0.8, 1.0, 0.5], [1.0, 0.0, 0.0]])
    ret = t([[1.5, 1.0, 2.0], [0.0, NAN, 0.0]])
    loss, m = value_loss(v, old, ret, MASK, clip_range=0.2, agg_mode="token-mean")
    close(loss, 0.5 * (0.25 + 1 + 2.25 + 0.64) / 4)  # 0.5175
    close(m["vf_clip_frac"], 0.25)
    loss.backward()
    # 0.5 * 1/4 * 2 (v - R) on unclipped tokens
    close(v.grad, [[-0.125, 0.25, -0.375], [0.0, 0.0, 0.0]])
    loss, _ = value_loss(v, old, ret, MASK, clip_range=None)
    close(loss, 0.5 * (0.25 + 1 + 2.25 + 0) / 4)  # 0.4375


def test_value_loss_no_grad_into_targets():
    v = torch.randn(2, 3, dtype=D).requires_grad_()
    old = torch.randn(2, 3, dtype=D).requires_grad_()
    ret = torch.randn(2, 3, dtype=D).requires_grad_()
    loss, _ = value_loss(v, old, ret, torch.ones(2, 3, dtype=D), 0.2, "seq-mean-token-mean")
    loss.backward()
    assert v.grad is not None and old.grad is None and ret.grad is None


def test_entropy_bonus_aggregates_like_a_loss():
    close(entropy_bonus(LOSS, MASK, "token-mean"), 2.5)
    close(entropy_bonus(LOSS, MASK, "seq-mean-token-mean"), 3.0)


def test_masked_max_min_equal_boolean_indexing_and_read_nothing_on_the_host():
    from torch.profiler import ProfilerActivity, profile

    from megarl.algos.metrics import masked_max, masked_min

    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 9, generator=g) * 5
    cases = [torch.rand(4, 9, generator=g) > 0.6, torch.zeros(4, 9, dtype=torch.bool), torch.ones(4, 9)]
    for m in cases:
        mb = m.bool()
        want_max = x[mb].max() if mb.any() else torch.tensor(0.0)
        want_min = x[mb].min() if mb.any() else torch.tensor(0.0)
        assert torch.equal(masked_max(x, m), want_max) and torch.equal(masked_min(x, m), want_min)
    # a selected -inf / nan is the answer, as with boolean indexing
    y = x.clone()
    y[0, 0], y[1, 1] = float("-inf"), float("nan")
    only = torch.zeros(4, 9, dtype=torch.bool)
    only[0, 0] = True
    assert masked_max(y, only).item() == float("-inf")
    only[1, 1] = True
    assert masked_min(y, only).isnan()
    assert masked_max(torch.empty(0), torch.empty(0, dtype=torch.bool)).item() == 0.0
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        masked_max(x, cases[0]), masked_min(x, cases[0])
    reads = [e.key for e in prof.key_averages() if e.key in ("aten::_local_scalar_dense", "aten::nonzero")]
    assert not reads, reads


def test_masked_means_equal_separate_masked_means_in_fewer_ops():
    from megarl.algos.masked import masked_mean, masked_means
    from megarl.profiling import OpCounter

    g = torch.Generator().manual_seed(4)
    mask = (torch.rand(5, 7, generator=g) > 0.4).float()
    mask[3] = 0.0                                   # a row with no valid token
    a = torch.randn(5, 7, generator=g)
    a[~mask.bool()] = float("nan")                  # padding may hold anything
    values = {"a": a, "b": torch.randn(5, 7, generator=g) > 0, "c": torch.randn(5, 7, generator=g).double()}
    means = masked_means(values, mask)
    for k, v in values.items():
        want = masked_mean(v.to(torch.float64), mask)
        assert torch.allclose(means[k].double(), want, rtol=1e-6, atol=0), k
    assert masked_means({"z": a}, torch.zeros(5, 7))["z"].item() == 0.0  # nothing selected: 0, not nan
    assert masked_means({}, mask) == {}
    with OpCounter() as together:
        masked_means(values, mask)
    with OpCounter() as apart:
        for v in values.values():
            masked_mean(v.to(torch.float64), mask)
    assert together.total < apart.total, (together.ops, apart.ops)
