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

Context parallelism (packed only, :mod:`megarl.models.context_parallel`): every sequence is padded
to a multiple of ``2 cp`` and the rank feeds the model only its zig-zag chunks (``input_ids`` and
``position_ids`` hold ``T / cp`` tokens with their global positions, ``next_ids`` their targets).
``pred_index`` and ``last_index`` still index the *global* padded rows: per-row outputs are gathered
over the CP group into global order first (``MicroInputs.global_rows``).
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
    cp: Optional[object] = None  # megarl.models.context_parallel.CPSplit under context parallelism
    token_rows: Optional[Tensor] = None   # CP: global padded row of each of the batch's tokens

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

    def global_rows(self, rows: Tensor) -> Tensor:
        """Per-output-row values in the row order ``pred_index`` reads: under CP the local rows of
        every CP rank gathered into global order (autograd: each rank keeps its own rows' gradient),
        else ``rows`` itself."""
        if self.cp is None:
            return rows
        from megarl.models.context_parallel import gather_rows

        return gather_rows(rows, self.cp)

    def to(self, device: torch.device) -> "MicroInputs":
        from dataclasses import replace

        packed, cp = self.packed, self.cp
        if cp is not None:
            cp = cp.to(device)
        if packed is not None and (packed.cu_seqlens_q.device != device or cp is not None):
            cu = packed.cu_seqlens_q.to(device)
            packed = replace(packed, cu_seqlens_q=cu, cu_seqlens_kv=cu, cp=cp)
        return MicroInputs(self.batch, self.input_ids.to(device), self.position_ids.to(device), packed,
                           self.pred_index.to(device), self.next_ids.to(device), self.last_index.to(device),
                           self.mask.to(device), cp, self.token_rows)


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


def cp_packed_inputs(batch: TokenBatch, cp: int, rank: int, pad_to_multiple: int = 1, length: int = 0,
                     group=None) -> MicroInputs:
    """This CP rank's part of a packed micro-batch: each sequence padded to a multiple of ``2 cp``
    (padding after its last token, so causal attention leaves its real tokens alone), a padding
    sequence appended to reach ``length`` and a multiple of ``2 cp x pad_to_multiple`` (sequence
    parallelism splits the local row over TP ranks), then the rank's zig-zag chunks."""
    from megarl.models.context_parallel import CPSplit, cp_padded_len
    from megarl.models.packed import pack_params, packed_positions

    if len(batch) == 0:
        return placeholder_inputs(packed=True, length=length, cp=cp, rank=rank, pad_to_multiple=pad_to_multiple,
                                  group=group)
    lens = batch.seq_lens
    padded = [cp_padded_len(n, cp) for n in lens.tolist()]
    starts = torch.zeros(len(padded), dtype=torch.int64)
    starts[1:] = torch.tensor(padded[:-1], dtype=torch.int64).cumsum(0)
    total = sum(padded)
    target = max(length, total)
    step = 2 * cp * pad_to_multiple
    extra = target - total + (-target) % step
    if extra:
        padded.append(extra)
    token_rows = ranges(starts, lens)
    ids = torch.zeros(sum(padded), dtype=torch.long)
    ids[token_rows] = batch.tokens.long()
    params = pack_params(padded)
    split = CPSplit.build(padded, cp, rank, group)
    params.cp = split
    pos = packed_positions(params.cu_seqlens_q, ids.numel())
    pred, last, mask = _response_layout(batch, starts)
    local = split.local_rows
    return MicroInputs(batch, ids[local].unsqueeze(0), pos[local].unsqueeze(0), params, pred,
                       torch.roll(ids, -1)[local], last, mask, split, token_rows)


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


def placeholder_inputs(packed: bool, length: int = 0, rows: int = 0, cp: int = 1, rank: int = 0,
                       pad_to_multiple: int = 1, group=None) -> MicroInputs:
    """A forward of padding tokens for an empty micro-batch (keeps per-micro-batch collectives
    matched); one token unless a common shape is asked for (CP: one padding sequence of at least
    ``2 cp x pad_to_multiple`` tokens, split like any other)."""
    from megarl.models.packed import pack_params

    empty = TokenBatch(torch.zeros(0, dtype=torch.long), torch.zeros(1, dtype=torch.long),
                       torch.zeros(0, dtype=torch.long))
    if packed and cp > 1:
        from megarl.models.context_parallel import CPSplit

        step = 2 * cp * pad_to_multiple
        n = max(step, -(-length // step) * step)
        params = pack_params([n])
        params.cp = CPSplit.build([n], cp, rank, group)
        zeros = torch.zeros(0, 0, dtype=torch.int64)
        local = n // cp
        return MicroInputs(empty, torch.zeros(1, local, dtype=torch.long), params.cp.local_rows.unsqueeze(0), params,
                           zeros, torch.zeros(local, dtype=torch.long), torch.zeros(0, dtype=torch.int64),
                           zeros.float(), params.cp, torch.zeros(0, dtype=torch.int64))
    length = max(1, length)
    ids = torch.zeros(1 if packed else max(1, rows), length, dtype=torch.long)
    pos = torch.arange(length).unsqueeze(0).expand(ids.shape[0], length).contiguous()
    zeros = torch.zeros(0, 0, dtype=torch.int64)
    return MicroInputs(empty, ids, pos, pack_params([length]) if packed else None, zeros,
                       torch.zeros(ids.numel(), dtype=torch.long), torch.zeros(0, dtype=torch.int64), zeros.float())


def micro_inputs(batch: TokenBatch, packed: bool, pad_to_multiple: int = 1, length: int = 0,
                 rows: int = 0, cp: int = 1, cp_rank: int = 0) -> MicroInputs:
    if packed and cp > 1:
        return cp_packed_inputs(batch, cp, cp_rank, pad_to_multiple, length)
    return packed_inputs(batch, pad_to_multiple, length) if packed else padded_inputs(batch, length=length, rows=rows)


def common_shape(batches: list[TokenBatch], packed: bool, cp: int = 1) -> tuple[int, int]:
    """``(length, rows)`` every micro-batch fits in: packed ``(max T, 1)`` (CP: sequences padded to
    multiples of ``2 cp``), padded ``(max L, max b)``."""
    if packed:
        from megarl.models.context_parallel import cp_padded_len

        return max((sum(cp_padded_len(n, cp) for n in b.seq_lens.tolist()) for b in batches), default=1), 1
    return (max((int(b.seq_lens.max()) for b in batches if len(b)), default=1),
            max((len(b) for b in batches), default=1))
