"""Deterministic, resumable prompt batches.

The order of epoch ``e`` is a permutation drawn from ``seed + e`` alone, so the loader's whole
state is (epoch, position): a resumed run draws exactly the prompts an uninterrupted one would.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from megarl.data.records import PromptRecord


class PromptLoader:
    def __init__(self, records: Sequence[PromptRecord], batch_size: int, seed: int, shuffle: bool = True):
        if not records:
            raise ValueError("the prompt dataset is empty")
        if batch_size < 1:
            raise ValueError("batch_size must be >= 1")
        self.records = list(records)
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(len(self.records)))
        generator = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(len(self.records), generator=generator).tolist()

    def next_batch(self) -> list[PromptRecord]:
        batch: list[PromptRecord] = []
        while len(batch) < self.batch_size:
            if self.position >= len(self._order):
                self.epoch += 1
                self.position = 0
                self._order = self._epoch_order(self.epoch)
            batch.append(self.records[self._order[self.position]])
            self.position += 1
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "size": len(self.records)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("size") != len(self.records):
            raise ValueError(f"data changed since the checkpoint: {state.get('size')} records then, {len(self.records)} now")
        self.seed = state["seed"]
        self.epoch = state["epoch"]
        self.position = state["position"]
        self._order = self._epoch_order(self.epoch)
