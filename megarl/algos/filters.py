"""Sample filters and reward shaping: DAPO dynamic sampling, overlong shaping, length penalties."""
from __future__ import annotations

from typing import Any, Dict, List, Mapping, NamedTuple, Optional

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


def _select(value: Any, index: Tensor) -> Any:
    if isinstance(value, Tensor):
        return value.index_select(0, index.to(value.device))
    if isinstance(value, (list, tuple)):
        return [value[i] for i in index.tolist()]
    raise TypeError(f"batch values must be tensors or lists, got {type(value).__name__}")


def _concat(parts: List[Any], pad_value: float) -> Any:
    if isinstance(parts[0], Tensor):
        if parts[0].dim() >= 2:  # right-pad token tensors of different rounds to one width
            width = max(p.shape[1] for p in parts)
            parts = [torch.nn.functional.pad(p, (0, 0) * (p.dim() - 2) + (0, width - p.shape[1]),
                                             value=pad_value) for p in parts]
        return torch.cat(parts, dim=0)
    out: List[Any] = []
    for p in parts:
        out.extend(p)
    return out


class DynamicSamplingBuffer:
    """Accumulates DAPO-kept groups across generation rounds until ``target_groups`` are collected
    (Yu et al. 2025, sec. 3.2: "keep sampling until the batch is fully filled").

    Pure bookkeeping over tensors/lists, no I/O. Usage::

        buf = DynamicSamplingBuffer(target_groups=32, group_size=8, max_rounds=10)
        while not buf.is_full:
            batch, rewards = generate_and_score()           # contiguous groups of 8
            buf.add(batch, rewards)
        batch = buf.pop()                                 # exactly 32 * 8 samples

    ``batch`` is a mapping of equal-length tensors (first dim = samples) or lists. Token tensors
    (``dim >= 2``) of different rounds are right-padded to the widest with ``pad_values[key]``
    (default 0). Extra groups beyond the target are dropped by :meth:`pop`, as in DAPO.
    ``max_rounds`` guards against a task where nearly every group is degenerate.
    """

    def __init__(self, target_groups: int, group_size: int, max_rounds: Optional[int] = None,
                 pad_values: Optional[Mapping[str, float]] = None) -> None:
        if target_groups <= 0 or group_size <= 0:
            raise ValueError("target_groups and group_size must be > 0")
        self.target_groups = target_groups
        self.group_size = group_size
        self.max_rounds = max_rounds
        self.pad_values = dict(pad_values or {})
        self._parts: Dict[str, List[Any]] = {}
        self.rounds = 0
        self.groups_seen = 0
        self.groups_kept = 0

    @property
    def is_full(self) -> bool:
        return self.groups_kept >= self.target_groups

    def add(self, batch: Mapping[str, Any], rewards: Tensor) -> int:
        """Filter one round's ``batch`` by ``rewards`` and keep its informative groups.
        Returns the number of groups kept from this round."""
        if self.max_rounds is not None and self.rounds >= self.max_rounds:
            raise RuntimeError(
                f"dynamic sampling: {self.max_rounds} rounds gave only {self.groups_kept}/"
                f"{self.target_groups} groups with non-identical rewards")
        n = rewards.shape[0]
        for k, v in batch.items():
            if len(v) != n:
                raise ValueError(f"batch[{k!r}] has {len(v)} rows, rewards has {n}")
        if self._parts and set(batch) != set(self._parts):
            raise ValueError("every round must carry the same keys")
        f = filter_groups(rewards, self.group_size)
        self.rounds += 1
        self.groups_seen += int(f.group_keep.numel())
        kept = int(f.group_keep.sum())
        self.groups_kept += kept
        for k, v in batch.items():
            self._parts.setdefault(k, []).append(_select(v, f.sample_index))
        return kept

    def pop(self) -> Dict[str, Any]:
        """Return exactly ``target_groups * group_size`` samples and reset (raises if not full)."""
        if not self.is_full:
            raise RuntimeError(f"only {self.groups_kept}/{self.target_groups} groups collected")
        n = self.target_groups * self.group_size
        out = {}
        for k, parts in self._parts.items():
            full = _concat(parts, self.pad_values.get(k, 0))
            out[k] = full[:n]
        self.reset()
        return out

    def reset(self) -> None:
        self._parts = {}
        self.rounds = 0
        self.groups_seen = 0
        self.groups_kept = 0


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
