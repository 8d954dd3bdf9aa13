"""Reliability defects, each checked where it happens: checkpoint retention, a
data-parallel rank without samples, and a rollout server that timed out once."""
from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megarl.config import ConfigError, validate_config
from tests.helpers.runs import tiny_model, tiny_run_config


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return tiny_model(tmp_path_factory.mktemp("models"))


# ---------------------------------------------------------------------------------- keep_last

def _save_steps(cfg, steps: list[int]) -> list[str]:
    """The run's checkpoint manager for each step (no worker roles: only the trainer's own state)."""
    from megarl.trainer import Trainer

    trainer = Trainer(cfg)
    trainer.checkpoints.register("trainer", trainer.state)
    trainer.checkpoints.register("rollout_source", SimpleNamespace(state_dict=lambda: {"loader": {"epoch": 0}}))
    for step in steps:
        trainer.state.step = step
        written = trainer.save_checkpoint()
        assert written.is_dir(), f"checkpoint {written} deleted right after it was written"
        assert json.loads((written / "trainer_state.json").read_text())["step"] == step
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


def _loss(cfg):
    """The loss settings Trainer.train hands to the actor (from the config, no KL loss)."""
    from megarl.algos import LossSettings

    return LossSettings.from_algorithm(cfg.algorithm, cfg.rollout.sampling.max_new_tokens, 0.0)


def _params(worker) -> dict[str, torch.Tensor]:
    """This rank's Megatron parameters (every data-parallel rank holds a full copy at tp=pp=1)."""
    return {n: p.detach().float().clone() for c in worker.chunks for n, p in c.named_parameters()}


def _train_one_sample(rank: int, world: int, cfg, out_dir: str) -> dict:
    """One rank: forward the one-sample batch, then one optimizer step on it, through the sharded
    data path the trainer uses (the planner gives a rank without samples empty micro-batches); the
    weights after the step go to ``out_dir/rank<r>.pt`` (too big for the result queue)."""
    import torch.distributed as dist

    from megarl.data.batch import TokenBatch
    from megarl.data.packing import plan_shards
    from megarl.data.packing import denominators
    from megarl.workers import MegatronWorker, WorkerSpec
    from megarl.workers.dispatch import make_shards
    from megarl.workers.group import token_budget

    worker = MegatronWorker(WorkerSpec(role="actor", cfg=cfg, rank=rank, world_size=world, master_addr="127.0.0.1",
                                       master_port=int(os.environ["MASTER_PORT"]), trainable=True, value_head=False))
    worker.setup()
    before = _params(worker)
    batch = TokenBatch.from_sequences([s[:p] for s, p in zip(SEQUENCES, PROMPT_LENS)],
                                      [s[p:] for s, p in zip(SEQUENCES, PROMPT_LENS)])

    def shard(minibatches, fields=(), dens=None):
        plan = plan_shards(batch.seq_lens.tolist(), minibatches, world, packed=cfg.actor.packing,
                           max_tokens=token_budget(cfg, "actor"), micro_batch_size=cfg.actor.micro_batch_size)
        return make_shards(batch, plan, fields, dens)[rank].to_payload()

    got = worker.compute_logprobs(shard([[0]]))
    shared = [got]
    dist.broadcast_object_list(shared, src=0)        # rank 0 holds the only sample's logprobs
    old = torch.as_tensor(shared[0]["token"]["logprobs"])
    mask = batch.response_mask()
    batch.token_fields.update(old_logprobs=old, rollout_logprobs=old.clone(),
                              advantages=torch.linspace(-1.0, 1.0, old.numel()))
    metrics = worker.train_batch(shard([[0]], ("old_logprobs", "rollout_logprobs", "advantages"),
                                 denominators(mask, [[0]])), _loss(cfg))
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
                init=False, timeout_s=600)   # a hang guard
    two = spawn(_train_one_sample, 2, tiny_run_config(model, tmp_path / "dp2", *base, "actor.gpus=2",
                                                       "cluster.backend=ray"), str(tmp_path / "dp2"),
                init=False, timeout_s=600)   # a hang guard
    weights_one = torch.load(tmp_path / "dp1" / "rank0.pt")
    weights_two = [torch.load(tmp_path / "dp2" / f"rank{r}.pt") for r in range(2)]
    assert len((two[1]["forward"] or {}).get("token", {}).get("logprobs", [])) == 0, "rank 1 had no sample"
    assert torch.equal(torch.as_tensor(two[0]["forward"]["token"]["logprobs"]),
                       torch.as_tensor(one[0]["forward"]["token"]["logprobs"]))
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


# ------------------------------------------------------------------ a generation timeout

class FlakyServer:
    """An HTTP server on a thread of its own: ``/generate`` stalls (until the server is closed: far
    longer than the client's timeout, on any machine) for its first ``stalls`` requests, then answers
    like SGLang (3 tokens with logprobs); ``/health`` answers ``health_status``, or stalls too when
    ``health_status`` is None."""

    def __init__(self, stalls: int, health_status: int | None = 200):
        self.stalls, self.health_status = stalls, health_status
        self.generate_calls = 0
        self.health_calls = 0
        self.loop = asyncio.new_event_loop()
        self.closing = asyncio.Event()   # set (on the server's loop) by __exit__: stalls end

    async def stall(self) -> None:
        try:
            await asyncio.wait_for(self.closing.wait(), 600)   # a hang guard only
        except asyncio.TimeoutError:
            pass

    async def handler(self, request):
        from aiohttp import web

        if request.path == "/health":
            self.health_calls += 1
            if self.health_status is None:
                await self.stall()
            return web.Response(status=self.health_status or 200, text="ok")
        self.generate_calls += 1
        if self.generate_calls <= self.stalls:
            await self.stall()
        body = await request.json()
        batched = isinstance(body["input_ids"][0], list)   # SGLang's batch form: prompt-major, n each
        params = body.get("sampling_params") or {}
        n = int((params[0] if isinstance(params, list) else params).get("n", 1))
        outs = []
        for prompt in (body["input_ids"] if batched else [body["input_ids"]]):
            ids = [int(prompt[-1]) + i for i in range(1, 4)]
            outs += [{"output_ids": ids, "meta_info": {
                "finish_reason": {"type": "length"}, "output_token_logprobs": [[-0.5, t, None] for t in ids]}}] * n
        return web.json_response(outs if batched or n > 1 else outs[0])

    def __enter__(self) -> "FlakyServer":
        import threading

        from tests.helpers.http import serve

        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.runner, port = asyncio.run_coroutine_threadsafe(serve(self.handler), self.loop).result(10)
        self.url = f"http://127.0.0.1:{port}"
        return self

    def __exit__(self, *exc) -> None:
        self.loop.call_soon_threadsafe(self.closing.set)
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)


def _manager(urls: list[str], retries: int = 2):
    from megarl.rollout.manager import RolloutManager

    # 3 s: far above what a local answer takes on a loaded box; the stalled servers never answer
    mgr = RolloutManager(urls, timeout_s=3.0, request_retries=retries, health_timeout_s=3.0)
    for c in mgr.clients:
        c.retries = 0  # the client's own retries would hide the manager's
    return mgr


def test_generation_timeout_keeps_a_server_that_answers_health():
    """One timed-out generation: the server answers /health, so it stays in use, the request is
    sent again and succeeds, and the retry is counted (was: marked dead, NoServerLeft). Both
    prompts' samples travel in one batched request (SGLang's list of input_ids, n per item)."""
    with FlakyServer(stalls=1) as server:
        mgr = _manager([server.url])
        try:
            out = mgr.generate([[10], [20]], n=2, sampling={"max_new_tokens": 3})
            assert [[o.output_ids for o in group] for group in out] == [[[11, 12, 13]] * 2, [[21, 22, 23]] * 2]
            assert mgr.dead == set() and mgr.retried == 1 and server.health_calls == 1
            assert server.generate_calls == 2
            mgr.generate([[30]], n=1, sampling={"max_new_tokens": 3})   # still in use afterwards
            assert server.generate_calls == 3 and mgr.retried == 1
        finally:
            mgr.close()


def test_generation_failing_on_a_healthy_server_gives_up_after_the_retries():
    from megarl.rollout.manager import GenerationFailed

    with FlakyServer(stalls=100) as server:
        mgr = _manager([server.url], retries=1)
        try:
            with pytest.raises(GenerationFailed, match=r"prompt 0 \(1 sample\): failed 2 time\(s\) on rollout "
                                                       r"servers that answer /health \(rollout.request_retries = 1\)"):
                mgr.generate([[10]], n=1, sampling={"max_new_tokens": 3})
            assert server.generate_calls == 2 and mgr.retried == 1 and mgr.dead == set()
        finally:
            mgr.close()


def test_timed_out_server_without_health_is_dropped_and_its_requests_move():
    """The first server hangs, /health included: it is marked dead and every request lands on the
    second; the requests that moved are counted (one request per server: a prompt's 2 samples)."""
    with FlakyServer(stalls=100, health_status=None) as hung, FlakyServer(stalls=0) as good:
        mgr = _manager([hung.url, good.url])
        try:
            out = mgr.generate([[10], [20]], n=2, sampling={"max_new_tokens": 3})
            assert all(len(o.output_ids) == 3 for group in out for o in group)
            assert mgr.dead_urls == [hung.url] and len(mgr.failures) == 1 and "does not answer /health" in mgr.failures[0]
            assert mgr.retried == 1 and good.generate_calls == 2
        finally:
            mgr.close()
