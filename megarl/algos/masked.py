"""Masked reductions and group bookkeeping shared by every algorithm in ``megarl.algos``.

Conventions (they hold across the whole package):

* token tensors are ``[batch, resp_len]``: response tokens only, right-padded;
* ``mask`` is a float or bool tensor of the same shape, 1/True on real response tokens;
* sequence tensors are ``[batch]``;
* a *group* is the set of samples generated from one prompt. Either ``group_size: int`` (samples of
  a prompt are contiguous and ``batch % group_size == 0``) or ``group_ids: LongTensor[batch]`` (any
  labels, any order, groups may differ in size) describes them.

Padded positions may hold anything, even ``nan``/``inf``: :func:`sanitize` replaces them by zero
*before* any arithmetic, so padding can neither change a value nor leak a ``nan`` gradient
(``0 * nan`` is ``nan``, so multiplying by the mask afterwards would not be enough).
"""
from __future__ import annotations

import functools
from typing import Dict, Optional

import torch
from torch import Tensor


def as_bool_mask(mask: Tensor) -> Tensor:
    """Return ``mask`` as a bool tensor (``mask > 0`` for float masks)."""
    return mask if mask.dtype == torch.bool else mask > 0


def sanitize(x: Tensor, mask: Tensor, fill: float = 0.0) -> Tensor:
    """``x`` with every padded position (``mask`` false) set to ``fill``, gradient-safe.

    ``torch.where`` routes zero gradient to the unselected branch, so padded entries of ``x`` get
    an exact zero gradient even if they were ``nan``.
    """
    return torch.where(as_bool_mask(mask), x, torch.full_like(x, fill))


def masked_sum(x: Tensor, mask: Tensor, dim: Optional[int] = None) -> Tensor:
    """Sum of ``x`` over positions where ``mask`` is set (all of them, or along ``dim``)."""
    x = sanitize(x, mask)
    return x.sum() if dim is None else x.sum(dim=dim)


def masked_mean(x: Tensor, mask: Tensor, dim: Optional[int] = None) -> Tensor:
    """Mean of ``x`` over masked positions; 0 where there is no valid position (no ``nan``)."""
    m = as_bool_mask(mask).to(x.dtype)
    count = m.sum() if dim is None else m.sum(dim=dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1)


def masked_means(values: Dict[str, Tensor], mask: Tensor) -> Dict[str, Tensor]:
    """:func:`masked_mean` of each tensor of ``values`` (each of ``mask``'s shape; bools count as
    0/1), computed together: one select, one sum and one division for all of them. Why: a loss logs
    several such means in every micro-batch, and on a GPU each op is a kernel launch; nine per
    separate mean add up where the train phase is bound by launches."""
    if not values:
        return {}
    m = as_bool_mask(mask)
    dtype = torch.promote_types(torch.get_default_dtype(),
                                functools.reduce(torch.promote_types, (v.dtype for v in values.values())))
    stacked = torch.stack([v.to(dtype) for v in values.values()])
    sums = torch.where(m, stacked, torch.zeros((), dtype=dtype, device=stacked.device)).flatten(1).sum(1)
    means = sums / m.sum().to(dtype).clamp(min=1)
    return dict(zip(values, means.unbind(0)))


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of ``x`` over all masked positions (Bessel-corrected when ``unbiased``)."""
    mean = masked_mean(x, mask)
    centred = sanitize(x - mean, mask)
    n = as_bool_mask(mask).sum().to(x.dtype)
    denom = (n - 1).clamp(min=1) if unbiased else n.clamp(min=1)
    return (centred * centred).sum() / denom


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8,
                  divide_std: bool = True) -> Tensor:
    """Normalise ``x`` over all masked positions of the batch: ``(x - mean) / (std + eps)``.

    ``shift_mean=False`` adds the mean back (scale only), ``divide_std=False`` only centres. The
    standard deviation is the unbiased one (matches ``torch.std``). Padded positions come back 0.
    """
    mean = masked_mean(x, mask)
    out = x - mean
    if divide_std:
        out = out / (masked_var(x, mask).sqrt() + eps)
    if not shift_mean:
        out = out + mean
    return sanitize(out, mask)


# --------------------------------------------------------------------------------------------
# groups
# --------------------------------------------------------------------------------------------
def group_index(batch: int, group_size: Optional[int] = None, group_ids: Optional[Tensor] = None,
                device: Optional[torch.device] = None) -> tuple[Tensor, int]:
    """Return ``(index[batch], num_groups)`` with ``index`` in ``0..num_groups-1``.

    ``group_ids`` wins when given (labels are renumbered in sorted order); otherwise samples of a
    group are the ``group_size`` contiguous ones.
    """
    if group_ids is not None:
        if group_ids.shape != (batch,):
            raise ValueError(f"group_ids must have shape [{batch}], got {tuple(group_ids.shape)}")
        uniq, inverse = torch.unique(group_ids, return_inverse=True)
        return inverse.to(device or group_ids.device), int(uniq.numel())
    if group_size is None:
        raise ValueError("this estimator needs groups: pass group_size=int or group_ids=LongTensor")
    if group_size <= 0 or batch % group_size != 0:
        raise ValueError(f"batch {batch} is not a multiple of group_size {group_size}")
    idx = torch.arange(batch, device=device) // group_size
    return idx, batch // group_size


def group_stats(x: Tensor, index: Tensor, num_groups: int,
                valid: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    """Per-sample ``(group_mean, group_std_unbiased, group_count)`` of a ``[batch]`` tensor.

    The std is Bessel-corrected (``torch.std`` default, as in verl and OpenRLHF); a group of one
    sample has std 0 (not ``nan``). ``valid`` (``[batch]`` bool): only those samples enter the
    statistics and the count (the others may hold anything, even ``nan``); a group without a valid
    sample has mean 0, std 0 and count 0.
    """
    keep = torch.ones_like(x, dtype=torch.bool) if valid is None else valid.to(torch.bool)
    x = torch.where(keep, x, torch.zeros_like(x))
    ones = keep.to(x.dtype)
    count = torch.zeros(num_groups, dtype=x.dtype, device=x.device).index_add_(0, index, ones)
    total = torch.zeros(num_groups, dtype=x.dtype, device=x.device).index_add_(0, index, x)
    mean = total / count.clamp(min=1)
    dev = torch.where(keep, x - mean[index], torch.zeros_like(x))
    ss = torch.zeros(num_groups, dtype=x.dtype, device=x.device).index_add_(0, index, dev * dev)
    std = (ss / (count - 1).clamp(min=1)).sqrt()
    return mean[index], std[index], count[index]
