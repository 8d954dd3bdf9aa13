"""Multi-tensor kernels for megatron-core's optimizer when neither Transformer Engine nor Apex is
installed (megatron-core 0.16.1's ``local_multi_tensor_l2_norm`` / ``local_multi_tensor_scale``).

Why: megatron's fallbacks loop in Python over every parameter tensor. The L2 norm builds
``torch.tensor([torch.norm(g) for g in grads])``, one device-to-host copy per tensor (182 host
syncs per optimizer step for SmolLM2-135M, every step, on the GPU too); the scale launches a
multiply and a copy per tensor and allocates a temporary each time (the fp32 main params are copied
into the bf16 model params through it after every step, and clipped gradients are scaled through
it). With bf16 params megatron copies the main params into the model params with one ``copy_``
per tensor whatever is installed (``_multi_tensor_copy_this_to_that`` without an overflow buffer).
The replacements use ``torch._foreach_*``: a few multi-tensor kernels, no host sync (megatron
reads the norm once, as it does with Apex), and the same numbers up to summation order.

:func:`install_optimizer_kernels` binds the norm and the scale only where megatron bound its own
local fallbacks (with Transformer Engine or Apex present, their fused kernels stay), and the copy
where megatron's own loop is bound.
"""
from __future__ import annotations

import importlib
from collections import defaultdict
from typing import Any, Optional, Sequence

import torch

# megatron-core modules that bind the fallbacks at import time, and the names they bind
_L2_NORM_SITES = ("megatron.core.optimizer.clip_grads",)
_SCALE_SITES = ("megatron.core.optimizer.clip_grads", "megatron.core.optimizer.optimizer")
_COPY_SITE = "megatron.core.optimizer.optimizer"
_MEGATRON_COPY: dict = {}   # megatron's own copy loop, remembered before it is replaced


def _by_device_and_dtype(tensors: Sequence[torch.Tensor]) -> dict[tuple, list[int]]:
    """Indices of ``tensors`` per (device, dtype): a foreach kernel takes one of each."""
    groups: dict[tuple, list[int]] = defaultdict(list)
    for i, t in enumerate(tensors):
        groups[(t.device, t.dtype)].append(i)
    return groups


def foreach_l2_norm(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: Sequence[Sequence[torch.Tensor]],
                    per_tensor: bool, *args: Any) -> tuple[torch.Tensor, None]:
    """Drop-in for ``amp_C.multi_tensor_l2norm`` as megatron calls it (``per_tensor=False``): the
    L2 norm over every tensor of ``tensor_lists[0]`` as a one-element fp32 tensor on their device,
    without a host sync. Per-tensor norms are taken in fp32 whatever the tensors' dtype."""
    if per_tensor:
        raise NotImplementedError("per-tensor norms: megatron-core's optimizer does not ask for them")
    tensors = [t for t in tensor_lists[0]]
    if not tensors:
        return torch.zeros(1, dtype=torch.float32, device=noop_flag.device), None
    home = tensors[0].device
    squares = []
    for (device, _), idx in _by_device_and_dtype(tensors).items():
        norms = torch._foreach_norm([tensors[i] for i in idx], 2, dtype=torch.float32)
        squares.append(torch.stack(norms).square().sum().to(home))
    total = torch.stack(squares).sum().sqrt() if len(squares) > 1 else squares[0].sqrt()
    return total.reshape(1), None


def foreach_scale(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: Sequence[Sequence[torch.Tensor]],
                  scale: float) -> None:
    """Drop-in for ``amp_C.multi_tensor_scale``: ``dst = src * scale`` for each pair of
    ``tensor_lists[0]`` (src) and ``tensor_lists[1]`` (dst), dtypes converted like ``copy_``.
    In place when dst is src (gradient clipping); a plain copy when ``scale == 1`` (main params
    into model params)."""
    srcs, dsts = list(tensor_lists[0]), list(tensor_lists[1])
    if len(srcs) != len(dsts):
        raise ValueError(f"multi_tensor_scale: {len(srcs)} sources for {len(dsts)} destinations")
    in_place = [i for i, (s, d) in enumerate(zip(srcs, dsts)) if s is d]
    pairs = [i for i, (s, d) in enumerate(zip(srcs, dsts)) if s is not d]
    for idx in _by_device_and_dtype([dsts[i] for i in in_place]).values():
        torch._foreach_mul_([dsts[in_place[i]] for i in idx], scale)
    for idx in _by_device_and_dtype([dsts[i] for i in pairs]).values():
        group = [pairs[i] for i in idx]
        src = [srcs[i] for i in group]
        if scale != 1.0:
            src = torch._foreach_mul(src, scale)
        torch._foreach_copy_([dsts[i] for i in group], src)


def foreach_copy_this_to_that(this: list[torch.Tensor], that: list[torch.Tensor],
                              overflow_buf: Optional[torch.Tensor] = None) -> None:
    """Drop-in for megatron's ``_multi_tensor_copy_this_to_that``: ``that[i].copy_(this[i])``
    for every pair, as multi-tensor copies (dtypes converted like ``copy_``)."""
    if len(this) != len(that):
        raise ValueError(f"copy: {len(this)} sources for {len(that)} destinations")
    for idx in _by_device_and_dtype(that).values():
        torch._foreach_copy_([that[i] for i in idx], [this[i] for i in idx])


def install_optimizer_kernels() -> list[str]:
    """Bind the foreach kernels in place of megatron-core's Python loops (idempotent).
    Returns ``module.name`` of every binding replaced by this call."""
    from megatron.core import utils as mcore_utils
    from megatron.core.optimizer import optimizer as mcore_optimizer

    # checked against megatron-core 0.16.1 and 0.19.2; a name another version lacks is left alone
    l2_fallback = getattr(mcore_utils, "local_multi_tensor_l2_norm", None)
    scale_fallback = getattr(mcore_utils, "local_multi_tensor_scale", None)
    copy_loop = _MEGATRON_COPY.setdefault("loop", getattr(mcore_optimizer, "_multi_tensor_copy_this_to_that", None))
    bindings = ([(m, "l2_norm_impl", l2_fallback, foreach_l2_norm) for m in _L2_NORM_SITES]
                + [(m, "multi_tensor_scale_impl", scale_fallback, foreach_scale) for m in _SCALE_SITES]
                + [(_COPY_SITE, "_multi_tensor_copy_this_to_that", copy_loop, foreach_copy_this_to_that)])
    replaced = []
    for site, name, theirs, ours in bindings:
        module = importlib.import_module(site)
        if theirs is not None and getattr(module, name, None) is theirs:
            setattr(module, name, ours)
            replaced.append(f"{site}.{name}")
    return replaced
