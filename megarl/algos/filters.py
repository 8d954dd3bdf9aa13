"""Sample filters and reward shaping: DAPO's group filter (dynamic sampling), overlong shaping,
length penalties."""
from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch
from torch import Tensor

from .masked import group_index


def _lengths(x: Tensor) -> Tensor:
    x = x.detach()
    return x if x.is_floating_point() else x.to(torch.get_default_dtype())


class GroupFilter(NamedTuple):
    group_keep: Tensor  # [num_groups] bool
    sample_keep: Tensor  # [batch] bool
    sample_index: Tensor  # [n_kept_samples] long, indices into the batch, in order


@torch.no_grad()
def filter_groups(rewards: Tensor, group_size: Optional[int] = None,
                  group_ids: Optional[Tensor] = None, *, atol: float = 0.0) -> GroupFilter:
    """DAPO dynamic sampling filter (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement
    Learning System at Scale", sec. 3.2): drop every group whose rewards are all equal (all right
    or all wrong) - their group-relative advantage is 0, so they add no gradient but shrink the
    effective batch. A group is kept iff ``max - min > atol`` of its rewards; a group of one
    sample is therefore dropped.

    ``rewards`` is any per-sample metric ``[batch]`` (DAPO uses accuracy or the final reward).
    Groups are contiguous blocks of ``group_size`` or given by ``group_ids`` (group index = rank
    of the label in sorted order).
    """
    r = rewards.detach()
    r = r if r.is_floating_point() else r.to(torch.get_default_dtype())
    idx, n = group_index(r.shape[0], group_size, group_ids, device=r.device)
    gmax = torch.full((n,), float("-inf"), dtype=r.dtype, device=r.device).scatter_reduce(
        0, idx, r, reduce="amax")
    gmin = torch.full((n,), float("inf"), dtype=r.dtype, device=r.device).scatter_reduce(
        0, idx, r, reduce="amin")
    group_keep = (gmax - gmin) > atol
    sample_keep = group_keep[idx]
    return GroupFilter(group_keep, sample_keep, torch.nonzero(sample_keep).squeeze(-1))


def group_has_signal(rewards: Sequence[float]) -> bool:
    """One group's verdict of :func:`filter_groups` (the rollout sources keep groups one at a time
    as they finish): True iff its rewards are not all equal."""
    return bool(filter_groups(torch.tensor(list(rewards), dtype=torch.float64), len(rewards)).group_keep[0])


@torch.no_grad()
def overlong_penalty(response_lengths: Tensor, max_len: int, buffer_len: int,
                     penalty_factor: float = 1.0) -> Tensor:
    """DAPO soft overlong punishment (Yu et al. 2025, sec. 3.4, eq. 13), ``[batch]``, to be *added*
    to the task reward::

        0                                    if L <= L_max - L_cache
        ((L_max - L_cache) - L) / L_cache    if L_max - L_cache < L <= L_max
        -1                                   if L > L_max

    times ``penalty_factor``; ``L_max = max_len``, ``L_cache = buffer_len`` (the last
    ``buffer_len`` tokens of the budget are the soft-penalty zone).
    """
    if not 0 < buffer_len <= max_len:
        raise ValueError("need 0 < buffer_len <= max_len")
    length = _lengths(response_lengths)
    expected = max_len - buffer_len
    soft = (expected - length) / buffer_len
    pen = torch.where(length <= expected, torch.zeros_like(length), soft)
    pen = torch.where(length > max_len, torch.full_like(length, -1.0), pen)
    return pen * penalty_factor


@torch.no_grad()
def length_penalty(response_lengths: Tensor, correct: Tensor, group_size: Optional[int] = None,
                   group_ids: Optional[Tensor] = None, coef: float = 1.0) -> Tensor:
    """Group length reward of Kimi k1.5 (Kimi Team 2025, "Kimi k1.5: Scaling Reinforcement Learning
    with LLMs", sec. 2.3.3), ``[batch]``, added to the reward with weight ``coef``:
    ``lambda_i = 0.5 - (len_i - min_len) / (max_len - min_len)`` within the group; a correct
    response gets ``lambda_i``, a wrong one ``min(0, lambda_i)``. Groups whose lengths are all
    equal get 0. Shorter correct answers are rewarded; long wrong ones are punished.
    """
    length = _lengths(response_lengths)
    idx, n = group_index(length.shape[0], group_size, group_ids, device=length.device)
    gmax = torch.full((n,), float("-inf"), dtype=length.dtype, device=length.device).scatter_reduce(
        0, idx, length, reduce="amax")[idx]
    gmin = torch.full((n,), float("inf"), dtype=length.dtype, device=length.device).scatter_reduce(
        0, idx, length, reduce="amin")[idx]
    span = gmax - gmin
    lam = torch.where(span > 0, 0.5 - (length - gmin) / span.clamp(min=1e-12),
                      torch.zeros_like(length))
    ok = correct.detach().bool().to(length.device)
    return coef * torch.where(ok, lam, lam.clamp(max=0.0))


@torch.no_grad()
def linear_length_penalty(response_lengths: Tensor, max_len: int, coef: float = 1.0) -> Tensor:
    """Simple length cost ``-coef * L / max_len`` ``[batch]`` (a common baseline shaping, e.g.
    the length-penalty ablations of Kimi k1.5 / O1-Pruner); bounded in ``[-coef, 0]`` for
    ``L <= max_len``."""
    length = _lengths(response_lengths)
    return -coef * length / max_len
