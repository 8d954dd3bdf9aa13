"""Critic (value-function) loss for PPO with GAE."""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
from torch import Tensor

from .aggregation import aggregate_loss
from .masked import as_bool_mask, masked_mean, sanitize


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor,
               clip_range: Optional[float] = 0.2, agg_mode: str = "token-mean", *,
               num_tokens: Optional[float] = None, num_seqs: Optional[float] = None,
               norm_len: Optional[float] = None) -> Tuple[Tensor, Dict[str, Tensor]]:
    """Clipped value loss of PPO (Schulman et al. 2017; clipping as in OpenAI baselines ppo2 and
    Ziegler et al. 2019's lm-human-preferences):

    ``V_clip = V_old + clip(V - V_old, -c, c)``;
    ``loss_t = 0.5 * max((V - R)^2, (V_clip - R)^2)``, aggregated with ``agg_mode``.

    ``clip_range=None`` gives the plain ``0.5 (V - R)^2``. Gradient flows into ``values`` only;
    ``old_values`` and ``returns`` (from :func:`megarl.algos.advantages.gae_advantages`) are
    detached. Returns ``(loss, metrics)`` with ``vf_loss``, ``vf_clip_frac`` (tokens where the
    clipped term is the larger one), ``vpred_mean`` and ``vf_explained_var``
    (``1 - Var(R - V) / Var(R)``).
    """
    m = as_bool_mask(mask)
    v = sanitize(values, m)
    old = sanitize(old_values.detach().to(v.dtype), m)
    ret = sanitize(returns.detach().to(v.dtype), m)
    l1 = (v - ret) ** 2
    if clip_range is None:
        per_tok = l1
        clipped = torch.zeros_like(m)
    else:
        v_clip = old + (v - old).clamp(-clip_range, clip_range)
        l2 = (v_clip - ret) ** 2
        per_tok = torch.maximum(l1, l2)
        clipped = l2 > l1
    loss = 0.5 * aggregate_loss(per_tok, m, agg_mode, num_tokens=num_tokens, num_seqs=num_seqs,
                                norm_len=norm_len)
    with torch.no_grad():
        from .masked import masked_var

        resid_var = masked_var(ret - v.detach(), m)
        ret_var = masked_var(ret, m)
        metrics = {
            "vf_loss": loss.detach(),
            "vf_clip_frac": masked_mean(clipped.to(v.dtype), m),
            "vpred_mean": masked_mean(v.detach(), m),
            "vf_explained_var": 1.0 - resid_var / ret_var.clamp(min=1e-8),
        }
    return loss, metrics
