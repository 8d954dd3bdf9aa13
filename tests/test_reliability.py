"""Reliability defects of issue 15, each checked where it happens: checkpoint retention, a
data-parallel rank without samples, and a rollout server that timed out once."""
from __future__ import annotations

import asyncio
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megarl.config import ConfigError, load_config, validate_config
from tests.helpers.runs import tiny_model, tiny_run_config


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return tiny_model(tmp_path_factory.mktemp("models"))


# ---------------------------------------------------------------------------------- keep_last

def _save_steps(cfg, steps: list[int]) -> list[str]:
    """Trainer.save_checkpoint for each step (no worker roles: only the trainer's own state)."""
    from megarl.trainer import Trainer

    trainer = Trainer(cfg)
    trainer.loader = SimpleNamespace(state_dict=lambda: {"epoch": 0})
    trainer.kl_ctl = SimpleNamespace(value=0.0)
    for step in steps:
        trainer.state.step = step
        written = trainer.save_checkpoint()
        assert written.is_dir(), f"checkpoint {written} deleted right after it was written"
    return sorted(p.name for p in trainer.ckpt_dir.glob("step_*"))


@pytest.mark.parametrize("keep_last, kept", [(0, ["step_000001", "step_000002", "step_000003"]),
                                             (1, ["step_000003"]),
                                             (2, ["step_000002", "step_000003"])])
def test_keep_last_zero_keeps_every_checkpoint(model, tmp_path, keep_last, kept):
    cfg = tiny_run_config(model, tmp_path / "run", f"checkpoint.keep_last={keep_last}")
    assert _save_steps(cfg, [1, 2, 3]) == kept


def test_keep_last_negative_is_refused(model, tmp_path):
    with pytest.raises(ConfigError, match=r"checkpoint\.keep_last"):
        validate_config(tiny_run_config(model, tmp_path / "run", "checkpoint.keep_last=-1"))


# ---------------------------------------------------------------------- a dp rank without samples

SEQUENCES = [[1, 20, 300, 4000, 50, 6, 70, 8]]
PROMPT_LENS = [3]


def _algo(cfg) -> dict:
    """The algorithm settings Trainer.step hands to ``train`` (same fields, from the config)."""
    a = cfg.algorithm
    return {"policy_loss": a.policy_loss, "entropy_coef": a.entropy_coef, "value_clip": a.value_clip,
            "kl_loss_coef": 0.0, "kl_estimator": a.kl.estimator, "agg_mode": a.loss_agg,
            "policy_loss_cfg": {"clip_low": a.clip_low, "clip_high": a.clip_high, "dual_clip_c": a.dual_clip_c,
                                "agg_mode": a.loss_agg, "tis_cap": a.tis_cap,
                                "norm_len": float(cfg.rollout.sampling.max_new_tokens)}}


def _params(worker) -> dict[str, torch.Tensor]:
    """This rank's Megatron parameters (every data-parallel rank holds a full copy at tp=pp=1)."""
    return {n: p.detach().float().clone() for c in worker.chunks for n, p in c.named_parameters()}


def _train_one_sample(rank: int, world: int, cfg, out_dir: str) -> dict:
    """One rank: forward the one-sample batch, then one optimizer step on it; the weights after the
    step go to ``out_dir/rank<r>.pt`` (too big for the result queue)."""
    import torch.distributed as dist

    from megarl.trainer import denominators
    from megarl.workers import MegatronWorker, SequenceBatch, WorkerSpec

    worker = MegatronWorker(WorkerSpec(role="actor", cfg=cfg, rank=rank, world_size=world, master_addr="127.0.0.1",
                                       master_port=int(os.environ["MASTER_PORT"]), trainable=True, value_head=False))
    worker.setup()
    before = _params(worker)
    batch = SequenceBatch(SEQUENCES, PROMPT_LENS)
    mask = batch.response_mask()
    batch.tensors = {"response_mask": mask}
    got = worker.compute_logprobs(batch)
    shared = [got]
    dist.broadcast_object_list(shared, src=0)        # rank 0 holds the only sample's logprobs
    old = shared[0]["results"][0][0]
    batch.tensors.update(old_logprobs=old, rollout_logprobs=old.clone(),
                         advantages=torch.linspace(-1.0, 1.0, mask.shape[1]).unsqueeze(0) * mask)
    metrics = worker.train(batch, [[0]], denominators(mask, [[0]]), _algo(cfg))
    after = _params(worker)
    moved = max(float((after[k] - before[k]).abs().max()) for k in after)
    torch.save(after, os.path.join(out_dir, f"rank{rank}.pt"))
    return {"forward": got, "metrics": metrics, "moved": moved}


def test_dp_rank_without_samples_joins_and_changes_nothing(model, tmp_path):
    """One sample, two data-parallel ranks (what dynamic sampling can leave): rank 1 has nothing to
    train on. Both ranks finish the forward and the optimizer step, rank 1 reports no results and
    no loss metrics, and the update is the one a single rank makes on the same sample."""
    from megarl.parallel import spawn
    from megarl.workers import WorkerGroup

    # a mini-batch of 2 samples was planned (2 ranks x 1); the step has 1: min(2, 1) = 1 (trainer.minibatches)
    base = ("trainer.total_steps=1", "batch.global_batch_size=2", "actor.micro_batch_size=1", "actor.optim.lr=1e-2")
    (tmp_path / "dp1").mkdir()
    (tmp_path / "dp2").mkdir()
    one = spawn(_train_one_sample, 1, tiny_run_config(model, tmp_path / "dp1", *base), str(tmp_path / "dp1"),
                init=False, timeout_s=240)
    two = spawn(_train_one_sample, 2, tiny_run_config(model, tmp_path / "dp2", *base, "actor.gpus=2",
                                                       "cluster.backend=ray"), str(tmp_path / "dp2"),
                init=False, timeout_s=240)
    weights_one = torch.load(tmp_path / "dp1" / "rank0.pt")
    weights_two = [torch.load(tmp_path / "dp2" / f"rank{r}.pt") for r in range(2)]
    assert two[1]["forward"] is None and two[0]["forward"]["index"] == [0]
    assert torch.equal(two[0]["forward"]["results"][0][0], one[0]["forward"]["results"][0][0])
    assert one[0]["moved"] > 1e-4                     # the step did train
    for name, tensor in weights_one.items():
        assert torch.allclose(weights_two[0][name], tensor, atol=1e-6, rtol=0), name
        assert torch.equal(weights_two[1][name], weights_two[0][name]), name
    assert "actor/pg_loss_sum" in two[0]["metrics"] and "actor/pg_loss_sum" not in two[1]["metrics"]
    assert abs(two[1]["metrics"]["grad_norm"] - one[0]["metrics"]["grad_norm"]) < 1e-5
    group = WorkerGroup.__new__(WorkerGroup)
    merged, single = group.reduce_metrics([m["metrics"] for m in two]), group.reduce_metrics([one[0]["metrics"]])
    assert merged.keys() == single.keys()
    for key, value in single.items():
        assert abs(merged[key] - value) < 1e-5, (key, merged[key], value)
