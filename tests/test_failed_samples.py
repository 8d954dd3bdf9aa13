"""A sample whose reward could not be computed is failed, never 0: the estimators leave it out
(group statistics over the valid samples, a group with < 2 valid samples gets 0), its loss mask is
0, dynamic sampling and the reward statistics ignore it, the metrics count it by reason, a reward
pool turns any scorer error (raised, nan, a dead worker) into a failure after its retries, and a
batch with no reward at all trains nothing until ``reward.max_failed_steps`` stops the run."""
from __future__ import annotations

import math
import os

import pytest
import torch

from megarl.algos import get_advantage_estimator
from megarl.algos.filters import group_has_signal
from megarl.algos.metrics import batch_summary
from megarl.config.schema import RunConfig
from megarl.data.batch import LOSS_MASK
from megarl.rewards import RewardPool
from megarl.rewards.failures import Failure, RewardFailed, checked_score
from megarl.rollout.failures import (FailedBatches, RewardsUnavailable, failure_metrics, valid_mask,
                                     valid_rewards)
from megarl.rollout.pipeline import SampleScorer
from megarl.rollout.sample import Sample, token_batch

pytestmark = pytest.mark.unit
D = torch.float64
NAN = float("nan")


def grpo(rewards, mask, group_ids, valid=None, **kw):
    return get_advantage_estimator("grpo")(torch.tensor(rewards, dtype=D), mask, group_ids=torch.tensor(group_ids),
                                           valid=None if valid is None else torch.tensor(valid), **kw)


def test_grpo_leaves_failed_samples_out_of_their_groups_statistics():
    mask = torch.ones(8, 3, dtype=D)
    mask[1, 2] = 0
    # group 0: samples 0..3, sample 2 failed (nan); group 1: samples 4..7, only sample 5 valid
    rewards = [1.0, 0.0, NAN, 0.5, 1.0, 0.25, NAN, NAN]
    valid = [True, True, False, True, False, True, False, False]
    rewards[4] = NAN
    adv, ret = grpo(rewards, mask, [0, 0, 0, 0, 1, 1, 1, 1], valid)
    # by hand: group 0's valid rewards 1, 0, 0.5 -> mean 0.5, unbiased std 0.5
    eps = 1e-6
    assert torch.allclose(adv[0], torch.full((3,), 0.5 / (0.5 + eps), dtype=D))
    assert torch.allclose(adv[1, :2], torch.full((2,), -0.5 / (0.5 + eps), dtype=D)) and adv[1, 2] == 0
    assert torch.equal(adv[3], torch.zeros(3, dtype=D))
    assert torch.equal(adv[2], torch.zeros(3, dtype=D))               # failed: no advantage, not nan
    assert torch.equal(adv[4:], torch.zeros(4, 3, dtype=D))           # one valid sample: nothing to compare with
    assert not torch.isnan(ret).any()
    # the same as the group of the valid samples alone
    alone, _ = grpo([1.0, 0.0, 0.5], torch.ones(3, 3, dtype=D), [0, 0, 0])
    assert torch.allclose(adv[[0, 3], 0], alone[[0, 2], 0]) and torch.allclose(adv[1, 0], alone[1, 0])


@pytest.mark.parametrize("name", ["dr_grpo", "rloo", "reinforce_plus_plus_baseline"])
def test_group_estimators_equal_the_valid_samples_alone(name):
    fn = get_advantage_estimator(name)
    r = torch.tensor([1.0, NAN, 0.0, 0.25, 2.0, 1.0, NAN, 3.0], dtype=D)
    valid = ~torch.isnan(r)
    ids = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    got, _ = fn(r, torch.ones(8, 2, dtype=D), group_ids=ids, valid=valid)
    keep = valid.nonzero().squeeze(-1)
    alone, _ = fn(r[keep], torch.ones(len(keep), 2, dtype=D), group_ids=ids[keep])
    assert torch.allclose(got[keep], alone)   # reinforce++_baseline: its batch whitening over valid tokens too
    assert torch.equal(got[~valid], torch.zeros(2, 2, dtype=D))


@pytest.mark.parametrize("name", ["reinforce_plus_plus", "gae", "remax"])
def test_token_estimators_drop_failed_rows(name):
    fn = get_advantage_estimator(name)
    r = torch.tensor([1.0, NAN, 0.0, 0.5], dtype=D)
    valid = ~torch.isnan(r)
    mask = torch.ones(4, 3, dtype=D)
    kw = {}
    if name == "gae":
        kw["values"] = torch.tensor([[0.1, 0.2, 0.3]] * 4, dtype=D)
    if name == "remax":
        kw["baseline_rewards"] = torch.tensor([0.5, 0.5, NAN, 0.25], dtype=D)   # sample 2's greedy baseline failed
    got, ret = fn(r, mask, valid=valid, **kw)
    keep = [0, 3] if name == "remax" else [0, 2, 3]
    sub = {k: v[keep] for k, v in kw.items()}
    alone, alone_ret = fn(r[keep], mask[keep], **sub)
    assert torch.allclose(got[keep], alone) and torch.allclose(ret[keep], alone_ret)
    dropped = [i for i in range(4) if i not in keep]
    assert torch.equal(got[dropped], torch.zeros(len(dropped), 3, dtype=D))
    assert not torch.isnan(got).any() and not torch.isnan(ret).any()


def test_without_valid_every_estimator_is_unchanged():
    r = torch.tensor([1.0, 0.0, 0.5, 0.25], dtype=D)
    mask = torch.ones(4, 2, dtype=D)
    for name in ("grpo", "dr_grpo", "rloo"):
        fn = get_advantage_estimator(name)
        a, _ = fn(r, mask, group_size=2)
        b, _ = fn(r, mask, group_size=2, valid=torch.ones(4, dtype=torch.bool))
        assert torch.equal(a, b), name


def _sample(reward=0.0, group=0, n=3, failure=None, loss_mask=None):
    s = Sample(None, group, [1, 2], list(range(5, 5 + n)), [-0.1] * n, "stop", reward, text="x" * n,
               loss_mask=loss_mask or [])
    if failure:
        s.fail(Failure(failure, f"{failure} happened"))
    return s


def test_failed_samples_are_masked_counted_and_not_rewards():
    samples = [_sample(1.0), _sample(failure="judge_timeout"), _sample(0.0, n=2), _sample(failure="judge_timeout"),
               _sample(failure="error", loss_mask=[1, 0, 1])]
    assert math.isnan(samples[1].reward)                                  # never 0
    batch = token_batch(samples)
    mask = batch.loss_mask()
    assert mask.sum(-1).tolist() == [3, 0, 2, 0, 0]
    assert LOSS_MASK in batch.token_fields
    assert valid_mask(samples).tolist() == [True, False, True, False, False]
    assert valid_rewards(samples) == [1.0, 0.0]
    assert failure_metrics(samples) == {"reward/failed_frac": 0.6, "reward/failed": 3.0,
                                        "reward/failed_by_reason/error": 1.0,
                                        "reward/failed_by_reason/judge_timeout": 2.0}
    rewards = torch.tensor([s.reward for s in samples])
    summary = batch_summary(rewards, torch.tensor([3, 3, 2, 3, 3]), torch.zeros(5, dtype=torch.bool),
                            torch.zeros_like(mask), mask, valid_mask(samples))
    assert summary["reward/mean"] == 0.5 and summary["reward/min"] == 0.0 and summary["batch/samples"] == 5
    # a group whose only differing sample failed has no signal
    assert not group_has_signal(valid_rewards([_sample(1.0), _sample(failure="error"), _sample(1.0)]))


def test_loss_denominators_count_only_sequences_the_loss_covers():
    from megarl.data.packing import denominators

    mask = token_batch([_sample(1.0), _sample(failure="error"), _sample(0.0, n=2)]).loss_mask()
    assert denominators(mask, [[0, 1, 2]]) == [{"num_tokens": 5.0, "num_seqs": 2.0}]


def flaky(text, record):
    """Fails the first time it sees a text (a per-process memo), succeeds after."""
    seen = flaky.__dict__.setdefault("seen", set())
    if text not in seen:
        seen.add(text)
        raise ConnectionError("verifier busy")
    return float(len(text))


def raises_on_b(text, record):
    if "b" in text:
        raise ValueError("cannot grade b")
    if text == "nan":
        return float("nan")
    if text == "none":
        return None
    if text == "kill":
        os._exit(3)   # a worker process dies mid-chunk
    return float(len(text))


@pytest.mark.parametrize("executor", ["thread", "process"])
def test_the_pool_turns_scorer_errors_into_failures(executor):
    with RewardPool(raises_on_b, workers=2, executor=executor) as pool:
        got = pool.score(["aa", "abc", "nan", "none", "aaaa"], [None] * 5)
    assert got[0] == 2.0 and got[4] == 4.0
    assert isinstance(got[1], Failure) and got[1].reason == "error" and "cannot grade b" in got[1].message
    assert got[2].reason == "nonfinite" and got[3].reason == "not_a_number"


def test_retries_and_a_dead_worker():
    with RewardPool(flaky, workers=0, retries=1) as pool:
        assert pool.score(["abc", "de"], [None, None]) == [3.0, 2.0]
    flaky.seen.clear()
    with RewardPool(flaky, workers=0) as pool:
        assert [s.reason for s in pool.score(["xyz"], [None])] == ["error"]
    with RewardPool(raises_on_b, workers=1, executor="process") as pool:
        got = pool.score(["aa", "kill", "aaa"], [None] * 3)
        assert all(isinstance(s, Failure) and s.reason == "worker_crashed" for s in got if s != 2.0 and s != 3.0)
        assert any(isinstance(s, Failure) for s in got)
        assert pool.score(["aa"], [None]) == [2.0]                 # fresh workers after the crash


def test_checked_score_and_reward_failed_reason():
    assert checked_score(1) == 1.0 and checked_score(Failure("x")) == Failure("x")
    assert checked_score(float("inf")).reason == "nonfinite"
    assert RewardFailed("m", "judge_timeout").reason == "judge_timeout" and RewardFailed("m").reason == "error"


class _Pool:
    def __init__(self, scores):
        self.scores = scores

    def score(self, texts, records):
        return list(self.scores)

    def close(self):
        pass


def test_the_scorer_marks_failed_samples_and_shapes_only_the_valid_ones():
    cfg = RunConfig()
    cfg.algorithm.overlong.enabled = True
    cfg.algorithm.overlong.buffer_len = 2
    cfg.rollout.sampling.max_new_tokens = 3
    samples = [_sample(n=2), _sample(n=3), _sample(n=1)]
    SampleScorer(cfg, _Pool([1.0, Failure("judge_unparsable", "no grade"), 0.0]))(samples)
    # DAPO's soft overlong penalty at length 2 of 3 with a buffer of 2: (1 - 2) / 2
    assert samples[0].reward == pytest.approx(1.0 - 0.5) and samples[2].reward == 0.0
    assert samples[1].failed and math.isnan(samples[1].reward) and samples[1].failure.reason == "judge_unparsable"
    # a reward model's non-finite score is a failure too
    model = SampleScorer(cfg, None, lambda batch: torch.tensor([0.5, float("nan")]), eos_token_id=None)
    pair = [_sample(n=1), _sample(n=1)]
    model(pair)
    assert pair[0].reward == 0.5 and pair[1].failure.reason == "nonfinite"


def test_a_batch_without_rewards_trains_nothing_and_the_run_stops_after_n():
    guard = FailedBatches(max_consecutive=2)
    ok, bad = [_sample(1.0), _sample(failure="error")], [_sample(failure="judge_timeout")] * 2
    assert guard.trainable(ok, 0) and guard.consecutive == 0
    assert not guard.trainable(bad, 1) and guard.consecutive == 1
    assert guard.trainable(ok, 2) and guard.consecutive == 0        # a step with rewards resets the count
    assert not guard.trainable(bad, 3)
    with pytest.raises(RewardsUnavailable, match="2 consecutive steps.*judge_timeout x2"):
        guard.trainable(bad, 4)
    never = FailedBatches(max_consecutive=0)
    assert not any(never.trainable(bad, s) for s in range(5))


def test_an_environment_that_crashes_fails_its_trajectory_not_the_batch():
    """A sandbox that cannot start and a checker that raises end their own trajectories as failed
    samples (reasons sandbox_crashed, env_error); the other trajectories of the batch are scored."""
    import asyncio

    from transformers import AutoTokenizer

    from megarl.checkpoint.smollm2 import smollm2_hf_dir
    from megarl.data.records import PromptRecord
    from megarl.rollout.agent import AgentRollout, AgentSettings
    from tests.helpers.agent import ScriptedServer

    tok = AutoTokenizer.from_pretrained(str(smollm2_hf_dir()))
    eos = 2
    call = tok.encode('<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}</tool_call>',
                      add_special_tokens=False) + [eos]
    answer = tok.encode("The answer is 5.", add_special_tokens=False) + [eos]
    sampling = {"max_new_tokens": 100, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "stop_token_ids": [eos]}
    got = {}
    for env, script in (("tests.helpers.agent:CrashingSandboxEnv", [(call, "stop"), (answer, "stop")]),
                        ("tests.helpers.agent:ScoreRaisesEnv", [(answer, "stop")]),
                        ("calculator", [(answer, "stop")])):
        rollout = AgentRollout(ScriptedServer({0: script}), sampling, tok,
                               AgentSettings(env, max_turns=3, max_response_tokens=400))
        try:
            (got[env],) = asyncio.run(rollout._batch([PromptRecord("What is 2 + 3?", answer="5", index=0)], 1, 7,
                                                     sampling))
        finally:
            rollout.close()
    crashed, raised, fine = got.values()
    assert crashed.failure.reason == "sandbox_crashed" and "bwrap" in crashed.failure.message
    assert raised.failure.reason == "env_error" and "answer checker unreachable" in raised.failure.message
    assert math.isnan(crashed.reward) and math.isnan(raised.reward) and fine.reward == 1.0 and not fine.failed
    assert crashed.info["turns"] == 1 and len(crashed.response_ids) == len(call)   # the trajectory ends there
    assert token_batch([crashed, fine]).loss_mask().sum(-1)[0] == 0
