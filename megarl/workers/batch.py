"""Model inputs of one micro-batch, packed (THD) or padded, and where its outputs are read.

A micro-batch is a :class:`~megarl.data.batch.TokenBatch` of whole samples. Packed: the sequences
are laid end to end in one row ``[1, T]`` with per-sequence positions and
:class:`~megarl.models.packed.PackedSeqs` (no padding compute at all). Padded (``packing: false``):
``[b, L]`` right-padded to the micro-batch's longest sample (causal attention means right padding
never changes a real token's output).

Either way the model's output is read through *flat row* indices into ``output.reshape(rows, ...)``:
``pred_index[i, j]`` is the row whose output predicts response token ``j`` of sample ``i`` (the
token before it), ``next_ids[row]`` the token that follows each row, ``last_index[i]`` the row of
sample ``i``'s last token. Losses then see the same ``[b, R]`` response-aligned tensors in both
layouts, which is what makes packed and padded results agree to rounding.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from megarl.data.batch import LOSS_MASK, TokenBatch, ranges


@dataclass
class MicroInputs:
    batch: TokenBatch
    input_ids: Tensor            # [1, T] packed | [b, L] padded
    position_ids: Tensor
    packed: Optional[object]     # megarl.models.packed.PackedSeqs when packed
    pred_index: Tensor           # [b, R] flat output row predicting each response token (0 where padding)
    next_ids: Tensor             # [rows] token following each flat row (targets of logprobs)
    last_index: Tensor           # [b] flat row of each sample's last token
    mask: Tensor                 # [b, R] float response mask

    @property
    def empty(self) -> bool:
        """A placeholder micro-batch (see megarl.data.packing.equalize): forward runs, loss adds 0."""
        return len(self.batch) == 0

    @property
    def loss_mask(self) -> Tensor:
        """``[b, R]`` mask the losses use: ``mask`` without environment tokens (the batch's
        ``loss_mask`` token field, agent trajectories); ``mask`` itself when there is none."""
        if LOSS_MASK not in self.batch.token_fields:
            return self.mask
        return self.mask * self.padded(LOSS_MASK).to(device=self.mask.device, dtype=self.mask.dtype)

    def padded(self, name: str) -> Tensor:
        """Token field ``name`` of this micro-batch as ``[b, R]``."""
        return self.batch.padded(self.batch.token_fields[name])

    def to(self, device: torch.device) -> "MicroInputs":
        packed = self.packed
        if packed is not None and packed.cu_seqlens_q.device != device:
            from dataclasses import replace

            cu = packed.cu_seqlens_q.to(device)
            packed = replace(packed, cu_seqlens_q=cu, cu_seqlens_kv=cu)
        return MicroInputs(self.batch, self.input_ids.to(device), self.position_ids.to(device), packed,
                           self.pred_index.to(device), self.next_ids.to(device), self.last_index.to(device),
                           self.mask.to(device))


def _response_layout(batch: TokenBatch, row_of_seq_start: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(pred_index [b, R], last_index [b], mask [b, R]) given each sample's first flat row."""
    mask = batch.response_mask()
    pred = torch.zeros(mask.shape, dtype=torch.int64)
    first_pred = row_of_seq_start + batch.prompt_lens - 1  # row of the last prompt token
    pred[mask.bool()] = ranges(first_pred, batch.response_lens)
    last = row_of_seq_start + batch.seq_lens - 1
    return pred, last, mask


def packed_inputs(batch: TokenBatch, pad_to_multiple: int = 1, length: int = 0) -> MicroInputs:
    """Sequences end to end in ``[1, T]``; one padding sequence is appended to reach ``length``
    tokens (interleaved pipeline schedules need one shape for all micro-batches) and then a
    multiple of ``pad_to_multiple`` (sequence parallelism splits the row over TP ranks)."""
    from megarl.models.packed import pack_params, packed_positions

    if len(batch) == 0:
        return placeholder_inputs(packed=True, length=length)
    lens = batch.seq_lens.tolist()
    ids = batch.tokens
    target = max(length, ids.numel())
    pad = target - ids.numel() + (-target) % pad_to_multiple
    if pad:
        lens = lens + [pad]
        ids = torch.cat([ids, torch.zeros(pad, dtype=ids.dtype)])
    params = pack_params(lens)
    pos = packed_positions(params.cu_seqlens_q, ids.numel())
    pred, last, mask = _response_layout(batch, batch.seq_offsets[:-1])
    next_ids = torch.roll(ids, -1)
    return MicroInputs(batch, ids.unsqueeze(0).long(), pos.unsqueeze(0), params, pred, next_ids.long(), last, mask)


def padded_inputs(batch: TokenBatch, pad_id: int = 0, length: int = 0, rows: int = 0) -> MicroInputs:
    """``[b, L]`` right-padded to the longest sample, or to at least ``rows x length`` (padding rows
    at the end: one shape for all micro-batches of an interleaved pipeline schedule)."""
    if len(batch) == 0:
        return placeholder_inputs(packed=False, length=length, rows=rows)
    lens = batch.seq_lens
    width = max(int(lens.max()), length)
    b = max(len(batch), rows)
    ids = torch.full((b, width), pad_id, dtype=torch.long)
    keep = torch.arange(width).unsqueeze(0) < lens.unsqueeze(1)
    ids[: len(batch)][keep] = batch.tokens.long()
    pos = torch.arange(width).unsqueeze(0).expand(b, width).contiguous()
    pred, last, mask = _response_layout(batch, torch.arange(len(batch)) * width)
    return MicroInputs(batch, ids, pos, None, pred, torch.roll(ids.reshape(-1), -1), last, mask)


def placeholder_inputs(packed: bool, length: int = 0, rows: int = 0) -> MicroInputs:
    """A forward of padding tokens for an empty micro-batch (keeps per-micro-batch collectives
    matched); one token unless a common shape is asked for."""
    from megarl.models.packed import pack_params

    empty = TokenBatch(torch.zeros(0, dtype=torch.long), torch.zeros(1, dtype=torch.long),
                       torch.zeros(0, dtype=torch.long))
    length = max(1, length)
    ids = torch.zeros(1 if packed else max(1, rows), length, dtype=torch.long)
    pos = torch.arange(length).unsqueeze(0).expand(ids.shape[0], length).contiguous()
    zeros = torch.zeros(0, 0, dtype=torch.int64)
    return MicroInputs(empty, ids, pos, pack_params([length]) if packed else None, zeros,
                       torch.zeros(ids.numel(), dtype=torch.long), torch.zeros(0, dtype=torch.int64), zeros.float())


def micro_inputs(batch: TokenBatch, packed: bool, pad_to_multiple: int = 1, length: int = 0,
                 rows: int = 0) -> MicroInputs:
    return packed_inputs(batch, pad_to_multiple, length) if packed else padded_inputs(batch, length=length, rows=rows)


def common_shape(batches: list[TokenBatch], packed: bool) -> tuple[int, int]:
    """``(length, rows)`` every micro-batch fits in: packed ``(max T, 1)``, padded ``(max L, max b)``."""
    if packed:
        return max((b.num_tokens for b in batches), default=1), 1
    return (max((int(b.seq_lens.max()) for b in batches if len(b)), default=1),
            max((len(b) for b in batches), default=1))
