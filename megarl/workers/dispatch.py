"""Driver side of the data path: a batch becomes one shard per data-parallel group, and the
groups' results become one tensor again.

A :class:`Shard` is what one data-parallel group needs for one call: its samples (a
:class:`~megarl.data.batch.TokenBatch` holding only the fields the call reads), the size of each
micro-batch per mini-batch (:func:`megarl.data.packing.plan_shards`) and the mini-batches' global
loss denominators. The :class:`~megarl.workers.group.WorkerGroup` puts each shard into Ray's object
store once and hands the same reference to every rank of that group's model-parallel ranks
(TP x PP x CP): bytes per rank are about 1/dp of the batch. Results come back per group as flat
tensors in shard order and :func:`unshard` puts them back into batch order.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch
from torch import Tensor

from megarl.data.batch import TokenBatch, lengths_to_offsets, segment_index
from megarl.data.packing import ShardPlan


@dataclass
class Shard:
    batch: TokenBatch
    micro_sizes: list[list[int]]                  # per mini-batch: samples in each micro-batch (0 = empty)
    denominators: list[dict[str, float]] = field(default_factory=list)   # per mini-batch (training)

    def to_payload(self) -> dict[str, Any]:
        return {"batch": self.batch.to_payload(), "micro_sizes": self.micro_sizes,
                "denominators": self.denominators}

    @classmethod
    def from_payload(cls, payload: "dict[str, Any] | Shard") -> "Shard":
        if isinstance(payload, Shard):
            return payload
        return cls(TokenBatch.from_payload(payload["batch"]), payload["micro_sizes"], payload["denominators"])

    def minibatches(self) -> list[list[TokenBatch]]:
        """Per mini-batch, its micro-batches as TokenBatches (empty ones included)."""
        out, start = [], 0
        for sizes in self.micro_sizes:
            micro = []
            for n in sizes:
                micro.append(self.batch.select(torch.arange(start, start + n)))
                start += n
            out.append(micro)
        if start != len(self.batch):
            raise ValueError(f"shard has {len(self.batch)} samples, its micro-batches {start}")
        return out


def make_shards(batch: TokenBatch, plan: ShardPlan, fields: Sequence[str] = (),
                denominators: Optional[list[dict[str, float]]] = None) -> list[Shard]:
    """One shard per data-parallel rank of ``plan``, holding only ``fields``."""
    slim = batch.with_fields(fields)
    return [Shard(slim.select(plan.samples[r]), plan.micro_sizes[r], list(denominators or []))
            for r in range(plan.dp)]


def unshard(batch: TokenBatch, plan: ShardPlan, per_rank: list[Tensor], per: str = "token") -> Tensor:
    """Concatenated per-rank results (each in its shard's sample order) back in batch order.
    ``per="token"``: one entry per response token; ``per="sample"``: one per sample."""
    order = torch.tensor([i for r in range(plan.dp) for i in plan.samples[r]], dtype=torch.int64)
    values = torch.cat(per_rank) if per_rank else torch.zeros(0)
    if per == "sample":
        out = torch.empty(len(batch), dtype=values.dtype)
        if values.numel() != order.numel():
            raise RuntimeError(f"{values.numel()} per-sample results for {order.numel()} samples")
        out[order] = values
        return out
    offsets = batch.response_offsets
    index = segment_index(offsets, order)
    if values.numel() != index.numel():
        raise RuntimeError(f"{values.numel()} per-token results for {index.numel()} response tokens")
    out = torch.empty(int(offsets[-1]), dtype=values.dtype)
    out[index] = values
    return out


__all__ = ["Shard", "lengths_to_offsets", "make_shards", "unshard"]
