"""Samples without a reward, batch by batch: what the step learns from, what it counts, when it stops.

A failed sample (``Sample.failure``: a scorer that raised or timed out, a judge without a grade, an
environment that crashed) is never a 0. The step

* leaves it out of the advantage: the estimators get ``valid`` (group statistics over the valid
  samples of each group; a group with fewer than 2 valid samples gets advantage 0);
* leaves it out of the loss: its loss mask is 0 (``rollout.sample.token_batch``);
* leaves it out of dynamic sampling's verdict (a group's signal is its valid rewards' spread);
* counts it: ``reward/failed_frac``, ``reward/failed`` and ``reward/failed_by_reason/<reason>``.

A batch in which every sample failed has nothing to train on: the step skips its Megatron passes
(the weights stay as they are; the push still runs, so weight versions advance as every step's do),
logs ``reward/all_failed_step`` = 1, and after ``reward.max_failed_steps`` such steps in a row the
run stops with :class:`RewardsUnavailable` -- a judge or verifier that is down does not quietly
burn the run's budget.
"""
from __future__ import annotations

import collections
from typing import Sequence

import torch

from megarl.errors import UserError
from megarl.metrics_log import note
from megarl.rollout.sample import Sample


class RewardsUnavailable(UserError, RuntimeError):
    """Every sample of ``reward.max_failed_steps`` consecutive batches has no reward (the reward
    source is down or misconfigured); the message names the reasons and one example."""


def valid_mask(samples: Sequence[Sample]) -> torch.Tensor:
    """``[batch]`` bool: the samples that have a reward."""
    return torch.tensor([not s.failed for s in samples], dtype=torch.bool)


def valid_rewards(samples: Sequence[Sample]) -> list[float]:
    """The rewards of the samples that have one (what a group filter may compare)."""
    return [s.reward for s in samples if not s.failed]


def failure_metrics(samples: Sequence[Sample]) -> dict[str, float]:
    """Failed samples of a batch: the share, the count, and the count per reason."""
    reasons = collections.Counter(s.failure.reason for s in samples if s.failure is not None)
    failed = sum(reasons.values())
    out = {"reward/failed_frac": failed / len(samples) if samples else 0.0, "reward/failed": float(failed)}
    out.update({f"reward/failed_by_reason/{r}": float(n) for r, n in sorted(reasons.items())})
    return out


def failure_summary(samples: Sequence[Sample]) -> str:
    """One line: how many samples failed, per reason, with the first message of each reason."""
    first: dict[str, str] = {}
    counts: collections.Counter = collections.Counter()
    for s in samples:
        if s.failure is not None:
            counts[s.failure.reason] += 1
            first.setdefault(s.failure.reason, s.failure.message)
    parts = [f"{r} x{n} ({first[r]})" if first[r] else f"{r} x{n}" for r, n in counts.most_common()]
    return f"{sum(counts.values())} of {len(samples)} samples have no reward: " + "; ".join(parts)


class FailedBatches:
    """Counts batches in which every sample failed; the trainer asks it whether a batch can train."""

    def __init__(self, max_consecutive: int):
        self.max_consecutive = max_consecutive
        self.consecutive = 0

    def trainable(self, samples: Sequence[Sample], step: int) -> bool:
        """False when no sample of the batch has a reward (the step skips training); raises
        :class:`RewardsUnavailable` once that happened ``max_consecutive`` times in a row. Notes
        every batch with failures in one line."""
        failed = sum(s.failed for s in samples)
        if failed:
            note(f"step {step}: {failure_summary(samples)}")
        if failed < len(samples):
            self.consecutive = 0
            return True
        self.consecutive += 1
        if self.max_consecutive and self.consecutive >= self.max_consecutive:
            raise RewardsUnavailable(
                f"step {step}: no sample had a reward in {self.consecutive} consecutive steps "
                f"(reward.max_failed_steps = {self.max_consecutive}); last batch: {failure_summary(samples)}")
        note(f"step {step}: every sample failed -- no training this step, weights unchanged "
             f"({self.consecutive} in a row; the run stops at reward.max_failed_steps = {self.max_consecutive})")
        return False
