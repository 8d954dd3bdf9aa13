"""Colocated weight push: every server TP rank gets a CUDA-IPC handle to memory on ITS OWN GPU.

In a colocated run, server i's TP rank r shares bundle (= GPU) `sum(tp[:i]) + r` with trainer rank
`sum(tp[:i]) + r` (both are placed on the shared pool's bundles in order). SGLang's
`update_weights_from_tensor` reads payload r on TP rank r and opens its CUDA-IPC handle there;
a handle to another GPU does not open in a process that sees only its own GPU. So, as slime and
verl do for colocated engines, the trainer ranks that share a server's GPUs each hold the bucket
on their own GPU and gather their handles to the group's first rank, which posts one request with
the payloads in TP-rank order. By construction IPC only ever goes to servers on the sender's node.

That needs every trainer rank to see every weight: `iter_hf_weights_everywhere` all-gathers TP
shards on every rank (not only TP0/DP0), all-gathers experts over the expert-parallel group, and
broadcasts each pipeline stage's tensors to the other stages over the pipeline group, in one
global order that is the same on all ranks -- so every rank cuts the same buckets.
"""
from __future__ import annotations

import re
from datetime import timedelta
from typing import Any, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

_EXPERT = re.compile(r"^(.*\.experts\.)(\d+)(\..*)$")


def ipc_groups(num_servers: int, server_tp: int) -> Tuple[Tuple[int, ...], ...]:
    """Trainer ranks feeding each server's TP ranks, in TP-rank order (shared bundles)."""
    return ipc_groups_for([server_tp] * num_servers)


def ipc_groups_for(server_tp_sizes: Sequence[int]) -> Tuple[Tuple[int, ...], ...]:
    """The same for servers of different TP sizes: server i's TP rank r shares bundle (and
    trainer rank) `sum(server_tp_sizes[:i]) + r` (servers are placed on the bundles in order)."""
    groups, first = [], 0
    for tp in server_tp_sizes:
        groups.append(tuple(range(first, first + int(tp))))
        first += int(tp)
    return tuple(groups)


def _expert_spread(named: Iterator[Tuple[str, torch.Tensor]], num_experts: int) -> Iterator[Tuple[str, torch.Tensor]]:
    """Each expert tensor this rank yields, followed by the same local expert of every other
    expert-parallel rank (all-gathered), under their global expert indices."""
    from megatron.core import parallel_state as mpu

    ep = mpu.get_expert_model_parallel_world_size()
    if ep <= 1:
        yield from named
        return
    local = num_experts // ep
    group, ep_rank = mpu.get_expert_model_parallel_group(), mpu.get_expert_model_parallel_rank()
    for name, t in named:
        m = _EXPERT.match(name)
        if m is None:
            yield name, t
            continue
        parts = [torch.empty_like(t) for _ in range(ep)]
        dist.all_gather(parts, t.contiguous(), group=group)
        first = int(m.group(2)) - ep_rank * local
        for e, part in enumerate(parts):
            yield f"{m.group(1)}{first + e * local}{m.group(3)}", part


def iter_hf_weights_everywhere(chunks, hf_config=None) -> Iterator[Tuple[str, torch.Tensor]]:
    """Every HF tensor of the whole model on EVERY rank, in the same order on all ranks (stage 0's
    tensors, then stage 1's, ...). A collective over the actor's whole world."""
    from megatron.core import parallel_state as mpu

    from megarl.models import iter_hf_weights
    from megarl.models.builder import unwrap

    chunks = list(chunks) if isinstance(chunks, (list, tuple)) else [chunks]
    pp = mpu.get_pipeline_model_parallel_world_size()
    num_experts = int(getattr(unwrap(chunks[0]).config, "num_moe_experts", None) or 0)
    own = _expert_spread(iter_hf_weights(chunks, hf_config, yield_on_all_ranks=True), num_experts)
    if pp <= 1:
        yield from own
        return
    group = mpu.get_pipeline_model_parallel_group()
    ranks = dist.get_process_group_ranks(group)       # this pipeline's ranks, stage order
    me = mpu.get_pipeline_model_parallel_rank()
    device = next(iter(chunks[0].parameters())).device
    for stage, src in enumerate(ranks):
        if stage == me:
            for name, t in own:
                dist.broadcast_object_list([(name, tuple(t.shape), t.dtype)], src=src, group=group, device=device)
                dist.broadcast(t.contiguous(), src=src, group=group)
                yield name, t
            dist.broadcast_object_list([None], src=src, group=group, device=device)
            continue
        while True:
            meta = [None]
            dist.broadcast_object_list(meta, src=src, group=group, device=device)
            if meta[0] is None:
                break
            name, shape, dtype = meta[0]
            t = torch.empty(shape, dtype=dtype, device=device)
            dist.broadcast(t, src=src, group=group)
            yield name, t


class IpcFanIn:
    """This rank's part of its server's handle gather (one gloo group per server, created on every
    rank because `new_group` is collective): a `tensor_payloads` function for `WeightPusher`
    that gathers every member's payload to the group's first rank."""

    def __init__(self, groups: Sequence[Sequence[int]], timeout_s: float = 600.0):
        rank = dist.get_rank()
        self.group = None
        self.members: Tuple[int, ...] = ()
        for members in groups:
            # explicit: new_group's own default is torch's 30 min, not the push's deadline
            g = dist.new_group(ranks=list(members), backend="gloo", timeout=timedelta(seconds=timeout_s))
            if rank in members:
                self.group, self.members = g, tuple(members)
        self.server: Optional[int] = next((i for i, m in enumerate(groups) if rank in m), None)

    @property
    def leader(self) -> bool:
        return bool(self.members) and dist.get_rank() == self.members[0]

    def payloads(self, bucket, server_tp: Sequence[int], tensor_format: Optional[str]) -> List[List[str]]:
        from megarl.wire import flattened as wire
        from .push import bucket_object

        mine = wire.dumps_b64(bucket_object(bucket, tensor_format))
        if self.group is None:
            return []
        gathered: Optional[List[Any]] = [None] * len(self.members) if self.leader else None
        dist.gather_object(mine, gathered, dst=self.members[0], group=self.group)
        return [list(gathered)] if self.leader else []

    def barrier(self) -> None:
        """The leader returns after its last answer; the others wait for it before they free the
        memory their handles point at."""
        if self.group is not None:
            dist.barrier(group=self.group)
