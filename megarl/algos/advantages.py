"""Advantage estimators: turn rewards (and optionally a critic's values) into per-token advantages.

Every estimator has the same signature, so the trainer calls ``get_advantage_estimator(name)(...)``
without knowing which one it holds::

    fn(rewards, mask, *, group_size=None, group_ids=None, values=None, gamma=1.0, lam=1.0,
       kl=None, norm_std=True, eps=1e-6, baseline_rewards=None, valid=None) -> AdvantageOutput(advantages, returns)

* ``rewards``: ``[batch]`` sequence rewards (outcome reward, credited to the last valid token), or
  ``[batch, T]`` token-level rewards (e.g. process rewards) - the outcome estimators then use the
  masked sum over tokens as the sequence score.
* ``mask``: ``[batch, T]`` response mask (right-padded; holes, e.g. masked tool outputs, are skipped
  by the token recursions: a masked position passes returns/values through unchanged).
* ``kl``: ``[batch, T]`` per-token KL penalty *already multiplied by its coefficient* (see
  :func:`megarl.algos.kl.kl_reward_penalty`); it is subtracted from the token rewards. Estimators
  that work on sequence scores subtract its masked sum from the score.
* ``valid``: ``[batch]`` bool, the samples that have a reward (a failed one's reward may be ``nan``).
  The others get advantage and return 0 and enter no statistic: group estimators compute each
  group's mean and std over its valid samples, and a group with fewer than 2 valid samples gets
  advantage 0 throughout; batch estimators whiten over the valid samples' tokens. ``None``: all.
* ``advantages`` and ``returns`` are ``[batch, T]``, zero on padding, and carry no gradient.
  ``returns`` are the critic's regression targets for ``gae``; for critic-free estimators they are
  the (unnormalised) returns or, for group estimators, equal to the advantages.

``norm_std`` means "divide by a standard deviation" in each estimator's own sense: the group std for
``grpo``; batch whitening (mean and std over all valid tokens) for ``gae``; the std part of the
global normalisation for ``reinforce_plus_plus(_baseline)`` (they always centre). ``dr_grpo``,
``rloo`` and ``remax`` ignore it (their papers do not normalise). Standard deviations are the
unbiased (Bessel) ones, as ``torch.std``, verl and OpenRLHF use.

Normalisations over "the batch" use exactly the tensors passed in: call with the whole rollout batch
(not a data-parallel shard) to get the global statistics the papers describe.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor

from .masked import as_bool_mask, group_index, group_stats, masked_whiten, sanitize
from .registry import register_advantage_estimator


class AdvantageOutput(NamedTuple):
    """``(advantages, returns)``, both ``[batch, T]``, zero on padding, without gradient."""

    advantages: Tensor
    returns: Tensor


# --------------------------------------------------------------------------------------------
# building blocks
# --------------------------------------------------------------------------------------------
def _as_float(x: Tensor) -> Tensor:
    x = x.detach()
    return x if x.is_floating_point() else x.to(torch.get_default_dtype())


def last_token_index(mask: Tensor) -> Tensor:
    """Index of the last valid token of each row (``-1`` for a row without one)."""
    m = as_bool_mask(mask)
    pos = torch.arange(m.shape[-1], device=m.device).expand_as(m)
    return torch.where(m, pos, torch.full_like(pos, -1)).max(dim=-1).values


def token_level_rewards(rewards: Tensor, mask: Tensor, kl: Optional[Tensor] = None) -> Tensor:
    """``[batch, T]`` rewards: a ``[batch]`` outcome reward goes on the last valid token, then the
    per-token KL penalty is subtracted (Ziegler et al. 2019; Ouyang et al. 2022). Padding is 0."""
    m = as_bool_mask(mask)
    rewards = _as_float(rewards)
    if rewards.dim() == 2:
        out = sanitize(rewards.detach(), m).clone()
    elif rewards.dim() == 1:
        out = torch.zeros(m.shape, dtype=rewards.dtype, device=rewards.device)
        last = last_token_index(m)
        rows = torch.nonzero(last >= 0).squeeze(-1)
        out[rows, last[rows]] = rewards.detach()[rows]
    else:
        raise ValueError("rewards must be [batch] or [batch, T]")
    if kl is not None:
        out = out - sanitize(kl.detach().to(out.dtype), m)
    return sanitize(out, m)


def sequence_scores(rewards: Tensor, mask: Tensor, kl: Optional[Tensor] = None) -> Tensor:
    """``[batch]`` score of each sequence: the reward (summed if token-level) minus the summed KL."""
    m = as_bool_mask(mask)
    rewards = _as_float(rewards)
    s = rewards if rewards.dim() == 1 else sanitize(rewards, m).sum(-1)
    if kl is not None:
        s = s - sanitize(kl.detach().to(s.dtype), m).sum(-1)
    return s


def discounted_returns(token_rewards: Tensor, mask: Tensor, gamma: float = 1.0) -> Tensor:
    """``G_t = sum_{s >= t, valid} gamma^(k(s)-k(t)) r_s`` over valid tokens (Sutton & Barto),
    where ``k`` counts valid tokens (masked positions are skipped, not discounted). Padding is 0."""
    m = as_bool_mask(mask)
    r = sanitize(token_rewards, m)
    out = torch.zeros_like(r)
    running = torch.zeros_like(r[:, 0])
    for t in range(r.shape[-1] - 1, -1, -1):
        running = torch.where(m[:, t], r[:, t] + gamma * running, running)
        out[:, t] = running
    return sanitize(out, m)


def _broadcast(seq_adv: Tensor, mask: Tensor) -> Tensor:
    m = as_bool_mask(mask)
    return sanitize(seq_adv.unsqueeze(-1).expand(m.shape).to(seq_adv.dtype), m)


def _group_mean_std(scores: Tensor, group_size, group_ids,
                    valid: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    idx, n = group_index(scores.shape[0], group_size, group_ids, device=scores.device)
    return group_stats(scores, idx, n, valid)


def _valid_rows(valid: Optional[Tensor], rewards: Tensor) -> Optional[Tensor]:
    """``valid`` as a ``[batch]`` bool tensor on the rewards' device (None: every sample)."""
    if valid is None:
        return None
    v = valid.detach().to(device=rewards.device, dtype=torch.bool)
    if v.shape != rewards.shape[:1]:
        raise ValueError(f"valid must have shape [{rewards.shape[0]}], got {tuple(v.shape)}")
    return v


def _drop_invalid(rewards: Tensor, mask: Tensor, valid: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """Rewards with the invalid samples' entries (possibly ``nan``) set to 0, and the mask without
    their rows: what the token-level estimators compute on."""
    r = _as_float(rewards)
    if valid is None:
        return r, mask
    keep = valid if r.dim() == 1 else valid.unsqueeze(-1)
    return torch.where(keep, r, torch.zeros_like(r)), as_bool_mask(mask) & valid.unsqueeze(-1)


def _grouped_only(adv: Tensor, valid: Optional[Tensor], count: Tensor) -> Tensor:
    """A group estimator's ``[batch]`` advantage where it is defined: valid samples of groups with
    at least 2 valid samples (one sample has nothing to be compared with); 0 elsewhere."""
    if valid is None:
        return adv
    return torch.where(valid & (count >= 2), adv, torch.zeros_like(adv))


# --------------------------------------------------------------------------------------------
# estimators
# --------------------------------------------------------------------------------------------
@register_advantage_estimator("gae")
@torch.no_grad()
def gae_advantages(rewards: Tensor, mask: Tensor, *, group_size: Optional[int] = None,
                   group_ids: Optional[Tensor] = None, values: Optional[Tensor] = None,
                   gamma: float = 1.0, lam: float = 1.0, kl: Optional[Tensor] = None,
                   norm_std: bool = True, eps: float = 1e-6,
                   baseline_rewards: Optional[Tensor] = None,
                   valid: Optional[Tensor] = None) -> AdvantageOutput:
    """Generalized Advantage Estimation (Schulman et al. 2015, "High-Dimensional Continuous Control
    Using Generalized Advantage Estimation"), the PPO advantage (Schulman et al. 2017).

    ``delta_t = r_t + gamma V_{t+1} - V_t``; ``A_t = delta_t + gamma lam A_{t+1}``, with ``V`` = 0
    after the last valid token (the episode ends with the response). ``returns = A + V`` (before
    normalisation) are the critic targets. ``lam=1`` gives Monte-Carlo ``G_t - V_t``; ``lam=0``
    gives TD(0). With ``norm_std`` the advantages are whitened over all valid tokens of the batch
    (as in verl/OpenRLHF PPO). Requires ``values`` ``[batch, T]`` (the critic's ``V(s_t)``, the
    state before token ``t``).
    """
    if values is None:
        raise ValueError("gae needs values=[batch, T] from a critic")
    rewards, mask = _drop_invalid(rewards, mask, _valid_rows(valid, rewards))
    m = as_bool_mask(mask)
    r = token_level_rewards(rewards, m, kl)
    v = sanitize(values.detach().to(r.dtype), m)
    adv = torch.zeros_like(r)
    next_value = torch.zeros_like(r[:, 0])
    last_gae = torch.zeros_like(r[:, 0])
    for t in range(r.shape[-1] - 1, -1, -1):
        valid = m[:, t]
        delta = r[:, t] + gamma * next_value - v[:, t]
        gae_t = delta + gamma * lam * last_gae
        # masked positions pass the running quantities through unchanged
        next_value = torch.where(valid, v[:, t], next_value)
        last_gae = torch.where(valid, gae_t, last_gae)
        adv[:, t] = torch.where(valid, gae_t, torch.zeros_like(gae_t))
    returns = sanitize(adv + v, m)
    if norm_std:
        adv = masked_whiten(adv, m, eps=eps)
    return AdvantageOutput(sanitize(adv, m), returns)


@register_advantage_estimator("grpo")
@torch.no_grad()
def grpo_advantages(rewards: Tensor, mask: Tensor, *, group_size: Optional[int] = None,
                    group_ids: Optional[Tensor] = None, values: Optional[Tensor] = None,
                    gamma: float = 1.0, lam: float = 1.0, kl: Optional[Tensor] = None,
                    norm_std: bool = True, eps: float = 1e-6,
                    baseline_rewards: Optional[Tensor] = None,
                    valid: Optional[Tensor] = None) -> AdvantageOutput:
    """GRPO outcome advantage (Shao et al. 2024, "DeepSeekMath", sec. 4.1.2):
    ``A_i = (r_i - mean(r_group)) / (std(r_group) + eps)`` on every token of response ``i``.

    ``norm_std=False`` keeps only the centring. A group of one sample gets advantage 0.
    """
    v = _valid_rows(valid, rewards)
    s = sequence_scores(_drop_invalid(rewards, mask, v)[0], mask, kl)
    mean, std, count = _group_mean_std(s, group_size, group_ids, v)
    adv = s - mean
    if norm_std:
        adv = adv / (std + eps)
    adv = _broadcast(_grouped_only(adv, v, count), mask)
    return AdvantageOutput(adv, adv.clone())


@register_advantage_estimator("dr_grpo")
@torch.no_grad()
def dr_grpo_advantages(rewards: Tensor, mask: Tensor, *, group_size: Optional[int] = None,
                       group_ids: Optional[Tensor] = None, values: Optional[Tensor] = None,
                       gamma: float = 1.0, lam: float = 1.0, kl: Optional[Tensor] = None,
                       norm_std: bool = True, eps: float = 1e-6,
                       baseline_rewards: Optional[Tensor] = None,
                       valid: Optional[Tensor] = None) -> AdvantageOutput:
    """Dr.GRPO advantage (Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical
    Perspective", sec. 3.2): ``A_i = r_i - mean(r_group)``, no std division (it biases towards
    questions of too low/high difficulty). ``norm_std`` is ignored. Pair it with the
    ``seq-mean-token-sum-norm`` aggregation, which removes GRPO's length normalisation.
    """
    v = _valid_rows(valid, rewards)
    s = sequence_scores(_drop_invalid(rewards, mask, v)[0], mask, kl)
    mean, _, count = _group_mean_std(s, group_size, group_ids, v)
    adv = _broadcast(_grouped_only(s - mean, v, count), mask)
    return AdvantageOutput(adv, adv.clone())


@register_advantage_estimator("rloo")
@torch.no_grad()
def rloo_advantages(rewards: Tensor, mask: Tensor, *, group_size: Optional[int] = None,
                    group_ids: Optional[Tensor] = None, values: Optional[Tensor] = None,
                    gamma: float = 1.0, lam: float = 1.0, kl: Optional[Tensor] = None,
                    norm_std: bool = True, eps: float = 1e-6,
                    baseline_rewards: Optional[Tensor] = None,
                    valid: Optional[Tensor] = None) -> AdvantageOutput:
    """REINFORCE Leave-One-Out (Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style
    Optimization for Learning from Human Feedback in LLMs"; Kool et al. 2019):
    ``A_i = r_i - 1/(n-1) sum_{j != i} r_j = n/(n-1) (r_i - mean(r_group))``.

    Every group needs at least 2 samples. ``norm_std`` is ignored.
    """
    v = _valid_rows(valid, rewards)
    s = sequence_scores(_drop_invalid(rewards, mask, v)[0], mask, kl)
    if bool((_group_mean_std(s, group_size, group_ids)[2] < 2).any()):
        raise ValueError("rloo needs at least 2 samples per group")
    mean, _, count = _group_mean_std(s, group_size, group_ids, v)
    baseline = (mean * count - s) / (count - 1).clamp(min=1)
    adv = _broadcast(_grouped_only(s - baseline, v, count), mask)
    return AdvantageOutput(adv, adv.clone())


@register_advantage_estimator("reinforce_plus_plus", "reinforce++")
@torch.no_grad()
def reinforce_plus_plus_advantages(rewards: Tensor, mask: Tensor, *,
                                   group_size: Optional[int] = None,
                                   group_ids: Optional[Tensor] = None,
                                   values: Optional[Tensor] = None, gamma: float = 1.0,
                                   lam: float = 1.0, kl: Optional[Tensor] = None,
                                   norm_std: bool = True, eps: float = 1e-6,
                                   baseline_rewards: Optional[Tensor] = None,
                                   valid: Optional[Tensor] = None) -> AdvantageOutput:
    """REINFORCE++ (Hu 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning Large
    Language Models"): token rewards ``r_t = -kl_t + [t = last] R`` (KL in the reward),
    ``G_t = sum_{s>=t} gamma^(s-t) r_s``, then *global batch* normalisation
    ``A = (G - mean_batch(G)) / (std_batch(G) + eps)`` over all valid tokens. No groups, no critic.
    ``returns`` are the raw ``G_t``.
    """
    rewards, mask = _drop_invalid(rewards, mask, _valid_rows(valid, rewards))
    m = as_bool_mask(mask)
    g = discounted_returns(token_level_rewards(rewards, m, kl), m, gamma)
    adv = masked_whiten(g, m, eps=eps, divide_std=norm_std)
    return AdvantageOutput(adv, g)


@register_advantage_estimator("reinforce_plus_plus_baseline", "reinforce++_baseline")
@torch.no_grad()
def reinforce_plus_plus_baseline_advantages(rewards: Tensor, mask: Tensor, *,
                                            group_size: Optional[int] = None,
                                            group_ids: Optional[Tensor] = None,
                                            values: Optional[Tensor] = None, gamma: float = 1.0,
                                            lam: float = 1.0, kl: Optional[Tensor] = None,
                                            norm_std: bool = True, eps: float = 1e-6,
                                            baseline_rewards: Optional[Tensor] = None,
                                            valid: Optional[Tensor] = None) -> AdvantageOutput:
    """REINFORCE++-baseline (Hu 2025, "REINFORCE++", sec. on group baselines; OpenRLHF
    ``reinforce_baseline``): subtract the group mean of the outcome rewards first
    (``R_i - mean(R_group)``, no std, so it is robust to reward scale), then proceed as
    :func:`reinforce_plus_plus_advantages` (token KL penalty, returns, global batch normalisation).
    """
    if rewards.dim() != 1:
        raise ValueError("reinforce_plus_plus_baseline needs [batch] sequence rewards")
    v = _valid_rows(valid, rewards)
    r, mask = _drop_invalid(rewards, mask, v)
    m = as_bool_mask(mask)
    mean, _, _ = _group_mean_std(r, group_size, group_ids, v)
    g = discounted_returns(token_level_rewards(r - mean, m, kl), m, gamma)
    adv = masked_whiten(g, m, eps=eps, divide_std=norm_std)
    return AdvantageOutput(adv, g)


@register_advantage_estimator("remax")
@torch.no_grad()
def remax_advantages(rewards: Tensor, mask: Tensor, *, group_size: Optional[int] = None,
                     group_ids: Optional[Tensor] = None, values: Optional[Tensor] = None,
                     gamma: float = 1.0, lam: float = 1.0, kl: Optional[Tensor] = None,
                     norm_std: bool = True, eps: float = 1e-6,
                     baseline_rewards: Optional[Tensor] = None,
                     valid: Optional[Tensor] = None) -> AdvantageOutput:
    """ReMax (Li et al. 2023, "ReMax: A Simple, Effective, and Efficient Reinforcement Learning
    Method for Aligning Large Language Models"): REINFORCE with the reward of the *greedy* response
    to the same prompt as baseline: ``A_t = G_t - R(greedy)``, ``G_t`` the (KL-penalised) return.

    ``baseline_rewards`` ``[batch]`` is the greedy reward for each sample's prompt (the trainer
    generates one greedy response per prompt). ``returns`` are ``G_t``. ``norm_std`` is ignored.
    """
    if baseline_rewards is None:
        raise ValueError("remax needs baseline_rewards=[batch] (reward of the greedy response)")
    baseline = baseline_rewards.detach()
    # a greedy response without a reward (nan) gives its prompt's samples no baseline: not valid
    finite = torch.isfinite(baseline).to(rewards.device)
    rewards, mask = _drop_invalid(rewards, mask, finite if valid is None else _valid_rows(valid, rewards) & finite)
    m = as_bool_mask(mask)
    g = discounted_returns(token_level_rewards(rewards, m, kl), m, gamma)
    adv = sanitize(g - torch.nan_to_num(baseline.to(g.dtype), nan=0.0).unsqueeze(-1), m)
    return AdvantageOutput(adv, g)


def compute_advantages(name: str, rewards: Tensor, mask: Tensor, **kwargs) -> AdvantageOutput:
    """Convenience: look ``name`` up in the registry and call it."""
    from .registry import get_advantage_estimator

    return get_advantage_estimator(name)(rewards, mask, **kwargs)
