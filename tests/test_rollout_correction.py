"""Rollout/training mismatch correction: every level and mode against its definition on crafted
log-probs whose answer is known by hand (TIS, sequence truncation, geometric mean, MIS, IcePop,
pure rejection), the mismatch metrics, the legacy ``tis_cap`` and the defaults resolved for FP8 and
off-policy runs, validation one field per line, and a CPU run against an FP8 server where the
metrics flag the mismatch."""
from __future__ import annotations

import math

import pytest
import torch

from megarl.algos import LossSettings, PolicyLossConfig, RolloutCorrection, correction_weights, get_policy_loss
from tests.helpers.tensors import LN, NAN, D, close, t

unit = pytest.mark.unit


def _loss_and_grad(log_rho, mask, corr, adv=None, name="ppo"):
    """PPO loss at ratio pi/pi_old = 1 with rollout logprobs ``old - log_rho``: each token's loss is
    ``-A w`` (token-mean), so ``d loss / d logprob = -A w / N`` shows the weight of every token."""
    log_rho = t(log_rho)
    lp = torch.zeros_like(log_rho).requires_grad_()
    old = torch.zeros_like(log_rho)
    adv = torch.ones_like(log_rho) if adv is None else t(adv)
    loss, metrics = get_policy_loss(name)(lp, old, adv, t(mask), PolicyLossConfig(rollout_correction=corr),
                                          rollout_logprobs=old - log_rho)
    loss.backward()
    return loss, lp.grad, metrics


@unit
def test_token_truncation_is_tis():
    # rho = 3, 0.5, 1.5; TIS at 2: weights 2, 0.5, 1.5
    _, grad, m = _loss_and_grad([[LN(3), LN(0.5), LN(1.5)]], [[1, 1, 1]], RolloutCorrection.from_tis_cap(2.0))
    close(grad, [[-2 / 3, -0.5 / 3, -1.5 / 3]])
    close(m["rollout_is_truncated_frac"], 1 / 3)
    close(m["rollout_is_weight_mean"], 4 / 3)
    close(m["rollout_is_ratio_max"], 3.0)
    # a lower bound truncates from below too (slime's clamp)
    _, grad, m = _loss_and_grad([[LN(3), LN(0.05)]], [[1, 1]], RolloutCorrection(lower=0.1, upper=2.0))
    close(grad, [[-2 / 2, -0.1 / 2]])
    close(m["rollout_is_truncated_frac"], 1.0)


@unit
def test_sequence_truncation_weighs_every_token_of_a_sequence_alike():
    # sequence 0: rho 2 x 3 = 6 -> truncated to 4 on both tokens; sequence 1: 0.5 x 1 = 0.5 (kept)
    log_rho = [[LN(2), LN(3), NAN], [LN(0.5), 0.0, 0.0]]
    mask = [[1, 1, 0], [1, 1, 0]]
    _, grad, m = _loss_and_grad(log_rho, mask, RolloutCorrection(level="sequence", upper=4.0))
    close(grad, [[-4 / 4, -4 / 4, 0.0], [-0.5 / 4, -0.5 / 4, 0.0]])
    close(m["rollout_is_truncated_frac"], 0.5)          # the two tokens of sequence 0
    close(m["rollout_is_ratio_max"], 6.0)
    close(m["rollout_is_ratio_min"], 0.5)


@unit
def test_geometric_mean_ratio_of_exactly_two():
    # rho 2, 4, 1: product 8 over 3 tokens -> geometric mean exactly 2 on every token
    log_rho = [[LN(2), LN(4), 0.0, NAN]]
    mask = [[1, 1, 1, 0]]
    w, m = correction_weights(t(log_rho).nan_to_num(), t(mask), RolloutCorrection(level="geometric", upper=3.0))
    close(w, [[2.0, 2.0, 2.0, 0.0]])
    close(m["rollout_is_ratio_max"], 2.0)
    close(m["rollout_is_truncated_frac"], 0.0)
    _, grad, m = _loss_and_grad(log_rho, mask, RolloutCorrection(level="geometric", upper=1.5))
    close(grad, [[-0.5, -0.5, -0.5, 0.0]])              # truncated to 1.5, / 3 tokens
    close(m["rollout_is_truncated_frac"], 1.0)


@unit
def test_icepop_masks_tokens_outside_the_band_with_zero_gradient():
    # IcePop [0.5, 5]: rho 6 and 0.4 are outside (weight 0, no gradient), 2 and 1 keep their ratio
    corr = RolloutCorrection(level="token", mode="mask", lower=0.5, upper=5.0)
    _, grad, m = _loss_and_grad([[LN(6), LN(0.4), LN(2), 0.0]], [[1, 1, 1, 1]], corr, adv=[[1, -1, 1, 1]])
    assert grad[0, 0].item() == 0.0 and grad[0, 1].item() == 0.0
    close(grad, [[0.0, 0.0, -2 / 4, -1 / 4]])
    close(m["rollout_is_masked_frac"], 0.5)
    close(m["rollout_is_weight_mean"], 0.75)
    close(m["rollout_is_ess"], 0.75 ** 2 / ((4 + 1) / 4))


@unit
def test_sequence_mis_and_pure_rejection():
    # MIS (Liu, Li et al.): product ratio, kept with its weight below upper, else the whole sequence is 0
    log_rho = [[LN(3), 0.0], [LN(1.5), 0.0]]
    mask = [[1, 1], [1, 1]]
    _, grad, m = _loss_and_grad(log_rho, mask, RolloutCorrection(level="sequence", mode="mask", upper=2.0))
    close(grad, [[0.0, 0.0], [-1.5 / 4, -1.5 / 4]])
    close(m["rollout_is_masked_frac"], 0.5)
    # verl's geometric rejection: inside the band every token weighs 1
    corr = RolloutCorrection(level="geometric", mode="mask", lower=0.9, upper=1.6, reweight=False)
    _, grad, _ = _loss_and_grad(log_rho, mask, corr)       # geometric means sqrt(3) (out), sqrt(1.5) (in)
    close(grad, [[0.0, 0.0], [-1 / 4, -1 / 4]])


@unit
def test_mismatch_metrics_by_hand_and_without_a_correction():
    # rho = 2 and 0.5: KL k1 = mean(-log rho) = 0, k3 = mean(rho - 1 - log rho) = 0.25,
    # chi2 = mean(rho^2) - 1 = 1.125; weights 2, 0.5: ESS = 1.25^2 / 2.125
    loss, _, m = _loss_and_grad([[LN(2), LN(0.5), NAN]], [[1, 1, 0]], RolloutCorrection(upper=4.0))
    close(m["rollout_kl_k1"], 0.0)
    close(m["rollout_kl_k3"], 0.25)
    close(m["rollout_chi2"], 1.125)
    close(m["rollout_ratio_min"], 0.5)
    close(m["rollout_ratio_max"], 2.0)
    close(m["rollout_is_ess"], 1.25 ** 2 / 2.125)
    # KL(rollout || train) k1 is E_rollout[log pi_rollout - log pi_train]
    _, _, m = _loss_and_grad([[LN(0.5), LN(0.5)]], [[1, 1]], None)
    close(m["rollout_kl_k1"], math.log(2))
    assert "rollout_is_weight_mean" not in m                 # no correction: metrics of the mismatch only


@unit
@pytest.mark.parametrize("name", ["ppo", "gspo", "clip_cov", "kl_cov"])
def test_every_policy_loss_applies_the_weights(name):
    corr = RolloutCorrection(level="token", mode="mask", lower=0.5, upper=5.0)
    _, grad, m = _loss_and_grad([[LN(6), 0.0, LN(0.4)]], [[1, 1, 1]], corr, name=name)
    assert grad[0, 0].item() == 0.0 and grad[0, 2].item() == 0.0 and grad[0, 1].item() != 0.0
    close(m["rollout_is_masked_frac"], 2 / 3)


@unit
def test_settings_refuse_what_defines_nothing():
    for bad in (dict(lower=None, upper=None), dict(upper=0.0), dict(lower=2.0, upper=1.0), dict(level="tokens"),
                dict(mode="clip"), dict(reweight=False)):
        with pytest.raises(ValueError):
            RolloutCorrection(**bad)
    with pytest.raises(ValueError):                          # a correction needs the rollout's logprobs
        get_policy_loss("ppo")(t([[0.0]]), t([[0.0]]), t([[1.0]]), t([[1]]),
                               PolicyLossConfig(rollout_correction=RolloutCorrection()))


# ----------------------------------------------------------------------------- config
def _cfg(*overrides):
    from megarl.config import load_config
    from tests.helpers.runs import DEFAULT

    return load_config(DEFAULT, list(overrides))


@unit
def test_legacy_tis_cap_is_token_truncation_with_a_note():
    from megarl.config.served import resolve_rollout_correction

    cfg = _cfg("algorithm.tis_cap=2")
    note = resolve_rollout_correction(cfg, None)
    assert note == ("algorithm.tis_cap: 2 is read as algorithm.rollout_correction "
                    "{enabled: true, level: token, mode: truncate, upper: 2}")
    assert LossSettings.from_algorithm(cfg.algorithm, 32).policy.rollout_correction == RolloutCorrection.from_tis_cap(2)
    cfg = _cfg("algorithm.tis_cap=0")
    assert "{enabled: false}" in resolve_rollout_correction(cfg, None)
    assert LossSettings.from_algorithm(cfg.algorithm, 32).policy.rollout_correction is None


@unit
@pytest.mark.parametrize("overrides,fp8,on,said", [
    ((), True, True, "the servers serve block FP8"),
    (("rollout.mode=async", "placement.mode=disaggregated"), False, True, "rollout.mode = async"),
    ((), False, False, None),                                                  # sync, same numerics: off
    (("algorithm.rollout_correction.mode=mask", "algorithm.rollout_correction.lower=0.5",
      "algorithm.rollout_correction.upper=5"), False, True, "rollout_correction is set"),
    (("algorithm.rollout_correction.enabled=false",), True, False, None),      # the recipe's word wins
    (("algorithm.old_logprobs=rollout",), True, False, None),                  # nothing left to correct
])
def test_default_is_on_where_rollout_and_training_differ(overrides, fp8, on, said):
    from megarl.config.served import resolve_rollout_correction

    cfg = _cfg(*overrides)
    note = resolve_rollout_correction(cfg, "the servers serve block FP8 (/x)" if fp8 else None)
    assert cfg.algorithm.rollout_correction.enabled is on
    assert (note is None) == (said is None) and (said is None or said in note)
    corr = LossSettings.from_algorithm(cfg.algorithm, 32).policy.rollout_correction
    assert (corr is not None) == on
    if on and not said.endswith("is set"):                                      # the default: TIS at 2
        assert corr == RolloutCorrection(level="token", mode="truncate", lower=None, upper=2.0)


@unit
@pytest.mark.parametrize("overrides,field", [
    (["algorithm.rollout_correction.upper=0"], "algorithm.rollout_correction.upper"),
    (["algorithm.rollout_correction.lower=-1"], "algorithm.rollout_correction.lower"),
    (["algorithm.rollout_correction.upper=null"], "algorithm.rollout_correction.upper"),
    (["algorithm.rollout_correction.lower=3", "algorithm.rollout_correction.upper=2"],
     "algorithm.rollout_correction.lower"),
    (["algorithm.rollout_correction.reweight=false"], "algorithm.rollout_correction.reweight"),
    (["algorithm.rollout_correction.enabled=true", "algorithm.old_logprobs=rollout"],
     "algorithm.rollout_correction.enabled"),
    (["algorithm.tis_cap=2", "algorithm.rollout_correction.enabled=true"], "algorithm.tis_cap"),
])
def test_validation_names_the_field(overrides, field):
    from megarl.config.loader import ConfigError

    with pytest.raises(ConfigError) as err:
        _cfg(*overrides)
    assert len(err.value.problems) == 1 and err.value.problems[0].startswith(field + ":"), err.value.problems


# ----------------------------------------------------------------------------- a CPU run
@pytest.mark.e2e
def test_fp8_rollout_run_flags_the_mismatch(tmp_path):
    """Two GRPO steps against an embedded server serving a block-FP8 copy of the model, with a
    tight token mask (verl's geometric-rejection thresholds are of this order): the FP8 rounding
    shows as KL(rollout || train) > 0 and masked tokens, every step."""
    from megarl.checkpoint.fp8_convert import convert_hf_to_fp8
    from megarl.trainer import Trainer
    from tests.helpers.models import make_tiny_chat_model
    from tests.helpers.runs import tiny_run_config

    base = make_tiny_chat_model(tmp_path / "base", hidden=128, heads=4, kv_heads=2)
    fp8 = tmp_path / "fp8"
    convert_hf_to_fp8(str(base), str(fp8), "fp32", verbose=False)
    cfg = tiny_run_config(base, tmp_path / "run", f"rollout.model_path={fp8}", "trainer.total_steps=2",
                          "trainer.eval_before_after=false", "checkpoint.export_hf=false",
                          "algorithm.rollout_correction.mode=mask", "algorithm.rollout_correction.lower=0.995",
                          "algorithm.rollout_correction.upper=1.005")
    steps = Trainer(cfg).run()["steps"]
    assert cfg.algorithm.rollout_correction.enabled is True
    for s in steps:
        assert s["actor/rollout_kl_k3"] > 0 and s["actor/rollout_chi2"] != 0, s
        assert 0 < s["actor/rollout_is_masked_frac"] < 1, s
        assert s["actor/rollout_ratio_min"] < 1 < s["actor/rollout_ratio_max"], s


@pytest.mark.e2e
def test_stale_policy_run_flags_the_mismatch(tmp_path):
    """``one_step_off``: batch 1 was sampled by version 0 while the trainer already holds version 1
    (lr 1e-3 on the tiny model moves it), so KL(rollout || train) jumps from step 0's numerical
    noise (fp32 server and trainer agree to ~1e-6) and the truncation (on by default off-policy)
    touches tokens."""
    from megarl.trainer import Trainer
    from tests.helpers.runs import tiny_model, tiny_run_config

    cfg = tiny_run_config(tiny_model(tmp_path), tmp_path / "run", "rollout.mode=one_step_off",
                          "placement.mode=disaggregated", "trainer.total_steps=2",
                          "trainer.eval_before_after=false", "checkpoint.export_hf=false")
    steps = Trainer(cfg).run()["steps"]
    assert cfg.algorithm.rollout_correction.enabled is True   # the off-policy default
    fresh, stale = steps
    assert (fresh["offpolicy/staleness_max"], stale["offpolicy/staleness_max"]) == (0.0, 1.0)
    assert stale["actor/rollout_kl_k3"] > max(100 * fresh["actor/rollout_kl_k3"], 1e-6), (fresh, stale)
    assert stale["actor/rollout_ratio_max"] - stale["actor/rollout_ratio_min"] > \
        100 * (fresh["actor/rollout_ratio_max"] - fresh["actor/rollout_ratio_min"]), (fresh, stale)
