"""A reward that could not be computed is a failure, never a score.

Why: a grader that times out, a judge server that is down, a reward function that raises or a
sandbox that crashes says nothing about the response. Scoring such a sample 0 teaches the policy
that its answer was wrong -- infrastructure noise becomes a learning signal (a few percent of fake
zeros shift every group's mean and flip advantages). A failed sample is therefore marked with a
reason and kept out of the advantage and the loss (``megarl/rollout/failures.py``), and counted.

Scorers say "no reward" in one of two ways:

* raise :class:`RewardFailed` (or any exception: a reward function that raises is a failure too,
  reason ``error``) -- the pool turns it into a :class:`Failure`;
* return a :class:`Failure` directly (batch scorers such as the judge, which see many samples at
  once and must not fail them all for one bad answer).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Union

from megarl.errors import failure_reason

_MESSAGE_CHARS = 300


class RewardFailed(RuntimeError):
    """The reward of a sample could not be computed (not: the response is wrong). ``reason`` is a
    short key counted in the metrics (``reward/failed_by_reason/<reason>``)."""

    reason = "error"

    def __init__(self, message: str, reason: str | None = None):
        super().__init__(message)
        if reason is not None:
            self.reason = reason


@dataclass(frozen=True)
class Failure:
    """Why one sample has no reward: a metric key and a one-line message (picklable: scorers in
    worker processes return it)."""

    reason: str
    message: str = ""


Score = Union[float, Failure]


def failure_of(err: BaseException, other: str = "error") -> Failure:
    """The failure an exception of a scorer stands for: the reason it declares (a
    :class:`RewardFailed`, a sandbox crash: ``megarl.errors.failure_reason``), else ``other``, with
    the exception's type and words."""
    reason = failure_reason(err) or other
    text = f"{type(err).__name__}: {err}"
    return Failure(reason, text[:_MESSAGE_CHARS])


def checked_score(value: object) -> Score:
    """A scorer's answer as a :class:`Score`: a finite float, or a failure (``nonfinite`` for nan/inf,
    ``not_a_number`` for anything that is not a number)."""
    if isinstance(value, Failure):
        return value
    try:
        score = float(value)   # type: ignore[arg-type]
    except (TypeError, ValueError):
        return Failure("not_a_number", f"the reward function returned {type(value).__name__} {str(value)[:80]!r}")
    if not math.isfinite(score):
        return Failure("nonfinite", f"the reward function returned {score}")
    return score
