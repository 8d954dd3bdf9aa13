"""Reward functions that freeze a run at a chosen point (the watchdog tests): one stops a Megatron
rank, one never returns.

Why a reward function: it runs inside the rollout phase, so the rank is stopped at a known point of
the step (its Megatron ranks idle), whatever the machine's speed; the first Megatron pass after it
is where the run hangs. Set in the trainer's environment:

  MEGARL_TEST_STOP_RANK   file-name prefix of the rank to stop, e.g. "actor_rank1_" (the watchdog's
                          per-rank files in OUTPUT_DIR/watchdog/ranks/ carry the pid)
  MEGARL_TEST_STOP_AFTER  calls to score normally first (a step's samples: stop in the next step)
  MEGARL_TEST_STOP_DIR    OUTPUT_DIR/watchdog/ranks
"""
from __future__ import annotations

import fcntl
import os
import signal
from pathlib import Path


def stop_rank_after_calls(text: str, record) -> float:
    """Score like ``distinct_token_reward``; the call after MEGARL_TEST_STOP_AFTER calls SIGSTOPs the
    rank (once: calls are counted in a locked file, reward threads and processes alike)."""
    folder = Path(os.environ["MEGARL_TEST_STOP_DIR"])
    counter = folder.parent / "test_reward_calls"
    with open(counter, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        calls = len(f.read()) + 1
        f.write("x")
    if calls == int(os.environ["MEGARL_TEST_STOP_AFTER"]) + 1:
        prefix = os.environ["MEGARL_TEST_STOP_RANK"]
        (target,) = [p for p in folder.iterdir() if p.name.startswith(prefix)]
        pid = int(target.stem.rsplit("_pid", 1)[1])
        os.kill(pid, signal.SIGSTOP)
        (folder.parent / "test_stopped_pid").write_text(str(pid))
    return len(set(text)) / 10.0


def hang_after_calls(text: str, record) -> float:
    """Score like ``distinct_token_reward``; the call after MEGARL_TEST_STOP_AFTER calls never returns
    (a verifier in an endless loop) -- the rollout phase hangs with every rank idle and healthy."""
    folder = Path(os.environ["MEGARL_TEST_STOP_DIR"])
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "test_reward_calls", "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        calls = len(f.read()) + 1
        f.write("x")
    if calls == int(os.environ["MEGARL_TEST_STOP_AFTER"]) + 1:
        import time

        time.sleep(3600)
    return len(set(text)) / 10.0
