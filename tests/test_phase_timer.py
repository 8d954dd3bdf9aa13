"""`PhaseTimer`: ``time/step_s`` is the step's wall clock, not the sum of its phases.

Why a test: the one-GPU benchmarks reported the sum of the phases as the step, and the servers'
memory release ran between two phases -- ~0.19 s per step that no number showed."""
from __future__ import annotations

import time

from megarl.metrics_log import PhaseTimer


def test_step_time_counts_the_work_between_phases():
    timer = PhaseTimer()
    with timer("rollout"):
        time.sleep(0.05)
    time.sleep(0.08)                 # between phases: batch building, a release that is not a phase
    with timer("train"):
        time.sleep(0.05)
    m = timer.metrics(tokens=100.0)
    phases = m["time/rollout_s"] + m["time/train_s"]
    assert m["time/step_s"] >= phases + 0.08
    assert m["time/other_s"] == m["time/step_s"] - phases
    assert m["throughput/train_tokens_per_s"] == 100.0 / m["time/train_s"]
