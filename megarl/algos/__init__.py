"""megarl.algos - RL algorithms for LLM post-training as pure functions over padded tensors.

Only ``torch`` and the standard library are imported here (no megatron, ray or HTTP), so every
function can be unit-tested on CPU and reused by any trainer.

Tensor conventions
------------------
* token tensors ``[batch, T]``: response tokens only, right-padded; ``mask`` (float or bool) of the
  same shape marks real tokens. Padded positions may hold garbage (even ``nan``): they never change
  a result and always get zero gradient.
* sequence tensors ``[batch]``.
* groups (samples of one prompt): contiguous blocks of ``group_size: int`` (``batch % group_size ==
  0``), or ``group_ids: LongTensor[batch]`` (any labels; groups may differ in size).

Registries (pick by name from the config; add your own with the decorators)
--------------------------------------------------------------------------
``get_advantage_estimator(name)`` / ``@register_advantage_estimator(name, *aliases)``
    ``gae``, ``grpo``, ``dr_grpo``, ``rloo``, ``reinforce_plus_plus`` (``reinforce++``),
    ``reinforce_plus_plus_baseline`` (``reinforce++_baseline``), ``remax``. Uniform signature::

        fn(rewards: Tensor[batch] | Tensor[batch, T], mask: Tensor[batch, T], *,
           group_size: int | None = None, group_ids: LongTensor[batch] | None = None,
           values: Tensor[batch, T] | None = None,        # critic V(s_t), gae only
           gamma: float = 1.0, lam: float = 1.0,
           kl: Tensor[batch, T] | None = None,           # per-token penalty, coef already applied
           norm_std: bool = True, eps: float = 1e-6,
           baseline_rewards: Tensor[batch] | None = None, # remax: greedy-response reward
        ) -> AdvantageOutput(advantages: Tensor[batch, T], returns: Tensor[batch, T])

    See :mod:`megarl.algos.advantages` for what ``norm_std`` means per estimator.

``get_policy_loss(name)`` / ``@register_policy_loss``
    ``ppo`` (``vanilla``), ``gspo``, ``clip_cov``, ``kl_cov``. Signature::

        fn(logprobs, old_logprobs, advantages, mask, cfg: PolicyLossConfig = ..., *,
           rollout_logprobs=None, num_tokens=None, num_seqs=None, generator=None)
        -> (loss: 0-dim Tensor, metrics: dict[str, 0-dim Tensor])

    ``metrics`` always holds ``clip_frac``, ``approx_kl``, ``ratio_mean``, ``ratio_max`` (and more).
    ``rollout_logprobs`` adds the rollout/train mismatch metrics; ``cfg.rollout_correction``
    (``RolloutCorrection``) weights the loss by ``pi_old / pi_rollout``, truncated or masked.

``register_rollout_ratio_level``
    the levels of a ``RolloutCorrection``: ``token``, ``sequence``, ``geometric``;
    ``fn(log_rho, mask) -> Tensor`` (the log ratio each token is weighted by).

``get_distill_advantage(name)`` / ``@register_distill_advantage``
    ``reverse_kl``: ``fn(student_logprobs, teacher_logprobs, mask) -> Tensor[batch, T]``, each
    sampled token's on-policy distillation advantage ``-(log pi_student - log pi_teacher)``;
    :func:`mix_advantages` adds it to a task advantage, :func:`distill_metrics` reports it.

``get_kl_estimator(name)`` / ``@register_kl_estimator``
    ``k1`` (``kl``), ``k2`` (``mse``), ``k3`` (``low_var_kl``), ``abs``:
    ``fn(logprobs, ref_logprobs) -> Tensor`` per token.

Other functions
---------------
``aggregate_loss(loss_mat, mask, mode, *, num_tokens=None, num_seqs=None, norm_len=None)`` with
modes ``token-mean``, ``seq-mean-token-sum``, ``seq-mean-token-mean``, ``seq-mean-token-sum-norm``;
``value_loss(values, old_values, returns, mask, clip_range, agg_mode)`` -> (loss, metrics);
``entropy_from_logits``, ``logprobs_from_logits``, ``entropy_bonus``;
``kl_penalty(logprobs, ref_logprobs, estimator)``, ``kl_reward_penalty``, ``kl_loss``,
``FixedKLController``, ``AdaptiveKLController``;
``filter_groups``, ``group_has_signal``, ``overlong_penalty``, ``length_penalty``,
``linear_length_penalty``; metric helpers in :mod:`megarl.algos.metrics`.

A typical GRPO/DAPO step::

    adv, _ = get_advantage_estimator("grpo")(rewards, mask, group_size=8)
    cfg = PolicyLossConfig(clip_low=0.2, clip_high=0.28, agg_mode="token-mean")
    pg, m = get_policy_loss("ppo")(logprobs, old_logprobs, adv, mask, cfg)
    loss = pg + kl_coef * kl_loss(logprobs, ref_logprobs, mask, "k3") \\
              - ent_coef * entropy_bonus(entropy, mask)
"""
from .advantages import (
    AdvantageOutput,
    compute_advantages,
    discounted_returns,
    dr_grpo_advantages,
    gae_advantages,
    grpo_advantages,
    reinforce_plus_plus_advantages,
    reinforce_plus_plus_baseline_advantages,
    remax_advantages,
    rloo_advantages,
    sequence_scores,
    token_level_rewards,
)
from .aggregation import AGG_MODES, aggregate_loss, check_agg_mode
from .distill import distill_metrics, mix_advantages, reverse_kl_advantages
from .entropy import entropy_bonus, entropy_from_logits, logprobs_from_logits
from .filters import (
    GroupFilter,
    filter_groups,
    group_has_signal,
    length_penalty,
    linear_length_penalty,
    overlong_penalty,
)
from .kl import (
    AdaptiveKLController,
    FixedKLController,
    kl_k1,
    kl_k2,
    kl_k3,
    kl_loss,
    kl_penalty,
    kl_reward_penalty,
    make_kl_controller,
)
from .loss_settings import LossSettings
from .masked import masked_mean, masked_means, masked_sum, masked_var, masked_whiten
from .metrics import (
    advantage_stats,
    approx_kl,
    clip_fraction,
    entropy_mean,
    logprob_mismatch,
    ratio_stats,
    response_length_stats,
    returns_stats,
    reward_stats,
)
from .policy_loss import (
    PolicyLossConfig,
    clip_cov_policy_loss,
    clipped_surrogate,
    compute_policy_loss,
    gspo_policy_loss,
    kl_cov_policy_loss,
    ppo_policy_loss,
)
from .registry import (
    get_advantage_estimator,
    get_distill_advantage,
    get_kl_estimator,
    get_policy_loss,
    register_advantage_estimator,
    register_distill_advantage,
    register_kl_estimator,
    register_policy_loss,
    register_rollout_ratio_level,
)
from .rollout_correction import RolloutCorrection, apply_rollout_correction, correction_weights
from .value import value_loss

import types as _types

__all__ = sorted(_n for _n, _v in list(globals().items())
                 if not _n.startswith("_") and not isinstance(_v, _types.ModuleType))
