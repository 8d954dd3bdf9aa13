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

import numpy as np

from megarl.data.batch import TokenBatch, lengths_to_offsets, segment_index
from megarl.data.packing import ShardPlan


@dataclass
class Shard:
    """``batch`` holds the group's samples in batch order (so a run of consecutive samples is a
    zero-copy view on the driver); ``order`` lists them (shard positions) in execution order, cut
    into micro-batches by ``micro_sizes``."""

    batch: TokenBatch
    order: list[int]
    micro_sizes: list[list[int]]                  # per mini-batch: samples in each micro-batch (0 = empty)
    denominators: list[dict[str, float]] = field(default_factory=list)   # per mini-batch (training)

    def to_payload(self) -> dict[str, Any]:
        return {"batch": self.batch.to_payload(), "order": np.asarray(self.order, dtype=np.int64),
                "micro_sizes": self.micro_sizes, "denominators": self.denominators}

    @classmethod
    def from_payload(cls, payload: "dict[str, Any] | Shard") -> "Shard":
        if isinstance(payload, Shard):
            return payload
        return cls(TokenBatch.from_payload(payload["batch"]), [int(i) for i in payload["order"]],
                   payload["micro_sizes"], payload["denominators"])

    def minibatches(self) -> list[list[TokenBatch]]:
        """Per mini-batch, its micro-batches as TokenBatches (empty ones included)."""
        out, start = [], 0
        for sizes in self.micro_sizes:
            micro = []
            for n in sizes:
                micro.append(self.batch.select(self.order[start:start + n]))
                start += n
            out.append(micro)
        if start != len(self.order):
            raise ValueError(f"shard lists {len(self.order)} samples, its micro-batches {start}")
        return out

    def to_batch_order(self, values: Tensor, per: str = "token") -> Tensor:
        """Results computed in execution order (one pass over ``order``) back in shard batch order."""
        if per == "sample":
            out = torch.empty_like(values)
            out[torch.tensor(self.order, dtype=torch.int64)] = values
            return out
        executed = self.batch.select(self.order)
        back = sorted(range(len(self.order)), key=lambda k: self.order[k])  # position in executed of sample i
        return TokenBatch(executed.tokens, executed.seq_offsets, executed.prompt_lens,
                          {"v": values}).select(back).token_fields["v"]


def make_shards(batch: TokenBatch, plan: ShardPlan, fields: Sequence[str] = (),
                denominators: Optional[list[dict[str, float]]] = None) -> list[Shard]:
    """One shard per data-parallel rank of ``plan``, holding only ``fields``: its samples in batch
    order (views when consecutive) plus their execution order."""
    slim = batch.with_fields(fields)
    return [shard_of(slim, plan.samples[r], plan.micro_sizes[r], denominators) for r in range(plan.dp)]


def shard_of(batch: TokenBatch, samples: Sequence[int], micro_sizes: list[list[int]],
             denominators: Optional[list[dict[str, float]]] = None) -> Shard:
    """The shard of samples ``samples`` (execution order) of ``batch``. A permutation of one range of
    samples (a forward pass, a training pass over stratified mini-batches) is a view of ``batch``."""
    samples = list(samples)
    if samples:
        lo, hi = min(samples), max(samples)
        if hi - lo + 1 == len(samples) == len(set(samples)):
            return Shard(batch.slice(lo, hi + 1), [i - lo for i in samples], micro_sizes, list(denominators or []))
    ordered = sorted(set(samples))
    pos = {i: k for k, i in enumerate(ordered)}
    return Shard(batch.select(ordered), [pos[i] for i in samples], micro_sizes, list(denominators or []))


def unshard(batch: TokenBatch, plan: ShardPlan, per_rank: list[Tensor], per: str = "token") -> Tensor:
    """Per-rank results of a forward pass (each in its shard's batch order, see
    :meth:`Shard.to_batch_order`) back in batch order. ``per="token"``: one entry per response token;
    ``per="sample"``: one per sample. Consecutive shards (forward passes) are just concatenated."""
    ids = [i for r in range(plan.dp) for i in sorted(set(plan.samples[r]))]
    values = torch.cat(per_rank) if per_rank else torch.zeros(0)
    if ids == list(range(len(batch))):
        expected = len(batch) if per == "sample" else int(batch.response_lens.sum())
        if values.numel() != expected:
            raise RuntimeError(f"{values.numel()} per-{per} results for {expected}")
        return values
    order = torch.tensor(ids, dtype=torch.int64)
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


__all__ = ["Shard", "lengths_to_offsets", "make_shards", "shard_of", "unshard"]
