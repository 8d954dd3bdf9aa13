"""The RL loop on a tiny Qwen3-MoE (CPU): routing replay (R3) end to end, routing agreement
metrics, and the same metrics read back from TensorBoard, W&B (offline) and MLflow (file store)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from megarl.trainer import Trainer
from tests.helpers.models import make_tiny_chat_model
from tests.helpers.runs import tiny_run_config
from tests.helpers.sinks import mlflow_metrics, tensorboard_scalars, wandb_history

COMMON = ("checkpoint.export_hf=false", "trainer.eval_before_after=false")


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory) -> Path:
    return make_tiny_chat_model(tmp_path_factory.mktemp("models") / "tinymoe", family="qwen3_moe")


def test_routing_replay_end_to_end_with_every_sink(moe_model, tmp_path):
    out = tmp_path / "r3"
    cfg = tiny_run_config(moe_model, out, *COMMON, "trainer.total_steps=2", "algorithm.routing_replay=rollout",
                          "logging.sinks=[tensorboard,jsonl,wandb,mlflow]")
    steps = Trainer(cfg).run()["steps"]
    assert len(steps) == 2
    for m in steps:
        # the actor used the rollout's experts for every token of every MoE layer...
        assert m["routing/used_agreement"] == 1.0 and m["routing/tokens"] > 0
        # ...and reports how often its own router agrees (fp32 on both sides: nearly always)
        assert 0.9 < m["routing/agreement"] <= 1.0
        assert {"routing/agreement_layer00", "routing/agreement_layer01"} <= m.keys()
        assert math.isfinite(m["actor/pg_loss"]) and m["actor/grad_norm"] > 0
    assert steps[0]["rollout/logprob_diff_bound"] < 1e-4            # fp32/fp32 calibrated bound
    assert steps[0]["rollout/logprob_diff_mean"] < steps[0]["rollout/logprob_diff_bound"]

    # the same names and values in every sink, at steps 1 and 2
    sinks = {"tensorboard": tensorboard_scalars(out / "tensorboard"), "wandb": wandb_history(out),
             "mlflow": mlflow_metrics(out / "mlruns")}
    for key in ("reward/mean", "actor/pg_loss", "routing/agreement", "routing/agreement_layer01",
                "rollout/logprob_diff_mean", "time/step_s"):
        for name, got in sinks.items():
            assert key in got, (name, key)
            for step, m in enumerate(steps, start=1):
                assert got[key][step] == pytest.approx(m[key], rel=1e-6, abs=1e-6), (name, key, step)
    assert set(sinks["mlflow"]) == set(sinks["wandb"]) == set(sinks["tensorboard"])
    # the jsonl sink: every logged value exactly as the trainer returned it
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [{k: v for k, v in x.items() if k != "step"} for x in lines if x["step"] in (1, 2)] == steps


def test_routing_agreement_without_replay_ep2_on_ray(moe_model, tmp_path, capfd):
    """No replay: the agreement is still measured, summed over the two data-parallel ranks of an
    EP2 actor (Ray, gloo); fp32 LM head on both sides. The weights go out through expert senders
    (``sync.expert_senders``: EP rank 1 sends its own experts in an update group of its own), and
    the second step's rollout logprobs -- from the pushed weights -- still meet the trainer's."""
    cfg = tiny_run_config(moe_model, tmp_path / "plain", *COMMON, "trainer.total_steps=2", "rollout.fp32_lm_head=true",
                          "cluster.backend=ray", "actor.gpus=2", "actor.parallel.ep=2", "sync.expert_senders=true")
    steps = Trainer(cfg).run()["steps"]
    m = steps[0]
    assert 0.9 < m["routing/agreement"] <= 1.0
    assert m["routing/used_agreement"] == m["routing/agreement"]    # no replay: it used its own choice
    assert 0.0 <= m["routing/exact_match"] <= m["routing/agreement"]
    assert m["routing/tokens"] > 0
    err = capfd.readouterr().err
    assert "weight sync: megarl_weights_pp0" in err and "megarl_weights_pp0_ep1" in err, [l for l in err.splitlines() if "weight sync" in l]
    assert steps[1]["sync/bytes"] > 0 and steps[1]["actor/grad_norm"] > 0
    assert steps[1]["rollout/logprob_diff_mean"] < steps[0]["rollout/logprob_diff_bound"]
