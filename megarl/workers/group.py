"""A role's ranks, called together.

``WorkerGroup.call("method", ...)`` runs the method on every rank at once (megatron collectives
need all of them) and returns the per-rank results. Batches go through ``forward`` / ``train``:
the group plans data-parallel shards and micro-batches (:mod:`megarl.data.packing`), puts each
shard into Ray's object store once and hands that one reference to every rank of the shard's
data-parallel group (:meth:`call_sharded`), then puts the output ranks' flat results back into
batch order (:mod:`megarl.workers.dispatch`). Backend ``ray`` makes one Ray actor per rank inside
the role's placement group; backend ``local`` runs a single rank in this process (tests, one-GPU
boxes without Ray) through the same planning and sharding code, without the object store.
"""
from __future__ import annotations

from typing import Any, Optional, Union

import torch

from megarl.algos import LossSettings
from megarl.config import max_sequence_len
from megarl.data.batch import TokenBatch
from megarl.data.packing import ShardPlan, StratifiedMinibatches, plan_ranges, plan_shards, stratified_minibatches
from megarl.wire.addresses import node_address
from megarl.wire.process_group import bound_store
from megarl.workers.dispatch import make_shards, unshard
from megarl.workers.megatron_worker import MegatronWorker, WorkerSpec


class _RayRank(MegatronWorker):
    """Ray actor body: a MegatronWorker plus a generic method dispatcher."""

    def execute(self, method: str, *args, **kwargs):
        return getattr(self, method)(*args, **kwargs)

    def open_rendezvous(self) -> tuple[str, int]:
        """Rank 0: listen for the other ranks now and keep listening until ``setup`` -- (this node's
        address as Ray reports it, the port the store holds). Binding the port here instead of
        probing a free one and binding it later closes the window in which another process on the
        node (another role's group, a Ray worker) could take it (EADDRINUSE at init)."""
        import dataclasses

        address = node_address()
        self.store = bound_store(address, self.spec.world_size, self.cfg.cluster.collective_timeout_s)
        self.spec = dataclasses.replace(self.spec, master_addr=address, master_port=self.store.port)
        return address, self.store.port


# mini-batches of sample indices, or stratified per rank (WorkerGroup.minibatches)
Minibatches = Union[list[list[int]], StratifiedMinibatches]


class WorkerGroup:
    def __init__(self, role: str, cfg: Any, *, backend: str, trainable: bool, value_head: bool,
                 placement_group: Any = None, share: float = 1.0):
        self.role = role
        self.cfg = cfg
        self.role_cfg = getattr(cfg, role)
        self._topology: Optional[list[dict[str, int]]] = None
        self.world_size = getattr(cfg, role).gpus
        self.backend = backend
        spec_args = dict(role=role, cfg=cfg, world_size=self.world_size, trainable=trainable, value_head=value_head)
        if backend == "local":
            if self.world_size != 1:
                raise ValueError(f"{role}.gpus = {self.world_size}: backend 'local' runs one rank; use cluster.backend=ray")
            # one rank: an in-process store, no port to race for
            self.workers = [MegatronWorker(WorkerSpec(rank=0, master_addr="127.0.0.1", master_port=0, **spec_args))]
        else:
            import ray
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            gpu = cfg.cluster.device == "cuda"
            remote = ray.remote(_RayRank)
            self.workers = []
            master_addr, master_port = None, None
            for rank in range(self.world_size):
                options = dict(num_cpus=cfg.cluster.cpus_per_rank * share, num_gpus=share if gpu else 0,
                               name=None, max_concurrency=1,
                               scheduling_strategy=PlacementGroupSchedulingStrategy(
                                   placement_group=placement_group, placement_group_bundle_index=rank))
                if rank == 0:
                    # rank 0's node hosts the rendezvous: it binds the store before the rest exist
                    first = remote.options(**options).remote(WorkerSpec(rank=0, master_addr="", master_port=0, **spec_args))
                    master_addr, master_port = ray.get(first.open_rendezvous.remote())
                    self.workers.append(first)
                    continue
                spec = WorkerSpec(rank=rank, master_addr=master_addr, master_port=master_port, **spec_args)
                self.workers.append(remote.options(**options).remote(spec))

    def call(self, method: str, *args, **kwargs) -> list[Any]:
        if self.backend == "local":
            return [getattr(self.workers[0], method)(*args, **kwargs)]
        import ray

        return ray.get([w.execute.remote(method, *args, **kwargs) for w in self.workers])

    # ------------------------------------------------------------------ sharded data path
    def topology(self) -> list[dict[str, int]]:
        """Per rank: dp_rank, dp, tp_rank, pp_rank, is_output (asked once, after ``setup``)."""
        if getattr(self, "_topology", None) is None:
            self._topology = self.call("topology")
        return self._topology

    @property
    def dp(self) -> int:
        return int(self.topology()[0]["dp"])

    def plan(self, batch: TokenBatch, minibatches: "Optional[Minibatches]" = None,
             pairs: bool = False, forward_only: bool = False) -> ShardPlan:
        """Data-parallel shards and micro-batches of this role for ``batch`` (all samples in one
        mini-batch when ``minibatches`` is None). Stratified mini-batches drawn for this role's
        data-parallel size give every rank its own contiguous range (:func:`plan_ranges`); drawn
        for another size (a critic with another dp than the actor's) they are planned like plain
        lists of samples (:func:`plan_shards`: exact token balance, but each rank's shard is gathered
        from scattered samples). ``pairs``: plan over adjacent sample pairs (2i, 2i + 1), which then
        always share a micro-batch (reward-model training). ``forward_only``: a forward pass's
        micro-batches (``forward_max_tokens_per_micro_batch``)."""
        role = self.role_cfg
        lengths = plan_lengths(self.cfg, self.role, batch.seq_lens.tolist())
        budget = dict(packed=role.packing, max_tokens=token_budget(self.cfg, self.role, forward_only),
                      micro_batch_size=max(1, role.micro_batch_size // (2 if pairs else 1)),
                      micro_multiple=role.parallel.pp if role.parallel.vpp > 1 else 1)
        if isinstance(minibatches, StratifiedMinibatches):
            if minibatches.dp == self.dp and not pairs:
                return plan_ranges(lengths, minibatches, **budget)
            minibatches = minibatches.minibatches
        if minibatches is None:
            minibatches = [list(range(len(lengths) // (2 if pairs else 1)))]
        if pairs:
            lengths = [lengths[2 * i] + lengths[2 * i + 1] for i in range(len(lengths) // 2)]
        plan = plan_shards(lengths, minibatches, self.dp, **budget)
        if pairs:  # pair k -> sequences 2k, 2k + 1
            plan = ShardPlan([[j for k in s for j in (2 * k, 2 * k + 1)] for s in plan.samples],
                             [[[2 * n for n in sizes] for sizes in mb] for mb in plan.micro_sizes])
        return plan

    def minibatches(self, batch: TokenBatch, global_batch_size: int, seed: int) -> StratifiedMinibatches:
        """An epoch's mini-batches of ``batch``, drawn per data-parallel rank of this role so that
        :meth:`train` ships every rank its forward-pass range as a view (no gather on the driver).
        ``.minibatches`` lists the global mini-batches (loss denominators); pass the object itself
        to :meth:`train` of this group and of any group training on the same mini-batches."""
        return stratified_minibatches(batch.seq_lens.tolist(), self.dp, global_batch_size, seed)

    def call_sharded(self, method: str, shards: list[Any], *args, **kwargs) -> list[Any]:
        """Run ``method(shard, *args)`` on every rank, each rank getting its data-parallel group's
        shard. Under Ray each shard is put into the object store once (numpy buffers: read from
        shared memory on the shard's node) and all ranks of the group receive that reference."""
        topo = self.topology()
        if len(shards) != self.dp:
            raise ValueError(f"{self.role}: {len(shards)} shards for data-parallel size {self.dp}")
        if self.backend == "local":
            return [getattr(self.workers[0], method)(shards[0], *args, **kwargs)]
        import ray

        refs = [ray.put(s.to_payload()) for s in shards]
        return ray.get([w.execute.remote(method, refs[t["dp_rank"]], *args, **kwargs)
                        for w, t in zip(self.workers, topo)])

    def forward(self, method: str, batch: TokenBatch, *args, fields: tuple[str, ...] = (),
                **kwargs) -> dict[str, torch.Tensor]:
        """A forward-only method over ``batch``: flat results in batch order, per response token
        (``compute_logprobs`` -> logprobs/entropy, ``compute_values`` -> values) or per sample
        (``compute_scores`` -> scores)."""
        plan = self.plan(batch, forward_only=True)
        results = self.call_sharded(method, make_shards(batch, plan, fields), *args, **kwargs)
        by_dp: dict[int, dict] = {}
        for res, t in zip(results, self.topology()):
            if res:
                by_dp[int(t["dp_rank"])] = res
        if sorted(by_dp) != list(range(plan.dp)):
            raise RuntimeError(f"{self.role}: no result from data-parallel ranks "
                               f"{sorted(set(range(plan.dp)) - set(by_dp))}")
        out: dict[str, torch.Tensor] = {}
        for per in ("token", "sample"):
            keys = {k for r in by_dp.values() for k in r.get(per, {})}
            for key in sorted(keys):
                parts = [_read_only_tensor(by_dp[d].get(per, {}).get(key, torch.zeros(0))) for d in range(plan.dp)]
                out[key] = unshard(batch, plan, parts, per)
        return out

    def train(self, batch: TokenBatch, minibatches: "Minibatches", denominators: list[dict[str, float]],
              loss: Optional[LossSettings], fields: tuple[str, ...], pairs: bool = False) -> dict[str, float]:
        """One optimizer step per mini-batch (sample indices of ``batch``, or :meth:`minibatches`,
        whose shards are views) with the role's loss; metrics merged over ranks. ``pairs``: the
        reward model's (chosen, rejected) sequence pairs, kept in one micro-batch."""
        plan = self.plan(batch, minibatches, pairs=pairs)
        shards = make_shards(batch, plan, fields, denominators)
        return self.reduce_metrics(self.call_sharded("train_batch", shards, loss))

    def reduce_metrics(self, per_rank: list[dict[str, float]]) -> dict[str, float]:
        """Add ``*_sum`` metrics over output ranks (they carry global denominators), average the rest;
        each over the ranks that report it (a data-parallel rank without samples reports no loss
        metrics). A sum wins over an average of the same name: the policy loss also reports each
        micro-batch's share of the loss as ``pg_loss``, whose mean over micro-batches depends on how
        many there are (it made ``actor/pg_loss`` differ between dp 1 and dp 2 on the same data)."""
        merged: dict[str, float] = {}
        keys = dict.fromkeys(k for m in per_rank if m for k in m)
        for key in sorted(keys, key=lambda k: k.endswith("_sum")):   # stable: sums last, so they win
            values = [m[key] for m in per_rank if m and key in m]
            if key.endswith("_sum"):
                merged[key[: -len("_sum")]] = sum(values)
            else:
                merged[key] = sum(values) / len(values)
        return merged

    def shutdown(self) -> None:
        if self.backend == "local":
            self.workers[0].shutdown()
            return
        import ray

        try:
            ray.get([w.execute.remote("shutdown") for w in self.workers], timeout=30)
        except Exception:  # noqa: BLE001 - best effort on teardown
            pass
        for w in self.workers:
            ray.kill(w)


def _read_only_tensor(value: Any) -> torch.Tensor:
    """A rank's result as a tensor without a copy. Arrays from Ray's object store are read-only
    views of shared memory; torch warns about wrapping them, but ``unshard`` only reads them (its
    output is a fresh tensor), so the warning would be noise in every run's log."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.as_tensor(value)


def plan_lengths(cfg: Any, role: str, lengths: list[int]) -> list[int]:
    """Sample lengths as ``role``'s micro-batches hold them: packed under context parallelism each
    sequence is padded to a multiple of ``2 cp`` (megarl.models.context_parallel), else unchanged."""
    r = getattr(cfg, role)
    cp = r.parallel.cp
    if not (r.packing and cp > 1):
        return list(lengths)
    from megarl.models.context_parallel import cp_padded_len

    return [cp_padded_len(n, cp) for n in lengths]


def token_budget(cfg: Any, role: str, forward_only: bool = False) -> int:
    """Tokens per micro-batch of ``role`` (the whole packed row, over all CP ranks):
    ``max_tokens_per_micro_batch`` per rank (``forward_max_tokens_per_micro_batch`` for a
    forward-only pass when set; x ``cp`` when packed under context parallelism, each CP rank
    holding ``1 / cp`` of the row), or (0) for packed micro-batches ``micro_batch_size`` longest
    possible samples (prompt + response), the memory a padded micro-batch of that size could need
    at most."""
    r = getattr(cfg, role)
    per_rank = (r.forward_max_tokens_per_micro_batch if forward_only else 0) or r.max_tokens_per_micro_batch
    if per_rank:
        return int(per_rank) * (r.parallel.cp if r.packing else 1)
    if not r.packing:
        return 0
    longest = plan_lengths(cfg, role, [max_sequence_len(cfg)])[0]
    return max(1, r.micro_batch_size) * longest
