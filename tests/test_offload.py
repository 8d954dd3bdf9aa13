"""Offload between phases: a run with every switch on equals the same run without
offload -- losses, grad norms and the exported weights, bit for bit -- under the layouts megarl
trains with (TP2 x dp2 with megatron's distributed optimizer, PP2, MoE EP2 with the distributed
optimizer) and for every role kind (actor, critic, reference). The state really leaves: while
offloaded, its storages hold zero bytes, and a frozen role never holds gradients or optimizer
state. The reference is the same trainer without offload (megatron's own math both times)."""
from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from megarl.trainer import Trainer
from tests.helpers.models import make_tiny_chat_model
from tests.helpers.runs import tiny_model, tiny_run_config

COMMON = ("trainer.eval_before_after=false", "trainer.total_steps=2")
ALL_SWITCHES = ("params", "grads", "optimizer")


def switches(role: str, kinds=ALL_SWITCHES) -> tuple[str, ...]:
    return tuple(f"{role}.offload.{k}=true" for k in kinds)


@pytest.fixture(scope="module")
def dense(tmp_path_factory) -> Path:
    return tiny_model(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> Path:
    return make_tiny_chat_model(tmp_path_factory.mktemp("models") / "tinymoe", family="qwen3_moe")


def export_digest(folder: str) -> str:
    from safetensors.torch import load_file

    h = hashlib.sha256()
    files = sorted(Path(folder).glob("*.safetensors"))
    assert files
    for f in files:
        for name, t in sorted(load_file(f).items()):
            h.update(name.encode())
            h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def assert_same_run(plain: dict, offloaded: dict, keys: tuple[str, ...]) -> None:
    assert len(plain["steps"]) == len(offloaded["steps"]) == 2
    for step, (a, b) in enumerate(zip(plain["steps"], offloaded["steps"])):
        for k in keys:
            assert a[k] == b[k], (step, k, a[k], b[k])
        assert b["memory/offload_bytes"] > 0 and b["memory/onload_bytes"] > 0
        assert "memory/offload_bytes" not in a
    assert export_digest(plain["export"]) == export_digest(offloaded["export"])


LAYOUTS = {
    "tp2-dp2-distopt": ("dense", ("cluster.backend=ray", "actor.gpus=4", "actor.parallel.tp=2",
                                  "actor.optim.distributed_optimizer=true", "actor.micro_batch_size=2")),
    "pp2": ("dense", ("cluster.backend=ray", "actor.gpus=2", "actor.parallel.pp=2")),
    "ep2-dp2-distopt": ("moe", ("cluster.backend=ray", "actor.gpus=2", "actor.parallel.ep=2",
                                "actor.optim.distributed_optimizer=true")),
}


@pytest.fixture(scope="class")
def ray_address(dense, tmp_path_factory):
    """One local Ray instance for the layouts' runs, started as a run starts its own
    (``placement.pools.init_ray``, sized for the largest layout); each run joins it
    (``cluster.ray_address``) instead of starting and stopping one, and its placement groups are
    removed after it. Stopped once the class's runs are done: the local-backend tests of this
    module run with no Ray in the process, as they do alone."""
    import ray

    from megarl.placement.pools import init_ray

    largest = LAYOUTS["tp2-dp2-distopt"][1]
    init_ray(tiny_run_config(dense, tmp_path_factory.mktemp("ray"), *COMMON, *largest))
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


def run_on_ray(cfg) -> dict:
    """``Trainer(cfg).run()`` on the shared Ray instance; its placement groups go with it."""
    from ray._raylet import PlacementGroupID
    from ray.util.placement_group import PlacementGroup, placement_group_table, remove_placement_group

    try:
        return Trainer(cfg).run()
    finally:
        for pg_id, info in placement_group_table().items():
            if info["state"] != "REMOVED":
                remove_placement_group(PlacementGroup(PlacementGroupID.from_hex(pg_id)))


class TestEveryLayout:
    @pytest.mark.parametrize("layout", sorted(LAYOUTS))
    def test_offload_every_switch_is_bit_exact(self, layout, dense, moe, ray_address, tmp_path):
        which, layout_overrides = LAYOUTS[layout]
        model = dense if which == "dense" else moe
        layout_overrides = (*layout_overrides, f"cluster.ray_address={ray_address}")
        plain = run_on_ray(tiny_run_config(model, tmp_path / "plain", *COMMON, *layout_overrides))
        offloaded = run_on_ray(tiny_run_config(model, tmp_path / "offload", *COMMON, *layout_overrides,
                                               *switches("actor")))
        assert_same_run(plain, offloaded, ("actor/pg_loss", "actor/loss", "actor/grad_norm", "actor/entropy",
                                           "rollout/logprob_diff_mean", "reward/mean"))


def test_critic_and_reference_offload_and_frozen_roles_hold_no_training_state(dense, tmp_path):
    """PPO with a critic and a reference, every role's switches on: the same run as without;
    mid-step the offloaded storages are empty; repeated cycles restore the bytes with no growth."""
    ppo = ("algorithm.advantage=gae", "critic.enabled=true", "ref.enabled=true", "algorithm.kl.mode=reward",
           "algorithm.kl.coef=0.05", "critic.optim.lr=1e-3")
    plain = Trainer(tiny_run_config(dense, tmp_path / "plain", *COMMON, *ppo)).run()
    offloaded = Trainer(tiny_run_config(dense, tmp_path / "offload", *COMMON, *ppo, *switches("actor"),
                                        *switches("critic"), "ref.offload.params=true")).run()
    assert_same_run(plain, offloaded, ("actor/pg_loss", "actor/grad_norm", "critic/vf_loss", "critic/grad_norm",
                                       "kl/actor_ref_k1"))

    trainer = Trainer(tiny_run_config(dense, tmp_path / "probe", *COMMON, *ppo, *switches("actor"),
                                      *switches("critic"), "ref.offload.params=true"))
    try:
        trainer.setup()
        trainer.step(0)   # ends with every switched state on the host (rollout phase)
        for role in ("actor", "critic", "ref"):
            sizes = trainer.groups[role].call("probe", _storage_bytes)[0]
            assert sizes["device_bytes"] == 0, (role, sizes)
            assert sizes["host_bytes"] >= sizes["params_bytes"] > 0, (role, sizes)
        ref = trainer.groups["ref"].call("probe", _training_state)[0]
        assert ref == {"optimizer": False, "requires_grad": 0, "grad_buffers": 0}
        actor = trainer.groups["actor"].call("probe", _training_state)[0]
        assert actor["optimizer"] and actor["requires_grad"] > 0 and actor["grad_buffers"] > 0
        # back on the device bit for bit: the weights the servers were given equal the trainer's
        pushed = trainer.groups["actor"].call("hf_state_dict")[0]
        assert all(torch.isfinite(t).all() for t in pushed.values())
        # 20 offload/onload cycles of every kind on the trained actor: the bytes come back exactly,
        # the host buffers are allocated once (no growth), and the device storages are empty between
        out = trainer.groups["actor"].call("probe", _cycle, 20)[0]
        assert out["restored"] and out["empty_between"]
        assert out["host_bytes"][0] == out["host_bytes"][-1] > 0
        assert len(set(out["host_ids"])) == 1
    finally:
        trainer.close()


def _storage_bytes(worker) -> dict[str, int]:
    off = worker.offloader
    return {"device_bytes": sum(p.untyped_storage().nbytes() for c in worker.chunks for p in c.parameters()),
            "params_bytes": sum(p.numel() * p.element_size() for c in worker.chunks for p in c.parameters()),
            "host_bytes": off.host_bytes()}


def _training_state(worker) -> dict:
    from megarl.workers.offload import _grad_buffers

    return {"optimizer": worker.optimizer is not None,
            "requires_grad": sum(p.requires_grad for c in worker.chunks for p in c.parameters()),
            "grad_buffers": sum(g.numel() for g in _grad_buffers(worker.chunks))}


def _cycle(worker, n: int) -> dict:
    off = worker.offloader
    kinds = list(ALL_SWITCHES)
    off.onload(kinds)
    before = {i: p.detach().clone() for i, p in enumerate(q for c in worker.chunks for q in c.parameters())}
    host_bytes, host_ids, empty = [], [], True
    for _ in range(n):
        off.offload(kinds)
        empty &= all(p.untyped_storage().nbytes() == 0 for c in worker.chunks for p in c.parameters())
        host_bytes.append(off.host_bytes())
        host_ids.append(tuple(sorted(id(h) for h in off._hosts.values())))
        off.onload(kinds)
    after = list(q for c in worker.chunks for q in c.parameters())
    restored = all(torch.equal(before[i], p.detach()) for i, p in enumerate(after))
    off.offload(kinds)
    return {"restored": restored, "empty_between": empty, "host_bytes": host_bytes, "host_ids": host_ids}


def test_phase_order_servers_sleep_and_wake_around_the_trainer(dense, tmp_path, monkeypatch):
    """The order of a colocated step against the real embedded engine (its release/resume endpoints
    run on CPU too; the GPU condition is forced): servers release after the rollout; the reward
    model scores only after they did; before the push the servers take their weights back, the push
    runs, the trainer's state leaves, and only then the KV cache comes back."""
    from megarl.rollout.pipeline import RolloutPipeline

    monkeypatch.setattr(RolloutPipeline, "shares_gpus", lambda self: True)
    events: list[str] = []

    class Recorded(Trainer):
        def setup(self):
            super().setup()
            manager, residency, weights, rm = (self.rollout.manager, self.residency, self.weights,
                                               self.groups["reward_model"])
            call_all, hold, push, forward = manager.call_all, residency.hold, weights.push, rm.forward

            def rec_call(method, tags=None, *a, **k):
                events.append(f"{method.split('_')[0]}:{','.join(tags or ())}")
                return call_all(method, tags, *a, **k)

            def rec_hold(phase, role=None, need="forward"):
                events.append(f"hold:{phase}:{role}")
                return hold(phase, role, need)

            monkeypatch.setattr(manager, "call_all", rec_call)
            monkeypatch.setattr(residency, "hold", rec_hold)
            monkeypatch.setattr(weights, "push", lambda *a, **k: (events.append("push"), push(*a, **k))[1])
            monkeypatch.setattr(rm, "forward", lambda *a, **k: (events.append("rm_forward"), forward(*a, **k))[1])

    cfg = tiny_run_config(dense, tmp_path / "order", "trainer.eval_before_after=false", "trainer.total_steps=2",
                          "checkpoint.export_hf=false", "reward.kind=model", "reward_model.enabled=true",
                          *switches("actor"), "reward_model.offload.params=true")
    steps = Recorded(cfg).run()["steps"]
    assert len(steps) == 2
    for step in range(2):   # each step: from its rollout's reward pass to the end of its sync phase
        start = [i for i, e in enumerate(events) if e == "rm_forward"][step]
        end = [i for i, e in enumerate(events) if e == "resume:kv_cache"][step]
        seq = events[start - 2:end + 1]
        assert seq[:3] == ["release:weights,kv_cache", "hold:reward:reward_model", "rm_forward"], seq
        i = seq.index("resume:weights")
        assert seq[i:] == ["resume:weights", "hold:sync:actor", "push", "hold:rollout:None", "resume:kv_cache"], seq
        assert seq.index("hold:old_logprobs:actor") < seq.index("hold:train:actor") < i
        assert "resume:weights,kv_cache" not in seq     # never both at once before a push
