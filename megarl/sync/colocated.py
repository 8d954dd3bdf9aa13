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
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

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

    chunks = list(chunks) if isinstance(chunks, (list, tuple)) else [chunks]

    def by_pipeline(t: torch.Tensor, index: int, stage: int, src: int) -> torch.Tensor:
        dist.broadcast(t, src=src, group=mpu.get_pipeline_model_parallel_group())
        return t
    yield from _stages_on_every_rank(_own_stage(chunks, hf_config), next(iter(chunks[0].parameters())).device,
                                     by_pipeline)


def _own_stage(chunks: list, hf_config=None) -> Iterator[Tuple[str, torch.Tensor]]:
    """This rank's pipeline stage as whole HF tensors: TP shards all-gathered on every rank, every
    expert-parallel rank's experts spread in (the same stream on every rank of the stage)."""
    from megarl.models import iter_hf_weights
    from megarl.models.builder import unwrap

    num_experts = int(getattr(unwrap(chunks[0]).config, "num_moe_experts", None) or 0)
    return _expert_spread(iter_hf_weights(chunks, hf_config, yield_on_all_ranks=True), num_experts)


Move = Callable[[torch.Tensor, int, int, int], torch.Tensor]


def _stages_on_every_rank(own: Iterator[Tuple[str, torch.Tensor]], device: torch.device,
                          move: Move) -> Iterator[Tuple[str, torch.Tensor]]:
    """Every pipeline stage's tensors on every rank, stage by stage, in the same order on all ranks:
    each tensor's name, shape and dtype go over the pipeline group from the stage's rank there,
    its bytes by ``move(tensor, index in its stage, stage, source rank)`` -- which fills the tensor
    (the stage's own copy on its ranks, an empty one elsewhere) on every rank and returns it.
    One stage: every rank holds every tensor already, nothing moves."""
    from megatron.core import parallel_state as mpu

    if mpu.get_pipeline_model_parallel_world_size() <= 1:
        yield from own
        return
    group = mpu.get_pipeline_model_parallel_group()
    ranks = dist.get_process_group_ranks(group)       # this pipeline's ranks, stage order
    me = mpu.get_pipeline_model_parallel_rank()
    for stage, src in enumerate(ranks):
        index = 0
        if stage == me:
            for name, t in own:
                t = t.contiguous()
                dist.broadcast_object_list([(name, tuple(t.shape), t.dtype)], src=src, group=group, device=device)
                yield name, move(t, index, stage, src)
                index += 1
            dist.broadcast_object_list([None], src=src, group=group, device=device)
            continue
        while True:
            meta = [None]
            dist.broadcast_object_list(meta, src=src, group=group, device=device)
            if meta[0] is None:
                break
            name, shape, dtype = meta[0]
            yield name, move(torch.empty(shape, dtype=dtype, device=device), index, stage, src)
            index += 1


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


# ----------------------------------------------------------------------------- one gather per node
@dataclass
class NodeLayout:
    """Which node each actor rank is on (ranks sharing a node address), and a process group per
    node with more than one rank, for the in-node broadcast (NVLink on GPU nodes)."""

    nodes: List[List[int]]                     # ranks of each node, ascending; nodes ordered by first rank
    node_of: dict
    groups: List[Any]                          # per node: its group (None for a one-rank node)
    fits: bool                                 # every TP and expert-parallel group inside one node
    why: str = ""
    pp_peers: List[List[int]] = field(default_factory=list)   # per rank: its pipeline group's ranks, stage order

    @property
    def spans_nodes(self) -> bool:
        return len(self.nodes) > 1


def node_layout(timeout_s: float = 600.0) -> NodeLayout:
    """A collective over the actor's world, once per run: every rank's node address
    (`wire.addresses.node_address`: Ray's node address inside Ray, else the source address towards
    the rendezvous master), its TP, expert-parallel and pipeline groups, then one group per node
    (made on every rank: `new_group` is collective)."""
    import os

    from megatron.core import parallel_state as mpu

    from megarl.wire.addresses import node_address

    mine = (node_address(os.environ.get("MASTER_ADDR") or None),
            dist.get_process_group_ranks(mpu.get_tensor_model_parallel_group()),
            dist.get_process_group_ranks(mpu.get_expert_model_parallel_group()),
            dist.get_process_group_ranks(mpu.get_pipeline_model_parallel_group()))
    every: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    layout = nodes_of(every)
    layout.pp_peers = [list(entry[3]) for entry in every]
    layout.groups = [dist.new_group(ranks=ranks, timeout=timedelta(seconds=timeout_s)) if len(ranks) > 1 else None
                     for ranks in layout.nodes]
    return layout


def nodes_of(every: Sequence[Tuple[Any, ...]]) -> NodeLayout:
    """The layout (without groups) from each rank's (node address, TP group, expert-parallel
    group, ...)."""
    keys: dict = {}
    for rank, (key, *_) in enumerate(every):
        keys.setdefault(key, []).append(rank)
    nodes = sorted(keys.values(), key=lambda ranks: ranks[0])
    node_of = {r: i for i, ranks in enumerate(nodes) for r in ranks}
    why = ""
    for rank, (_, tp, ep, *_) in enumerate(every):
        for name, group in (("tensor-parallel", tp), ("expert-parallel", ep)):
            if len({node_of[r] for r in group}) > 1 and not why:
                why = f"rank {rank}'s {name} group {list(group)} spans nodes"
    return NodeLayout(nodes=nodes, node_of=node_of, groups=[None] * len(nodes), fits=not why, why=why)


@dataclass
class NodeShareStats:
    """Bytes this rank moved in the by-node gather: from another node, and in-node broadcasts it led."""

    network_in: int = 0
    network_out: int = 0
    node_sent: int = 0


class NodeShare:
    """One tensor of pipeline stage ``s`` reaching every rank, crossing to each other node once.

    Every rank of stage ``s`` holds the tensor (TP shards and experts were gathered inside the
    node). A node with no rank of stage ``s`` takes tensor ``i`` on its rank ``i mod k`` (k ranks
    per node, so the node's NICs take turns), from that rank's pipeline peer of stage ``s``; a
    node with ranks of stage ``s`` takes it from one of them. That rank then broadcasts it inside
    the node. The everywhere gather sends it to each of the node's k ranks over the network."""

    def __init__(self, layout: NodeLayout, stats: NodeShareStats):
        self.layout, self.pp_peers, self.stats = layout, layout.pp_peers, stats
        self.stage_of = [peers.index(r) for r, peers in enumerate(layout.pp_peers)]
        self.rank = dist.get_rank()

    def _peer(self, rank: int, stage: int) -> int:
        """`rank`'s pipeline peer at `stage` (the rank of its pipeline group at that stage)."""
        return self.pp_peers[rank][stage]

    def __call__(self, t: torch.Tensor, index: int, stage: int) -> torch.Tensor:
        """Fill ``t`` (this rank's copy if it is of ``stage``, else an empty buffer) on every rank.
        Bytes move as a uint8 view (gloo has no float8; the bytes are the same)."""
        lay, me = self.layout, self.rank
        nbytes = t.numel() * t.element_size()
        if not nbytes:
            return t
        raw = t.reshape(-1).view(torch.uint8)
        pending = []
        for n, ranks in enumerate(lay.nodes):
            if any(self.stage_of[r] == stage for r in ranks):
                continue
            taker = ranks[index % len(ranks)]
            giver = self._peer(taker, stage)
            if me == giver:
                pending.append(dist.isend(raw, dst=taker))
                self.stats.network_out += nbytes
            elif me == taker:
                pending.append(dist.irecv(raw, src=giver))
                self.stats.network_in += nbytes
        for work in pending:
            work.wait()
        n = lay.node_of[me]
        ranks = lay.nodes[n]
        if len(ranks) == 1:
            return t
        holders = [r for r in ranks if self.stage_of[r] == stage]
        holder = holders[index % len(holders)] if holders else ranks[index % len(ranks)]
        if me == holder:
            dist.broadcast(raw, src=holder, group=lay.groups[n])
            self.stats.node_sent += nbytes
        elif self.stage_of[me] == stage:        # holds it already: receive into scratch, keep its own
            dist.broadcast(torch.empty_like(raw), src=holder, group=lay.groups[n])
        else:
            dist.broadcast(raw, src=holder, group=lay.groups[n])
        return t


def iter_hf_weights_by_node(chunks, layout: NodeLayout, convert=None,
                            stats: Optional[NodeShareStats] = None) -> Iterator[Tuple[str, torch.Tensor]]:
    """`iter_hf_weights_everywhere`'s tensors, in its order, with each pipeline stage's bytes
    crossing to every other node once (`NodeShare`) instead of once per rank there. ``convert``:
    the served format's stream (block FP8), applied where the tensors are held, so FP8 bytes
    cross the network and each stage's ranks quantize only their own stage. TP shards and experts
    are gathered as in the everywhere gather; the layout must keep those groups inside a node.
    ``stats``: filled with the bytes this rank moved."""
    if not layout.fits:
        raise RuntimeError(f"sync.colocated_gather: node needs every TP and expert-parallel group inside one "
                           f"node; {layout.why}")
    chunks = list(chunks) if isinstance(chunks, (list, tuple)) else [chunks]
    own = _own_stage(chunks)
    if convert is not None:
        own = convert(own)
    share = NodeShare(layout, stats if stats is not None else NodeShareStats())
    yield from _stages_on_every_rank(own, next(iter(chunks[0].parameters())).device,
                                     lambda t, index, stage, src: share(t, index, stage))
