"""Driver cost of one RL step's data path: CPU seconds on the driver and bytes each data-parallel
rank receives, for a synthetic batch (default 100k samples x 1k tokens) over Ray actors standing
in for data-parallel ranks (default 8). One JSON line per mode.

    python benchmarks/bench_driver.py                         # 100k x 1k over 8 actors
    python benchmarks/bench_driver.py --samples 20000 --dp 4  # smaller
    python benchmarks/bench_driver.py --modes sharded,broadcast

What a step moves (megarl's real code: TokenBatch, WorkerGroup.forward/minibatches/train over the
stand-in ranks, the planner, Shard payloads, unshard):
  forward : plan token-balanced contiguous shards + packed micro-batches, put one shard per rank
            (token ids, offsets, prompt lengths), each rank returns one logprob per response token,
            the driver puts them back in batch order (``WorkerGroup.forward``);
  train   : one epoch: shards with old logprobs, advantages and rollout logprobs per response token
            and the mini-batches' micro-batch plan (``WorkerGroup.train``); ranks return metrics.
Modes, measured in the same run:
  sharded          : the above, mini-batches drawn per rank over its forward range as the trainer
                     draws them (``WorkerGroup.minibatches``): training shards are views, ~1/dp each;
  sharded_shuffled : the path before that: one global shuffle (``trainer.minibatches``), each rank's
                     share of every mini-batch gathered from scattered samples (~1/dp each);
  broadcast        : the same flat batch put once and sent whole to every rank, each rank slicing its
                     share of the global-shuffle plan (what workers/group.py did before sharding).
The actors only touch the bytes they receive (sum of the token ids) and return results of the right
size: the benchmark measures the data path, not a model.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def payload_bytes(obj) -> int:
    if isinstance(obj, np.ndarray):
        return obj.nbytes
    if isinstance(obj, dict):
        return sum(payload_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(payload_bytes(v) for v in obj)
    return 8


def synthetic_batch(samples: int, tokens: int, prompt: int, seed: int):
    """``samples`` sequences of ~``tokens`` tokens (+-25%, uniform), prompts of ``prompt`` tokens."""
    from megarl.data.batch import TokenBatch, lengths_to_offsets

    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(int(tokens * 0.75), int(tokens * 1.25) + 1, (samples,), generator=g)
    total = int(lens.sum())
    toks = torch.randint(0, 150_000, (total,), generator=g, dtype=torch.int32)
    plens = torch.full((samples,), prompt, dtype=torch.int64)
    n_resp = int((lens - plens).sum())
    fields = {name: torch.randn(n_resp, generator=g) for name in ("rollout_logprobs", "old_logprobs", "advantages")}
    return TokenBatch(toks, lengths_to_offsets(lens), plens, fields)


def make_actor_cls():
    import ray

    @ray.remote(num_cpus=0)
    class Rank:
        """Stands in for one data-parallel rank: reads its shard, returns results of the right size."""

        def execute(self, method, *args):  # what WorkerGroup.call_sharded calls on a rank
            return getattr(self, method)(*args)

        def forward(self, payload, dp_rank=None):
            from megarl.workers.dispatch import Shard

            if dp_rank is not None:  # broadcast: the whole batch, slice this rank's share
                payload = _slice(payload, dp_rank)
            shard = Shard.from_payload(payload)
            checksum = int(shard.batch.tokens.sum())
            n = int(shard.batch.response_lens.sum())  # results in shard batch order, as the worker returns them
            return {"token": {"logprobs": np.zeros(n, dtype=np.float32)}, "checksum": checksum}

        def train(self, payload, algo=None, dp_rank=None):
            from megarl.workers.dispatch import Shard

            if dp_rank is not None:
                payload = _slice(payload, dp_rank)
            shard = Shard.from_payload(payload)
            return {"loss_sum": float(shard.batch.token_fields["advantages"].sum()),
                    "micro_batches": sum(len(m) for m in shard.micro_sizes)}

    return Rank


def _slice(payload, dp_rank):
    """Broadcast mode: a rank's own share from the whole batch (the plan travels with it)."""
    from megarl.data.batch import TokenBatch
    from megarl.workers.dispatch import shard_of

    batch = TokenBatch.from_payload(payload["batch"])
    plan = payload["plan"][dp_rank]
    return shard_of(batch, plan["samples"], plan["micro_sizes"], payload["denominators"])


def bench_group(actors, budget: int):
    """megarl's WorkerGroup over the stand-in ranks (one rank per data-parallel group, packed
    micro-batches of ``budget`` tokens), recording the bytes of every shard it ships."""
    from types import SimpleNamespace as NS

    from megarl.workers.group import WorkerGroup

    class Group(WorkerGroup):
        def call_sharded(self, method, shards, *args, **kwargs):
            self.shipped[method] = max(payload_bytes(s.to_payload()["batch"]) for s in shards)
            return super().call_sharded(method, shards, *args, **kwargs)

    role = NS(packing=True, micro_batch_size=1, max_tokens_per_micro_batch=budget, parallel=NS(pp=1, vpp=1))
    group = Group.__new__(Group)
    group.role, group.cfg, group.role_cfg, group.backend, group.workers = "actor", NS(actor=role), role, "ray", actors
    group._topology = [{"dp_rank": r, "dp": len(actors), "tp_rank": 0, "pp_rank": 0, "is_output": 1}
                       for r in range(len(actors))]
    group.shipped = {}
    return group


def step(batch, actors, mode: str, budget: int, global_batch: int, seed: int = 0):
    """One step's data path (forward + train); returns per-rank bytes and driver seconds by phase."""
    import ray

    from megarl.data.packing import plan_shards
    from megarl.data.packing import minibatches
    from megarl.workers.dispatch import unshard

    dp = len(actors)
    lengths = batch.seq_lens.tolist()
    rl = batch.response_lens
    fields = ("old_logprobs", "advantages", "rollout_logprobs")
    out = {}
    faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt   # first writes to fresh pages (object store)
    cpu0, t0 = time.process_time(), time.perf_counter()
    if mode in ("sharded", "sharded_shuffled"):
        group = bench_group(actors, budget)
        # ---- forward (old logprobs): WorkerGroup.forward
        logprobs = group.forward("forward", batch)["logprobs"]
        assert logprobs.numel() == int(rl.sum())
        out["forward_s"] = time.perf_counter() - t0
        out["forward_cpu_s"] = time.process_time() - cpu0
        out["forward_bytes_per_rank"] = group.shipped["forward"]
        # ---- train (one epoch of mini-batches): WorkerGroup.train, mini-batches as the trainer draws them
        t1, cpu1 = time.perf_counter(), time.process_time()
        if mode == "sharded":      # per rank, over its forward range (trainer: actor.minibatches)
            mbs = group.minibatches(batch, global_batch, seed)
            glob = mbs.minibatches
        else:                      # before: one global shuffle, each rank's share gathered
            mbs = glob = minibatches(len(batch), global_batch, seed)
        dens = [{"num_tokens": float(rl[m].sum()), "num_seqs": float(len(m))} for m in glob]
        metrics = group.train(batch, mbs, dens, {}, fields)
        assert metrics["micro_batches"] > 0
        out["train_bytes_per_rank"] = group.shipped["train"]
    else:
        # ---- forward: the same flat batch to every rank, each slicing its share
        plan = plan_shards(lengths, [list(range(len(batch)))], dp, packed=True, max_tokens=budget)
        out["plan_s"] = time.perf_counter() - t0
        whole = {"batch": batch.with_fields(()).to_payload(), "denominators": [],
                 "plan": [{"samples": plan.samples[r], "micro_sizes": plan.micro_sizes[r]} for r in range(dp)]}
        ref = ray.put(whole)
        out["forward_bytes_per_rank"] = payload_bytes(whole["batch"])
        results = ray.get([a.forward.remote(ref, r)
                           for r, a in enumerate(actors)])
        logprobs = unshard(batch, plan, [torch.as_tensor(np.asarray(r["token"]["logprobs"])) for r in results])
        assert logprobs.numel() == int(rl.sum())
        out["forward_s"] = time.perf_counter() - t0
        out["forward_cpu_s"] = time.process_time() - cpu0
        # ---- train: one global shuffle, the whole batch with its fields to every rank
        t1, cpu1 = time.perf_counter(), time.process_time()
        mbs = minibatches(len(batch), global_batch, seed)
        dens = [{"num_tokens": float(rl[m].sum()), "num_seqs": float(len(m))} for m in mbs]
        tplan = plan_shards(lengths, mbs, dp, packed=True, max_tokens=budget)
        whole = {"batch": batch.with_fields(fields).to_payload(), "denominators": dens,
                 "plan": [{"samples": tplan.samples[r], "micro_sizes": tplan.micro_sizes[r]} for r in range(dp)]}
        ref = ray.put(whole)
        out["train_bytes_per_rank"] = payload_bytes(whole["batch"])
        metrics = ray.get([a.train.remote(ref, None, r) for r, a in enumerate(actors)])
        assert len(metrics) == dp
    out["train_s"] = time.perf_counter() - t1
    out["train_cpu_s"] = time.process_time() - cpu1
    out["driver_wall_s"] = time.perf_counter() - t0
    out["driver_cpu_s"] = time.process_time() - cpu0
    out["driver_minor_faults"] = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=100_000)
    ap.add_argument("--tokens", type=int, default=1000, help="mean tokens per sample (prompt + response)")
    ap.add_argument("--prompt", type=int, default=200)
    ap.add_argument("--dp", type=int, default=8, help="Ray actors standing in for data-parallel ranks")
    ap.add_argument("--budget", type=int, default=16384, help="tokens per packed micro-batch")
    ap.add_argument("--global-batch", type=int, default=4096, help="samples per mini-batch (optimizer step)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--modes", default="sharded,sharded_shuffled,broadcast")
    ap.add_argument("--object-store-gb", type=float, default=6.0)
    ap.add_argument("--preallocate-store", action="store_true",
                    help="Ray allocates the object store's shared memory at start (RAY_preallocate_plasma_memory); "
                         "otherwise the first step's puts fault in fresh pages on the driver")
    a = ap.parse_args()
    if a.preallocate_store:
        os.environ["RAY_preallocate_plasma_memory"] = "1"   # read by the raylet ray.init starts
    import ray

    torch.set_num_threads(2)
    t = time.perf_counter()
    batch = synthetic_batch(a.samples, a.tokens, a.prompt, seed=0)
    build_s = time.perf_counter() - t
    whole_bytes = payload_bytes(batch.to_payload())
    ray.init(num_cpus=2, object_store_memory=int(a.object_store_gb * 2**30), include_dashboard=False,
             log_to_driver=False)
    try:
        Rank = make_actor_cls()
        actors = [Rank.remote() for _ in range(a.dp)]
        # warm-up: actor processes import torch and megarl once (not part of a step)
        tiny = synthetic_batch(4 * a.dp, 16, 4, seed=1)
        for mode in a.modes.split(","):
            step(tiny, actors, mode, a.budget, 4)
        lines = {}
        for mode in a.modes.split(","):
            runs = [step(batch, actors, mode, a.budget, a.global_batch) for _ in range(a.steps)]
            best = min(runs, key=lambda r: r["driver_wall_s"])
            line = {"bench": "driver_step", "mode": mode, "samples": a.samples, "tokens_per_sample": a.tokens,
                    "dp": a.dp, "batch_tokens": batch.num_tokens, "batch_bytes_all_fields": whole_bytes,
                    "cores": os.cpu_count(), "steps": a.steps, "preallocated_store": a.preallocate_store,
                    **{k: (round(v, 4) if isinstance(v, float) else v) for k, v in best.items()},
                    "driver_wall_s_all": [round(r["driver_wall_s"], 3) for r in runs],
                    "driver_cpu_s_all": [round(r["driver_cpu_s"], 3) for r in runs],
                    "driver_minor_faults_all": [r["driver_minor_faults"] for r in runs]}
            lines[mode] = line
        if "sharded" in lines and "broadcast" in lines:
            s, b = lines["sharded"], lines["broadcast"]
            s["train_bytes_per_rank_vs_broadcast"] = round(s["train_bytes_per_rank"] / b["train_bytes_per_rank"], 4)
            s["forward_bytes_per_rank_vs_broadcast"] = round(s["forward_bytes_per_rank"] / b["forward_bytes_per_rank"], 4)
            s["driver_cpu_vs_broadcast"] = round(s["driver_cpu_s"] / max(b["driver_cpu_s"], 1e-9), 3)
            s["driver_wall_vs_broadcast"] = round(s["driver_wall_s"] / max(b["driver_wall_s"], 1e-9), 3)
        for line in lines.values():
            line["synthetic_batch_build_s"] = round(build_s, 3)
            line["driver_max_rss_gb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)
            print(json.dumps(line), flush=True)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
