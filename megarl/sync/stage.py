"""One weight-update group per pipeline stage: which rank sends, and the stream it sends.

Why: every update group is a process group with every rollout server rank in it. If every TP0/DP0
rank of a stage and every expert-parallel rank's ETP0/EDP0 rank pushed on its own, a 671B MoE
run (PP stages x EP ranks) would open dozens of NCCL groups with every server -- each one a
rendezvous, NCCL communicators on every server GPU, and one more thing to fail. slime uses one
group per pipeline stage; so does megarl:

* the **stage sender** is the rank with ``tp_rank == 0`` and ``dp_rank == 0`` (``cp_rank == 0``)
  of its pipeline stage -- one per stage; its group is ``megarl_weights_pp<stage>``;
* it streams the stage's dense weights as ``iter_hf_weights`` yields them (TP shards
  all-gathered to it), then the stage's experts: its own, and those of the other expert-parallel
  ranks, sent to it over the stage's expert-parallel group **in transfer units** (packed buckets
  of ``unit_bytes``, default a quarter of a sync bucket), round-robin over the EP ranks so none
  of them waits for more than one round. The sender holds at most one received unit at a time
  (plus its own unit being packed), so its extra memory stays the pusher's two buckets plus about
  half a bucket; the other EP ranks hold one unit.

Megatron's rank layout makes this work: within a stage, the rank with tp = cp = dp = 0 is also
etp = ep = edp = 0, so the stage sender is expert-parallel rank 0 of the EP group that the
ETP0/EDP0 ranks of the stage form (``megatron.core.parallel_state``: tp-cp-ep-dp-pp order).
``check_stage_layout`` verifies it at the first push and names the stage when it does not hold.

**Expert senders** (``expert_senders=True``, the candidate the refit model in
``megarl/planning/refit.py`` prices): each expert-parallel rank's ETP0/EDP0 rank sends its own
experts through an update group of its own (``megarl_weights_pp<stage>_ep<rank>``) instead of
handing them to the stage sender; the stage sender sends the dense weights and its own experts.
No expert transfer, and quantization spreads over the EP ranks; the price is one update group per
stage and EP rank on every server.

Deadlock freedom: every rank first walks the dense weights (TP all-gathers only), then the
experts (ETP all-gathers, and point-to-point sends to the sender). A rank blocked in a send waits
only for the sender to reach it in the round; the sender waits only for that send; neither waits
on a collective the other has yet to join.
"""
from __future__ import annotations

from typing import Iterator, Optional, Tuple

import torch
import torch.distributed as dist

from .bucket import iter_buckets

DEFAULT_UNIT_FRACTION = 4      # transfer unit = sync bucket / 4
GROUP_PREFIX = "megarl_weights"


class StageLayoutError(RuntimeError):
    """The stage's sender is not expert-parallel rank 0 of its stage (an unexpected rank order)."""


def stage_index() -> int:
    """This rank's pipeline stage."""
    from megatron.core import parallel_state as mpu

    return mpu.get_pipeline_model_parallel_rank()


def is_stage_sender() -> bool:
    """Whether this rank sends its pipeline stage's weights (tp = dp = cp = 0 of the stage)."""
    from megatron.core import parallel_state as mpu

    return mpu.get_tensor_model_parallel_rank() == 0 and mpu.get_data_parallel_rank(with_context_parallel=True) == 0


def is_expert_sender() -> bool:
    """Whether this rank sends its own experts under ``expert_senders``: ETP0/EDP0 of an
    expert-parallel rank other than 0 (EP rank 0's experts go with the stage sender)."""
    ep, ep_rank, etp_rank, edp_rank = _expert_ranks()
    return ep > 1 and ep_rank > 0 and etp_rank == 0 and edp_rank == 0


def stage_group_name(prefix: str = GROUP_PREFIX, expert_senders: bool = False) -> str:
    """The update group of this rank's stage: one per stage, the same name on every push (with
    ``expert_senders`` an expert sender's own group, one per stage and EP rank)."""
    if expert_senders and is_expert_sender():
        return f"{prefix}_pp{stage_index()}_ep{_expert_ranks()[1]}"
    return f"{prefix}_pp{stage_index()}"


def _expert_ranks() -> Tuple[int, int, int, int]:
    """(ep size, ep rank, etp rank, edp rank) of this rank."""
    from megatron.core import parallel_state as mpu

    return (mpu.get_expert_model_parallel_world_size(), mpu.get_expert_model_parallel_rank(),
            mpu.get_expert_tensor_parallel_rank(), mpu.get_expert_data_parallel_rank())


def check_stage_layout() -> None:
    """Raise :class:`StageLayoutError` (on the rank concerned, naming its stage) when a stage sender
    is not the expert-parallel rank 0 that collects the stage's experts. Local: no communication."""
    ep, ep_rank, etp_rank, edp_rank = _expert_ranks()
    if is_stage_sender() and ep > 1 and (ep_rank, etp_rank, edp_rank) != (0, 0, 0):
        raise StageLayoutError(
            f"pipeline stage {stage_index()}: its sender (rank {dist.get_rank()}, tp = dp = 0) is expert rank "
            f"ep={ep_rank} etp={etp_rank} edp={edp_rank}, not ep = etp = edp = 0; the stage's experts would be "
            f"gathered to another rank (megatron rank order other than tp-cp-ep-dp-pp?)")


def iter_stage_weights(chunks, bucket_bytes: int, unit_bytes: Optional[int] = None, expert_senders: bool = False
                       ) -> Iterator[Tuple[str, torch.Tensor]]:
    """Every HF tensor of this rank's pipeline stage, yielded on the stage sender only (other ranks
    yield nothing but must iterate: they take part in the all-gathers and send their experts).
    ``expert_senders``: the stage sender yields the dense weights and its own experts, every other
    expert sender (:func:`is_expert_sender`) its own experts, no expert is transferred.

    A collective over the actor's ranks: call it on every rank, in the same order as other
    collectives. Names and tensors are those of ``megarl.models.iter_hf_weights``."""
    from megarl.models import iter_hf_weights
    from megarl.models.builder import unwrap

    chunks = list(chunks) if isinstance(chunks, (list, tuple)) else [chunks]
    check_stage_layout()
    yield from iter_hf_weights(chunks, only="dense")
    experts = iter_hf_weights(chunks, only="experts")
    if expert_senders:                # each ETP0/EDP0 rank yields its own experts (iter_hf_weights)
        yield from experts
        return
    ep, ep_rank, etp_rank, edp_rank = _expert_ranks()
    num_experts = int(getattr(unwrap(chunks[0]).config, "num_moe_experts", None) or 0)
    if ep <= 1 or not num_experts:
        yield from experts            # the stage sender is the only ETP0/EDP0 rank of the stage
        return
    if etp_rank != 0 or edp_rank != 0:
        for _ in experts:             # join the expert-TP all-gathers; these ranks yield nothing
            pass
        return
    from megatron.core import parallel_state as mpu

    group = mpu.get_expert_model_parallel_group()
    device = next(iter(chunks[0].parameters())).device
    unit = max(1, int(unit_bytes or bucket_bytes // DEFAULT_UNIT_FRACTION))
    units = iter_buckets(experts, unit, buffers=1, with_checksum=False)
    if ep_rank != 0:
        root = dist.get_global_rank(group, 0)
        for b in units:
            dist.send_object_list([(b.meta.names, b.meta.shapes, str(b.meta.dtype), b.meta.nbytes)], dst=root,
                                  group=group, device=device)
            dist.send(b.flat, dst=root, group=group)
        dist.send_object_list([None], dst=root, group=group, device=device)
        return
    yield from _collect_round_robin(units, group, ep, device)


def _collect_round_robin(own, group, ep: int, device: torch.device) -> Iterator[Tuple[str, torch.Tensor]]:
    """On the stage sender: one unit of its own, then one from each other EP rank, in turn, until
    every rank has said it is done."""
    active = list(range(ep))
    while active:
        for r in list(active):
            if r == 0:
                b = next(own, None)
                if b is None:
                    active.remove(0)
                    continue
                yield from b.named_tensors()
                continue
            src = dist.get_global_rank(group, r)
            box = [None]
            dist.recv_object_list(box, src=src, group=group, device=device)
            if box[0] is None:
                active.remove(r)
                continue
            names, shapes, dtype, nbytes = box[0]
            flat = torch.empty(int(nbytes), dtype=torch.uint8, device=device)
            dist.recv(flat, src=src, group=group)
            dt = getattr(torch, dtype.replace("torch.", ""))
            offset = 0
            for name, shape in zip(names, shapes):
                numel = 1
                for d in shape:
                    numel *= int(d)
                size = numel * torch.empty((), dtype=dt).element_size()
                yield name, flat[offset:offset + size].view(dt).view(tuple(shape))
                offset += size
