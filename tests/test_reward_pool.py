"""Rewards are scored by a pool of workers, in input order: a slow user function does not
serialise the batch (threads), CPU-bound scorers can run in processes, and the trainer's
rule rewards pickle for the process pool."""
from __future__ import annotations

import pickle

import pytest

from megarl.rewards import RewardPool, build_reward_fn
from tests.helpers.rewards import OVERLAP, hangs_on_marked_records, hangs_once, overlapping_length_reward, slow_length_reward


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


@pytest.mark.parametrize("executor", ["thread", "process"])
def test_a_hanging_reward_function_fails_its_sample_and_the_batch_goes_on(executor):
    """Two samples hang forever: they come back as failures with reason timeout (never a 0), the
    others are scored, and the pool serves the next batch (the hung worker was dropped)."""
    from megarl.rewards.failures import Failure

    texts = ["a", "bb", "ccc", "dddd", "eeeee"]
    records = [0, "hang", 2, "hang", 4]
    with RewardPool(hangs_on_marked_records, workers=2, executor=executor, timeout_s=1.0) as pool:
        scores = pool.score(texts, records)
        assert [s if not isinstance(s, Failure) else s.reason for s in scores] == [1.0, "timeout", 3.0, "timeout", 5.0]
        assert "reward.timeout_s=1" in scores[1].message
        assert pool.score(["xy", "z"], [0, 1]) == [2.0, 1.0]


@pytest.mark.parametrize("executor", ["thread", "process"])
def test_a_process_whose_reward_call_hung_still_exits(executor):
    """The interpreter must not wait at exit for a hung call: an abandoned daemon thread is not
    joined, and a hung worker process is killed (a process pool's exit hook joins every worker,
    which once held a finished test run open until CI's limit)."""
    import subprocess
    import sys

    code = ("from megarl.rewards import RewardPool\n"
            "from tests.helpers.rewards import hangs_on_marked_records as f\n"
            f"p = RewardPool(f, workers=2, executor={executor!r}, timeout_s=0.5)\n"
            "print(p.score(['a', 'b'], ['hang', 1])[1])\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "1.0"
    if executor == "thread":
        assert "abandoned" in done.stderr


@pytest.mark.parametrize("executor", ["thread", "process"])
def test_a_transient_hang_is_tried_again_within_the_retries(executor, tmp_path):
    """reward.retries covers a call past its deadline too: tried again in a fresh pool, it scores;
    without retries the sample fails with reason timeout."""
    from megarl.rewards.failures import Failure

    with RewardPool(hangs_once, workers=2, executor=executor, timeout_s=1.0, retries=1) as pool:
        assert pool.score(["ab", "cde", "f"], [0, {"once": str(tmp_path / "a")}, 2]) == [2.0, 3.0, 1.0]
    with RewardPool(hangs_once, workers=2, executor=executor, timeout_s=1.0, retries=0) as pool:
        scores = pool.score(["ab", "cde"], [0, {"once": str(tmp_path / "b")}])
        assert scores[0] == 2.0 and isinstance(scores[1], Failure) and scores[1].reason == "timeout"


def test_a_nonpositive_deadline_is_refused_naming_the_field():
    with pytest.raises(ValueError, match="reward.timeout_s"):
        RewardPool(slow_length_reward, timeout_s=0)


def test_the_run_config_deadline_reaches_the_pool(tmp_path):
    from megarl.config import load_config
    from megarl.rollout.pipeline import reward_pool
    from tests.helpers.runs import DEFAULT

    cfg = load_config(DEFAULT, [f"output_dir={tmp_path}", "reward.kind=rule", "reward.rule=exact", "reward.timeout_s=7"])
    assert reward_pool(cfg).timeout_s == 7.0
