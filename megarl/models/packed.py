"""Packed (THD) sequences for megatron's local layers: the parameters megatron passes around, and
the RoPE it applies to them.

Why: RL batches mix response lengths from a few tokens to the maximum; padding each micro-batch to
its longest sample wastes most of the compute. Packing concatenates the sequences of a micro-batch
into one row of ``T`` tokens (``[1, T]``) and tells megatron where each starts
(``PackedSeqParams(qkv_format="thd", cu_seqlens=...)``). megatron then squeezes q/k/v to
``[T, heads, dim]``, applies RoPE per sequence and hands them to the core attention, which must
keep each token inside its own sequence (:mod:`megarl.models.packed_attention`).

RoPE: megatron's local (no Transformer Engine) path ignores ``position_ids``; for ``thd`` inputs
it calls ``rope_utils._apply_rotary_pos_emb_thd``, which restarts positions at each ``cu_seqlens``
boundary -- correct, but in megatron-core 0.16.1 it reads ``cu_seqlens`` back to the host
(``.tolist()``: a device sync for q and for k in every layer) and splits/concatenates per
sequence. :func:`install_thd_rope` swaps it (at run time, like
:func:`megarl.models.fusions.install_rope_fusion`; megatron looks the function up at call time)
for :func:`apply_rotary_pos_emb_thd`: the same per-sequence positions computed on the device
(``searchsorted``), one gather of the frequencies, one elementwise RoPE, no sync. The gathered rows
are the same for q and k of every layer of one micro-batch, so they are gathered once per micro-batch
and kept while it runs (:func:`token_freqs`): recomputing them for q and k in each layer
cost ~16 small kernels per layer, half the launches of a layer's forward on the GPU, where the train
phase is bound by launches (benchmarks/RESULTS.md, train phase host cost). Under context
parallelism (:mod:`megarl.models.context_parallel`) ``cu_seqlens`` are the global padded sequences
and the rank holds chunks ``r`` and ``2 cp - 1 - r`` of each; :func:`cp_positions` gives each local
token its global position the same way (megatron's own function does the same slicing with a host
sync per sequence).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
from torch import Tensor

try:  # megatron's dataclass: TE, MLA and the attention modules test ``qkv_format`` on it
    from megatron.core.packed_seq_params import PackedSeqParams as _Base
except ImportError:  # pragma: no cover - megatron-core is a hard dependency of megarl.models
    _Base = object


@dataclass
class PackedSeqs(_Base):
    """megatron's ``PackedSeqParams`` (``qkv_format="thd"``) plus the sequence lengths on the host,
    so attention backends that loop over sequences need no device->host copy."""

    seq_lens: tuple = ()
    cp: Optional[Any] = None   # megarl.models.context_parallel.CPSplit under context parallelism


def pack_params(seq_lens: Sequence[int], device: torch.device | str = "cpu") -> PackedSeqs:
    """Packed-sequence parameters for sequences of ``seq_lens`` tokens laid end to end."""
    lens = [int(n) for n in seq_lens]
    if not lens or min(lens) < 1:
        raise ValueError(f"packed sequences need at least one token each, got lengths {lens[:8]}")
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lens, dtype=torch.int32).cumsum(0)
    cu = cu.to(device)
    longest = max(lens)
    return PackedSeqs(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest,
                      max_seqlen_kv=longest, seq_lens=tuple(lens))


def packed_positions(cu_seqlens: Tensor, total: int) -> Tensor:
    """Position of each of ``total`` packed tokens inside its own sequence (0 at every start),
    computed on ``cu_seqlens``' device without reading it back."""
    cu = cu_seqlens.to(torch.int64)
    idx = torch.arange(total, device=cu.device, dtype=torch.int64)
    seq = torch.searchsorted(cu, idx, right=True) - 1
    return idx - cu[seq.clamp(min=0)]


def cp_positions(cu_seqlens: Tensor, total: int, cp: int, rank: int) -> Tensor:
    """Global position inside its sequence of each of this CP rank's ``total`` local tokens, given
    the *global* padded ``cu_seqlens`` (zig-zag: chunk ``rank`` then chunk ``2 cp - 1 - rank`` of
    every sequence); on the device, no host sync."""
    cu = cu_seqlens.to(torch.int64)
    local_cu = cu // cp
    idx = torch.arange(total, device=cu.device, dtype=torch.int64)
    seq = (torch.searchsorted(local_cu, idx, right=True) - 1).clamp(min=0)
    offset = idx - local_cu[seq]
    chunk = (cu[seq + 1] - cu[seq]) // (2 * cp)
    first = offset < chunk
    return torch.where(first, rank * chunk + offset, (2 * cp - 1 - rank) * chunk + offset - chunk)


def pack_sequences(sequences: Sequence[Sequence[int] | Tensor], device: torch.device | str = "cpu"
                   ) -> tuple[Tensor, Tensor, PackedSeqs]:
    """``(input_ids [1, T], position_ids [1, T], params)`` for token sequences packed end to end."""
    tensors = [torch.as_tensor(s, dtype=torch.long) for s in sequences]
    params = pack_params([t.numel() for t in tensors], device)
    ids = torch.cat(tensors).to(device).unsqueeze(0)
    pos = packed_positions(params.cu_seqlens_q, ids.shape[1]).unsqueeze(0)
    return ids, pos, params


_ORIGINAL_THD = None
# the last micro-batch's rows: (weak reference to its cu_seqlens, freqs, key, rows)
_LAST_ROWS: Optional[tuple] = None


def _forget_rows(ref: "weakref.ref") -> None:
    """The micro-batch whose rows are kept is gone: so are they."""
    global _LAST_ROWS
    last = _LAST_ROWS
    if last is not None and last[0] is ref:
        _LAST_ROWS = None


def drop_kept_rows() -> None:
    """Forget the kept rows now (benchmarks/bench_layer_ops.py: the rows-per-call baseline)."""
    global _LAST_ROWS
    _LAST_ROWS = None


def token_freqs(freqs: Tensor, cu_seqlens: Tensor, total: int, cp: int = 1, rank: int = 0) -> Tensor:
    """``freqs[position of each of the total local tokens]``, gathered once per micro-batch.

    megatron applies RoPE to q and to k in every layer with the same ``freqs`` (its rotary module
    caches them per length) and the same ``cu_seqlens``, so the rows of the micro-batch being run
    are kept: one micro-batch's at a time (``total x rotary dim`` fp32, 8 MiB for 16k tokens at
    dim 128), dropped when the next micro-batch's replace them or its ``cu_seqlens`` is freed (a
    weak reference: a phase's micro-batches, all on the device together, never keep theirs all).
    The rows are used only for the same ``cu_seqlens`` and ``freqs`` objects, both unmodified
    (``_version``), the same token count and CP rank. Nothing is kept under ``inference_mode`` or
    for inference tensors (rows made there cannot be saved for a backward, and such tensors have no
    version to check), nor for a ``freqs`` that needs a gradient (its rows belong to one graph)."""
    global _LAST_ROWS
    keep = not (torch.is_inference_mode_enabled() or freqs.requires_grad or freqs.is_inference()
                or cu_seqlens.is_inference())
    key = (freqs._version, cu_seqlens._version, total, cp, rank) if keep else None
    last = _LAST_ROWS if keep else None
    if last is not None and last[0]() is cu_seqlens and last[1] is freqs and last[2] == key:
        return last[3]
    pos = packed_positions(cu_seqlens, total) if cp == 1 else cp_positions(cu_seqlens, total, cp, rank)
    rows = freqs.index_select(0, pos.to(freqs.device))
    if keep:
        _LAST_ROWS = (weakref.ref(cu_seqlens, _forget_rows), freqs, key, rows)
    return rows


def apply_rotary_pos_emb_thd(t: Tensor, cu_seqlens: Tensor, freqs: Tensor, rotary_interleaved: bool = False,
                             multi_latent_attention: bool = False, mscale: float = 1.0,
                             cp_group: Optional[torch.distributed.ProcessGroup] = None, **newer: Any) -> Tensor:
    """Drop-in for megatron's ``_apply_rotary_pos_emb_thd`` (same arguments, same result).

    ``t`` is ``[T, heads, dim]``; ``freqs`` either ``[max_seqlen, 1, 1, d]`` (positions restart per
    sequence) or ``[T, 1, 1, d]`` (one row per packed token, megatron's "exact mapping" case).
    ``newer``: keywords of later megatron-core versions (0.19: ``mla_rotary_interleaved``), passed on
    unchanged to megatron's own functions, which take them in those versions."""
    from megatron.core.models.common.embeddings import rope_utils

    total = t.size(0)
    cp = cp_group.size() if cp_group is not None else 1
    if cp > 1 and freqs.size(0) == total * cp:   # megatron's per-packed-token mapping: its own code
        return _ORIGINAL_THD(t, cu_seqlens, freqs, rotary_interleaved=rotary_interleaved,
                             multi_latent_attention=multi_latent_attention, mscale=mscale,
                             cp_group=cp_group, **newer)
    if cp > 1 or freqs.size(0) != total:  # one row per position inside a sequence
        freqs = token_freqs(freqs, cu_seqlens, total, cp, cp_group.rank() if cp > 1 else 0)
    # looked up at call time: the compiled copy when fusions are on (fusions.install_rope_fusion)
    return rope_utils._apply_rotary_pos_emb_bshd(t.unsqueeze(1), freqs, rotary_interleaved=rotary_interleaved,
                                                 multi_latent_attention=multi_latent_attention,
                                                 mscale=mscale, **newer).squeeze(1)


def install_thd_rope() -> None:
    """Route megatron's unfused THD RoPE through :func:`apply_rotary_pos_emb_thd` (idempotent)."""
    global _ORIGINAL_THD
    from megatron.core.models.common.embeddings import rope_utils

    if rope_utils._apply_rotary_pos_emb_thd is apply_rotary_pos_emb_thd:
        return
    _ORIGINAL_THD = rope_utils._apply_rotary_pos_emb_thd
    rope_utils._apply_rotary_pos_emb_thd = apply_rotary_pos_emb_thd
