"""The batch a Megatron worker sees: token sequences plus response-aligned tensors.

A sample is ``prompt_ids + response_ids``; every per-token quantity of RL (logprobs, advantages,
values, masks) is indexed by *response* position and right-padded to ``[B, R]``. Keeping sequences
as lists and only padding inside a micro-batch is what makes token-budget (dynamic) batching cheap:
a micro-batch pads to its own longest sample, not the batch's.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SequenceBatch:
    sequences: list[list[int]]
    prompt_lens: list[int]
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # each [B, R], response-aligned
    # per-sample objects of any shape, e.g. "routed_experts": int [n_i, layers, top_k] per sample
    # (MoE routing replay), selected along with the samples
    extras: dict[str, list] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.sequences) != len(self.prompt_lens):
            raise ValueError("sequences and prompt_lens differ in length")
        for i, (seq, plen) in enumerate(zip(self.sequences, self.prompt_lens)):
            if not 0 < plen < len(seq) + 1:
                raise ValueError(f"sample {i}: prompt length {plen} outside sequence of {len(seq)} tokens")

    def __len__(self) -> int:
        return len(self.sequences)

    @property
    def response_lens(self) -> list[int]:
        return [len(s) - p for s, p in zip(self.sequences, self.prompt_lens)]

    @property
    def max_response_len(self) -> int:
        return max(self.response_lens, default=0)

    def response_mask(self) -> torch.Tensor:
        lens = torch.tensor(self.response_lens)
        return (torch.arange(self.max_response_len).unsqueeze(0) < lens.unsqueeze(1)).float()

    def select(self, index: list[int]) -> "SequenceBatch":
        """A sub-batch; response tensors are cut to the sub-batch's own longest response."""
        seqs = [self.sequences[i] for i in index]
        plens = [self.prompt_lens[i] for i in index]
        width = max((len(s) - p for s, p in zip(seqs, plens)), default=0)
        idx = torch.tensor(index, dtype=torch.long)
        return SequenceBatch(seqs, plens, {k: v.index_select(0, idx)[:, :width] for k, v in self.tensors.items()},
                             {k: [v[i] for i in index] for k, v in self.extras.items()})


def pad_inputs(batch: SequenceBatch, pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``[b, L]`` right-padded input ids and position ids. Causal attention means right padding
    never changes the logits of real tokens, so no attention mask is needed."""
    length = max(len(s) for s in batch.sequences)
    ids = torch.full((len(batch), length), pad_id, dtype=torch.long)
    for i, seq in enumerate(batch.sequences):
        ids[i, : len(seq)] = torch.tensor(seq, dtype=torch.long)
    positions = torch.arange(length).unsqueeze(0).expand(len(batch), length).contiguous()
    return ids, positions


def response_positions(batch: SequenceBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """For response token j of sample i: the position whose output predicts it (``P_i + j - 1``)
    and the token id itself, both ``[b, R]`` (padding points at position 0 / token 0)."""
    width = batch.max_response_len
    pos = torch.zeros(len(batch), width, dtype=torch.long)
    tgt = torch.zeros(len(batch), width, dtype=torch.long)
    for i, (seq, plen) in enumerate(zip(batch.sequences, batch.prompt_lens)):
        n = len(seq) - plen
        pos[i, :n] = torch.arange(plen - 1, plen - 1 + n)
        tgt[i, :n] = torch.tensor(seq[plen:], dtype=torch.long)
    return pos, tgt


def split_by_token_budget(lengths: list[int], max_tokens: int, max_samples: int = 0) -> list[list[int]]:
    """Dynamic batching: group sample indices so each micro-batch's padded size
    (samples x longest) stays within ``max_tokens``. Samples are taken longest-first so similar
    lengths share a micro-batch (little padding); the grouping is deterministic. A sample longer
    than the budget gets a micro-batch of its own."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
    current: list[int] = []
    for i in order:
        longest = max([lengths[j] for j in current] + [lengths[i]])
        too_many = max_samples and len(current) >= max_samples
        if current and (longest * (len(current) + 1) > max_tokens or too_many):
            groups.append(current)
            current = []
        current.append(i)
    if current:
        groups.append(current)
    return groups


def split_fixed(num: int, micro_batch_size: int) -> list[list[int]]:
    return [list(range(i, min(i + micro_batch_size, num))) for i in range(0, num, micro_batch_size)]
