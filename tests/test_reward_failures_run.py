"""A run whose reward function raises for every sample does not crash at once and never trains on
zeros: each such step trains nothing (weights unchanged, the push still runs), logs
``reward/all_failed_step`` and the failures by reason, and ``reward.max_failed_steps`` of them in a
row stop the run with RewardsUnavailable, a one-line user error naming the reason."""
from __future__ import annotations

import pytest

from megarl.errors import find_user_error
from megarl.rollout.failures import RewardsUnavailable
from megarl.trainer import Trainer
from tests.helpers.runs import tiny_model, tiny_run_config

pytestmark = pytest.mark.e2e


def test_steps_without_any_reward_train_nothing_then_stop_the_run(tmp_path):
    model = tiny_model(tmp_path / "models")
    cfg = tiny_run_config(model, tmp_path / "run", "trainer.total_steps=3", "trainer.eval_before_after=false",
                          "checkpoint.export_hf=false", "checkpoint.final=false", "reward.max_failed_steps=2",
                          "reward.retries=1", "reward.function=tests.helpers.rewards:verifier_down")
    trainer = Trainer(cfg)
    logged: list[dict] = []
    step = trainer.step

    def recorded(n: int) -> dict:
        logged.append(step(n))
        return logged[-1]

    trainer.step = recorded
    with pytest.raises(RewardsUnavailable, match=r"step 1: no sample had a reward in 2 consecutive steps.*"
                                                 r"error x16 \(ConnectionError: verifier at 10.0.0.7") as err:
        trainer.run()
    assert find_user_error(err.value) is err.value                   # the CLI prints it as one line
    assert len(logged) == 1                                          # step 0 ran, step 1 raised
    first = logged[0]
    assert first["reward/all_failed_step"] == 1.0 and first["reward/failed_frac"] == 1.0
    assert first["reward/failed_by_reason/error"] == 16.0
    assert "time/train_s" not in first and "time/old_logprobs_s" not in first   # no Megatron pass
    assert "time/sync_s" in first and "reward/mean" not in first                # the push ran; no fake reward
