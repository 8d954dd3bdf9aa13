"""Policy-gradient losses: PPO clip (with clip-higher and dual-clip), GSPO, Clip-Cov, KL-Cov; each
applies the rollout/train mismatch correction of ``cfg.rollout_correction`` (``rollout_correction``).

Every loss has the signature::

    fn(logprobs, old_logprobs, advantages, mask, cfg=PolicyLossConfig(), *,
       rollout_logprobs=None, num_tokens=None, num_seqs=None, generator=None)
       -> (loss: 0-dim Tensor, metrics: dict[str, 0-dim Tensor])

* ``logprobs`` ``[batch, T]``: log pi_theta of the sampled tokens, *with* gradient.
* ``old_logprobs``: log pi_old from the trainer's forward before the update (behaviour policy as
  the trainer scores it); ``advantages``: from an estimator. Both are detached here.
* ``rollout_logprobs``: log-probs reported by the inference engine. If given, mismatch metrics are
  logged and, with ``cfg.rollout_correction``, its per-token weights are applied.
* ``num_tokens`` / ``num_seqs``: global denominators for micro-batching (see ``aggregation``).
* ``generator``: RNG for ``clip_cov``'s random token choice (reproducible tests).

``metrics`` always has ``clip_frac``, ``approx_kl``, ``ratio_mean``, ``ratio_max`` (floats as 0-dim
tensors, detached); losses add their own keys.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch
from torch import Tensor

from .aggregation import aggregate_loss, check_agg_mode
from .masked import as_bool_mask, masked_mean, masked_means, sanitize
from .metrics import masked_max, masked_min
from .registry import register_policy_loss
from .rollout_correction import RolloutCorrection, apply_rollout_correction

LossOutput = Tuple[Tensor, Dict[str, Tensor]]


@dataclass(frozen=True)
class PolicyLossConfig:
    """Hyper-parameters of the policy losses (one frozen object per run).

    Attributes:
        clip_low: PPO ``epsilon_low``: ratio is clipped below at ``1 - clip_low``.
        clip_high: PPO ``epsilon_high``: clipped above at ``1 + clip_high``. DAPO's clip-higher
            (Yu et al. 2025) uses ``clip_high=0.28 > clip_low=0.2`` to keep exploration alive.
            GSPO (Zheng et al. 2025) uses sequence-ratio ranges of order ``3e-4 / 4e-4``.
        dual_clip_c: dual-clip constant ``c > 1`` (Ye et al. 2020, "Mastering Complex Control in
            MOBA Games with Deep RL"): for ``A < 0`` the loss is capped at ``-c A`` so a huge ratio
            on a bad token cannot blow up the update. ``None`` disables it. Typical: 3.0.
        agg_mode: loss aggregation (``aggregation.AGG_MODES``).
        norm_len: constant ``L`` of ``seq-mean-token-sum-norm`` (max response length).
        rollout_correction: importance weights from the rollout's policy to ``pi_old``
            (``rollout_correction.RolloutCorrection``: token / sequence / geometric level,
            truncated or masked); ``None`` applies none. TIS at ``C`` (Yao et al. 2025) is
            ``RolloutCorrection.from_tis_cap(C)``.
        log_ratio_clamp: ``log(pi/pi_old)`` is clamped to ``[-c, c]`` before ``exp`` (overflow).
        clip_cov_ratio, clip_cov_lb, clip_cov_ub: Clip-Cov (Cui et al. 2025): fraction of tokens
            whose gradient is dropped, chosen among those with covariance in ``(lb, ub)``.
        kl_cov_ratio, kl_cov_coef: KL-Cov (Cui et al. 2025): fraction of top-covariance tokens that
            get the penalty ``kl_cov_coef * |log pi - log pi_old|``.
    """

    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip_c: Optional[float] = None
    agg_mode: str = "token-mean"
    norm_len: Optional[float] = None
    rollout_correction: Optional[RolloutCorrection] = None
    log_ratio_clamp: float = 20.0
    clip_cov_ratio: float = 2e-4
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 2e-4
    kl_cov_coef: float = 1.0

    def __post_init__(self) -> None:
        if not 0 <= self.clip_low < 1:
            raise ValueError(f"clip_low must be in [0, 1), got {self.clip_low}")
        if self.clip_high < 0:
            raise ValueError(f"clip_high must be >= 0, got {self.clip_high}")
        if self.dual_clip_c is not None and self.dual_clip_c <= 1:
            raise ValueError(f"dual_clip_c must be > 1, got {self.dual_clip_c}")
        if not 0 <= self.clip_cov_ratio <= 1 or not 0 <= self.kl_cov_ratio <= 1:
            raise ValueError("clip_cov_ratio and kl_cov_ratio must be in [0, 1]")
        if self.clip_cov_lb >= self.clip_cov_ub:
            raise ValueError("clip_cov_lb must be < clip_cov_ub")
        check_agg_mode(self.agg_mode)


# --------------------------------------------------------------------------------------------
# shared pieces
# --------------------------------------------------------------------------------------------
def _prepare(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor
             ) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    for name, t in (("old_logprobs", old_logprobs), ("advantages", advantages), ("mask", mask)):
        if t.shape != logprobs.shape:
            raise ValueError(f"{name} {tuple(t.shape)} != logprobs {tuple(logprobs.shape)}")
    m = as_bool_mask(mask)
    if logprobs.dtype in (torch.float16, torch.bfloat16):  # ratios/exp in fp32
        logprobs = logprobs.float()
    lp = sanitize(logprobs, m)
    old = sanitize(old_logprobs.detach().to(lp.dtype), m)
    adv = sanitize(advantages.detach().to(lp.dtype), m)
    return lp, old, adv, m


def clipped_surrogate(ratio: Tensor, adv: Tensor, cfg: PolicyLossConfig
                      ) -> Tuple[Tensor, Dict[str, Tensor]]:
    """Per-token PPO clipped loss (Schulman et al. 2017, eq. 7, negated to a loss):
    ``max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))`` and, with ``dual_clip_c``, for ``A < 0``
    ``min(that, -c A)`` (Ye et al. 2020). Returns the loss matrix and bool masks of the active
    clips (``clipped``, ``clipped_low``, ``clipped_high``, ``dual_clipped``)."""
    pg1 = -adv * ratio
    pg2 = -adv * ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    loss = torch.maximum(pg1, pg2)
    clipped = pg2 > pg1
    masks = {
        "clipped": clipped,
        "clipped_high": clipped & (adv > 0),
        "clipped_low": clipped & (adv < 0),
    }
    if cfg.dual_clip_c is not None:
        pg3 = -adv * cfg.dual_clip_c
        dual = (adv < 0) & (loss > pg3)
        loss = torch.where(adv < 0, torch.minimum(loss, pg3), loss)
        masks["dual_clipped"] = dual
    else:
        masks["dual_clipped"] = torch.zeros_like(clipped)
    return loss, masks


def _base_metrics(ratio: Tensor, lp: Tensor, old: Tensor, m: Tensor,
                  clip_masks: Dict[str, Tensor]) -> Dict[str, Tensor]:
    with torch.no_grad():
        ratio = ratio.detach()
        log_r = (lp.detach() - old)
        out = masked_means({   # the clip masks are bools: masked_means counts them as 0/1
            "clip_frac": clip_masks["clipped"],
            "clip_frac_high": clip_masks["clipped_high"],
            "clip_frac_low": clip_masks["clipped_low"],
            "dual_clip_frac": clip_masks["dual_clipped"],
            # KL(old || new) with samples from old (Schulman 2020): k1 and k3
            "approx_kl": -log_r,
            "approx_kl_k3": torch.exp(log_r.clamp(-20, 20)) - 1 - log_r,
            "ratio_mean": ratio,
        }, m)
        out["ratio_max"] = masked_max(ratio, m)
        out["ratio_min"] = masked_min(ratio, m)
        return out


def _finish(loss_mat: Tensor, m: Tensor, cfg: PolicyLossConfig, num_tokens, num_seqs,
            metrics: Dict[str, Tensor]) -> LossOutput:
    loss = aggregate_loss(loss_mat, m, cfg.agg_mode, num_tokens=num_tokens, num_seqs=num_seqs,
                          norm_len=cfg.norm_len)
    metrics["pg_loss"] = loss.detach()
    return loss, metrics


# --------------------------------------------------------------------------------------------
# losses
# --------------------------------------------------------------------------------------------
@register_policy_loss("ppo", "vanilla")
def ppo_policy_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
                    cfg: PolicyLossConfig = PolicyLossConfig(), *,
                    rollout_logprobs: Optional[Tensor] = None, num_tokens: Optional[float] = None,
                    num_seqs: Optional[float] = None,
                    generator: Optional[torch.Generator] = None) -> LossOutput:
    """PPO clipped surrogate (Schulman et al. 2017, "Proximal Policy Optimization Algorithms"),
    token-level ratio ``r_t = pi(y_t) / pi_old(y_t)``, with asymmetric clip range (DAPO clip-higher,
    Yu et al. 2025), optional dual-clip (Ye et al. 2020) and the optional rollout correction.
    This is also the GRPO / DAPO / Dr.GRPO / RLOO / REINFORCE++ policy loss; they differ in the
    advantages and ``cfg.agg_mode``. At ``r = 1`` its value is ``-aggregate(A)``.
    """
    lp, old, adv, m = _prepare(logprobs, old_logprobs, advantages, mask)
    log_r = (lp - old).clamp(-cfg.log_ratio_clamp, cfg.log_ratio_clamp)
    ratio = torch.exp(log_r)
    loss_mat, clip_masks = clipped_surrogate(ratio, adv, cfg)
    metrics = _base_metrics(ratio, lp, old, m, clip_masks)
    loss_mat = apply_rollout_correction(loss_mat, old, m, rollout_logprobs, cfg.rollout_correction, metrics)
    return _finish(loss_mat, m, cfg, num_tokens, num_seqs, metrics)


@register_policy_loss("gspo")
def gspo_policy_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
                     cfg: PolicyLossConfig = PolicyLossConfig(agg_mode="seq-mean-token-mean"), *,
                     rollout_logprobs: Optional[Tensor] = None,
                     num_tokens: Optional[float] = None, num_seqs: Optional[float] = None,
                     generator: Optional[torch.Generator] = None) -> LossOutput:
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization"): the importance ratio and the
    clipping are per *sequence*: ``s_i = (pi(y_i) / pi_old(y_i))^(1/|y_i|)
    = exp(mean_t (log pi - log pi_old))``.

    Implemented in the GSPO-token form (paper eq. 13): ``s_it = sg[s_i] * pi(y_it) / sg[pi(y_it)]``
    has the value ``s_i`` on every token and gradient ``s_i * grad log pi(y_it)``; with a
    sequence-level advantage and ``agg_mode="seq-mean-token-mean"`` (the paper's ``1/|y_i|``
    average, and this loss's default config) the gradient is exactly GSPO's. Clip ranges in the
    paper are much smaller than PPO's (``3e-4 / 4e-4``); ``clip_frac`` counts tokens of clipped
    sequences.
    """
    lp, old, adv, m = _prepare(logprobs, old_logprobs, advantages, mask)
    seq_log_ratio = masked_mean(lp - old, m, dim=-1)  # [batch], log s_i
    log_s = lp - lp.detach() + seq_log_ratio.detach().unsqueeze(-1)
    log_s = log_s.clamp(-cfg.log_ratio_clamp, cfg.log_ratio_clamp)
    ratio = torch.exp(log_s)
    loss_mat, clip_masks = clipped_surrogate(ratio, adv, cfg)
    metrics = _base_metrics(torch.exp(lp.detach() - old), lp, old, m, clip_masks)
    has_tok = m.any(-1)
    seq_ratio = torch.exp(seq_log_ratio.detach())
    metrics["seq_ratio_mean"] = masked_mean(seq_ratio, has_tok)
    metrics["seq_ratio_max"] = masked_max(seq_ratio, has_tok)
    loss_mat = apply_rollout_correction(loss_mat, old, m, rollout_logprobs, cfg.rollout_correction, metrics)
    return _finish(loss_mat, m, cfg, num_tokens, num_seqs, metrics)


def _token_covariance(lp: Tensor, adv: Tensor, m: Tensor) -> Tensor:
    """Centred per-token covariance term ``(A - mean A)(log pi - mean log pi)`` over valid tokens
    (Cui et al. 2025, eq. for Cov(log pi, A)), detached; padding is ``-inf``."""
    lp = lp.detach()
    cov = (adv - masked_mean(adv, m)) * (lp - masked_mean(lp, m))
    return torch.where(m, cov, torch.full_like(cov, float("-inf")))


@register_policy_loss("clip_cov")
def clip_cov_policy_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
                         cfg: PolicyLossConfig = PolicyLossConfig(), *,
                         rollout_logprobs: Optional[Tensor] = None,
                         num_tokens: Optional[float] = None, num_seqs: Optional[float] = None,
                         generator: Optional[torch.Generator] = None) -> LossOutput:
    """Clip-Cov (Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning
    Language Models", sec. 4): entropy collapse is driven by tokens with a large covariance
    between log-prob and advantage. Among valid tokens not already clipped by PPO and with
    covariance in ``(clip_cov_lb, clip_cov_ub)``, ``max(1, int(clip_cov_ratio * N_valid))`` are
    drawn at random and their gradient is removed (loss term set to 0); the rest is PPO-clip.
    ``metrics['cov_clip_frac']`` is the share of valid tokens so removed.
    """
    lp, old, adv, m = _prepare(logprobs, old_logprobs, advantages, mask)
    log_r = (lp - old).clamp(-cfg.log_ratio_clamp, cfg.log_ratio_clamp)
    ratio = torch.exp(log_r)
    loss_mat, clip_masks = clipped_surrogate(ratio, adv, cfg)
    metrics = _base_metrics(ratio, lp, old, m, clip_masks)

    cov = _token_covariance(lp, adv, m)
    cand = m & ~clip_masks["clipped"] & (cov > cfg.clip_cov_lb) & (cov < cfg.clip_cov_ub)
    cand_idx = torch.nonzero(cand)
    keep = torch.ones_like(loss_mat)
    n_valid = int(m.sum())
    if n_valid > 0 and cfg.clip_cov_ratio > 0 and len(cand_idx) > 0:
        n_clip = min(max(int(cfg.clip_cov_ratio * n_valid), 1), len(cand_idx))
        perm = torch.randperm(len(cand_idx), generator=generator)[:n_clip].to(cand_idx.device)
        chosen = cand_idx[perm]
        keep[chosen[:, 0], chosen[:, 1]] = 0.0
    metrics["cov_clip_frac"] = masked_mean((keep == 0).to(loss_mat.dtype), m)
    loss_mat = loss_mat * keep
    loss_mat = apply_rollout_correction(loss_mat, old, m, rollout_logprobs, cfg.rollout_correction, metrics)
    return _finish(loss_mat, m, cfg, num_tokens, num_seqs, metrics)


@register_policy_loss("kl_cov")
def kl_cov_policy_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
                       cfg: PolicyLossConfig = PolicyLossConfig(), *,
                       rollout_logprobs: Optional[Tensor] = None,
                       num_tokens: Optional[float] = None, num_seqs: Optional[float] = None,
                       generator: Optional[torch.Generator] = None) -> LossOutput:
    """KL-Cov (Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning
    Language Models", sec. 4): the unclipped policy-gradient loss ``-A r`` on every token, plus
    ``kl_cov_coef * |log pi - log pi_old|`` on the top ``max(1, int(kl_cov_ratio * N_valid))``
    valid tokens by covariance ``(A - mean A)(log pi - mean log pi)``. No ratio clipping (the
    paper's KL-Cov replaces it), so ``clip_frac`` is 0; ``kl_cov_frac`` is the penalised share.
    """
    lp, old, adv, m = _prepare(logprobs, old_logprobs, advantages, mask)
    log_r = (lp - old).clamp(-cfg.log_ratio_clamp, cfg.log_ratio_clamp)
    ratio = torch.exp(log_r)
    loss_mat = -adv * ratio
    none = torch.zeros_like(m)
    metrics = _base_metrics(ratio, lp, old, m, {"clipped": none, "clipped_high": none,
                                                 "clipped_low": none, "dual_clipped": none})
    n_valid = int(m.sum())
    penal = torch.zeros_like(m)
    if n_valid > 0 and cfg.kl_cov_ratio > 0:
        k = max(int(cfg.kl_cov_ratio * n_valid), 1)
        cov = _token_covariance(lp, adv, m).flatten()
        top = torch.topk(cov, k, largest=True).indices
        penal = penal.flatten().clone()
        penal[top] = True
        penal = penal.view_as(m) & m
    loss_mat = torch.where(penal, loss_mat + cfg.kl_cov_coef * (lp - old).abs(), loss_mat)
    metrics["kl_cov_frac"] = masked_mean(penal.to(loss_mat.dtype), m)
    loss_mat = apply_rollout_correction(loss_mat, old, m, rollout_logprobs, cfg.rollout_correction, metrics)
    return _finish(loss_mat, m, cfg, num_tokens, num_seqs, metrics)


def compute_policy_loss(name: str, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor,
                        mask: Tensor, cfg: Optional[PolicyLossConfig] = None, **kwargs
                        ) -> LossOutput:
    """Convenience: look ``name`` up in the registry and call it (``cfg`` default per loss)."""
    from .registry import get_policy_loss

    fn = get_policy_loss(name)
    if cfg is None:
        return fn(logprobs, old_logprobs, advantages, mask, **kwargs)
    return fn(logprobs, old_logprobs, advantages, mask, cfg, **kwargs)
