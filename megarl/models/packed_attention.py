"""Causal attention over packed (THD) sequences: each token attends only to earlier tokens of its
own sequence.

Backends, chosen per call by :func:`packed_attention_backend`:

* ``varlen``: PyTorch's ``torch.nn.attention.varlen.varlen_attn`` (FlashAttention's varlen kernel
  shipped with PyTorch; CUDA, fp16/bf16). Work is ``sum(len_i^2)``, no mask is materialised.
* ``per_sequence``: one ``scaled_dot_product_attention(is_causal=True)`` per sequence, using the
  host copy of the lengths (:class:`megarl.models.packed.PackedSeqs`). Exact, memory
  ``O(max len^2)``; CPU (tests, CI) and any dtype/device the varlen kernel refuses (fp32 CUDA).

``MEGARL_PACKED_ATTENTION`` (``auto`` | ``varlen`` | ``per_sequence``) forces one (tests,
benchmarks). Different head sizes for q/k and v (MLA: 192 vs 128) go through the varlen kernel with
v zero-padded to the q/k size and the output cut back.
"""
from __future__ import annotations

import inspect
import os
from functools import lru_cache
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor


@lru_cache(maxsize=1)
def _varlen_fn():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None, frozenset()
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


def packed_attention_backend(query: Tensor) -> str:
    forced = os.environ.get("MEGARL_PACKED_ATTENTION", "auto")
    if forced not in ("auto", "varlen", "per_sequence"):
        raise ValueError(f"MEGARL_PACKED_ATTENTION={forced!r}: expected auto, varlen or per_sequence")
    if forced != "auto":
        return forced
    fn, _ = _varlen_fn()
    if fn is not None and query.is_cuda and query.dtype in (torch.float16, torch.bfloat16):
        return "varlen"
    return "per_sequence"


def packed_causal_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_kv: Tensor,
                            max_seqlen_q: int, max_seqlen_kv: int, scale: float,
                            seq_lens: Optional[Sequence[int]] = None) -> Tensor:
    """``q [T, hq, d]``, ``k [T, hk, d]``, ``v [T, hk, dv]`` -> ``[T, hq, dv]``; GQA when hq > hk."""
    backend = packed_attention_backend(q)
    if backend == "varlen":
        return _varlen(q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, scale)
    if not seq_lens:
        seq_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).tolist()
    return _per_sequence(q, k, v, seq_lens, scale)


def _per_sequence(q: Tensor, k: Tensor, v: Tensor, seq_lens: Sequence[int], scale: float) -> Tensor:
    if sum(seq_lens) != q.shape[0]:
        raise ValueError(f"packed lengths add up to {sum(seq_lens)} tokens, attention got {q.shape[0]}")
    gqa = q.shape[1] != k.shape[1]
    outs = []
    start = 0
    for n in seq_lens:
        sl = slice(start, start + n)
        # [n, h, d] -> [1, h, n, d]
        qs, ks, vs = (x[sl].transpose(0, 1).unsqueeze(0) for x in (q, k, v))
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=n > 1, scale=scale, enable_gqa=gqa)
        outs.append(o[0].transpose(0, 1))
        start += n
    return torch.cat(outs, 0) if len(outs) > 1 else outs[0].contiguous()


def _varlen(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int,
            scale: float) -> Tensor:
    fn, params = _varlen_fn()
    if fn is None:
        raise RuntimeError("MEGARL_PACKED_ATTENTION=varlen: this PyTorch has no torch.nn.attention.varlen")
    dv = v.shape[-1]
    if dv != q.shape[-1]:  # MLA: the kernel wants one head size
        v = F.pad(v, (0, q.shape[-1] - dv))
    kwargs = {"scale": scale}
    if "window_size" in params:
        kwargs["window_size"] = (-1, 0)  # causal
    else:
        kwargs["is_causal"] = True
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    cu_q, cu_k = cu_q.to(torch.int32), cu_k.to(torch.int32)
    out = fn(q.contiguous(), k.contiguous(), v.contiguous(), cu_q, cu_k, int(max_q), int(max_k), **kwargs)
    if isinstance(out, tuple):
        out = out[0]
    return out[..., :dv] if dv != q.shape[-1] else out
