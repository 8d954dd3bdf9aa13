"""Rewards are scored by a pool of workers, in input order: a slow user function does not
serialise the batch (threads), CPU-bound scorers can run in processes, and the trainer's
rule rewards pickle for the process pool."""
from __future__ import annotations

import pickle

import pytest

from megarl.rewards import RewardPool, build_reward_fn
from tests.helpers.rewards import OVERLAP, overlapping_length_reward, slow_length_reward


def test_thread_pool_overlaps_a_slow_function_and_keeps_order():
    """Each call returns only once 4 calls run at once (a barrier): the pool overlaps them on any
    machine, where a timing check (16 calls of 0.3 s in under 1.6 s) assumed a quick one."""
    texts = [("x" * n) for n in range(16)]
    records = list(range(16))
    assert 16 % OVERLAP == 0   # every call's barrier round fills
    with RewardPool(overlapping_length_reward, workers=8, executor="thread") as pool:
        scores = pool.score(texts, records)
    assert scores == [float(n) + 0.001 * n for n in range(16)]


def test_process_pool_keeps_order_and_inline_mode_matches():
    texts = [("y" * n) for n in range(10)]
    with RewardPool(slow_length_reward, workers=4, executor="process") as pool:
        scores = pool.score(texts, list(range(10)))
    assert scores == [float(n) + 0.001 * n for n in range(10)]
    assert RewardPool(slow_length_reward, workers=0).score(texts[:2], [0, 1]) == scores[:2]
    with pytest.raises(ValueError, match="reward.executor"):
        RewardPool(slow_length_reward, executor="gpu")


def test_rule_rewards_pickle_for_process_workers():
    from megarl.config.schema import RewardConfig

    fn = build_reward_fn(RewardConfig(kind="rule", rule="exact"))
    assert pickle.loads(pickle.dumps(fn)) is not None
