"""Context parallelism in ``megarl plan``: what CP costs per layer and when it is the answer.

megarl's CP (:mod:`megarl.models.context_parallel`) splits every packed sequence over ``cp`` ranks;
each rank stores the activations of ``1 / cp`` of the tokens (the memory plan divides the tokens of
a micro-batch by ``cp``, :func:`megarl.planning.memory.micro_batch_tokens`) and, per layer, all-gathers
the keys and values of the whole micro-batch; the backward reduce-scatters their gradient. So per
layer and rank, with ``T`` tokens per rank, ``kv`` = KV heads on this TP rank x head size, ``e`` bytes
per value:

    stored: the K and V attention reads, ``(2 cp + 1) * T * kv * e`` (on GPUs each local chunk runs
        against a copy of its key prefix, ``(2 cp + 1) / (2 cp)`` of the gathered ``2 cp T`` rows,
        kept for attention's backward)
    received: forward all-gather ``2 * (cp - 1) * T * kv * e``; backward reduce-scatter the same
    seconds: received bytes / link bandwidth, the link being NVLink when the CP group (with its TP
    ranks inside) fits one node, else the inter-node network (:data:`INTRA_NODE_GBPS`,
    :data:`INTER_NODE_GBPS`: assumptions, not measurements; printed with the figure).

Why a suggestion: a training phase short of memory because one long sample's activations do not fit
is not helped by more data-parallel ranks (they shard the optimizer, not a sequence);
:func:`suggest_cp` finds the smallest ``cp`` (the pool grown by the same factor, dp unchanged) that
makes the role fit.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Callable, Optional

from megarl.config.schema import ModelArch, RoleConfig, RunConfig
from megarl.planning.params import MLA_QK_NOPE, MLA_QK_ROPE, head_dim, is_mla

INTRA_NODE_GBPS = 300.0   # NCCL all-gather bus bandwidth inside an NVLink node (H100/H200 class), GB/s
INTER_NODE_GBPS = 45.0    # one 400 Gb/s NIC per GPU, GB/s


@dataclass
class CPExchange:
    """Per layer and rank under context parallelism."""

    cp: int
    gathered_kv_bytes: int        # K and V prefixes of the whole micro-batch, kept for attention's backward
    received_bytes: int           # forward all-gather (the backward reduce-scatter moves as many)
    seconds: float                # the exchange (forward, and backward if any) at the assumed link bandwidth
    link: str                     # "nvlink" | "network"
    gbps: float
    backward: bool = True         # False: a role that only runs forward passes (nothing kept, no reduce-scatter)

    def note(self, layers: int) -> str:
        kept = "kept" if self.backward else "held per layer"
        moved = "received forward and as many reduce-scattered backward" if self.backward else "received"
        return (f"cp{self.cp}: per layer {self.gathered_kv_bytes / 2**20:.1f} MiB of gathered K/V {kept}, "
                f"{self.received_bytes / 2**20:.1f} MiB {moved}, "
                f"{self.seconds * 1e3:.2f} ms per layer ({self.seconds * layers:.2f} s per micro-batch over "
                f"{layers} layers) at {self.gbps:g} GB/s {self.link} (assumed)")


def kv_width(arch: ModelArch, tp: int) -> int:
    """Values of K (or V) per token on one TP rank. MLA's K/V heads are the attention heads."""
    if is_mla(arch):   # K of width qk_nope + qk_rope (V narrower; the larger one is counted for both)
        return math.ceil(arch.num_attention_heads / tp) * (MLA_QK_NOPE + MLA_QK_ROPE)
    kv_heads = max(1, math.ceil(arch.num_kv_heads / tp)) if tp > 1 else arch.num_kv_heads
    return kv_heads * head_dim(arch)


def cp_exchange(arch: ModelArch, role: RoleConfig, tokens_per_rank: int, elem: int,
                gpus_per_node: int, backward: bool = True) -> Optional[CPExchange]:
    """The K/V exchange of one layer for ``tokens_per_rank`` local tokens; None without CP.
    ``backward=False``: a forward-only pass (a frozen role), whose exchange is the all-gather alone."""
    p = role.parallel
    if p.cp <= 1:
        return None
    kv = kv_width(arch, p.tp)
    gathered = (2 * p.cp + 1) * tokens_per_rank * kv * elem
    received = 2 * (p.cp - 1) * tokens_per_rank * kv * elem
    one_node = not gpus_per_node or p.cp * p.tp <= gpus_per_node
    gbps = INTRA_NODE_GBPS if one_node else INTER_NODE_GBPS
    passes = 2 if backward else 1
    return CPExchange(cp=p.cp, gathered_kv_bytes=int(gathered), received_bytes=int(received),
                      seconds=passes * received / (gbps * 1e9), link="nvlink" if one_node else "network",
                      gbps=gbps, backward=backward)


def suggest_cp(cfg: RunConfig, name: str, plan_fn: Callable[[RunConfig], object],
               grow: Callable[[RunConfig, str, int], None]) -> Optional[str]:
    """``name``: the smallest context-parallel size (2..16) at which ``plan_fn`` reports no problem
    for the role, first on the same GPUs (data-parallel size / cp), then with the pool grown by
    ``grow(trial, name, factor)`` (data-parallel size unchanged); None if none does or the role
    cannot use CP (padded micro-batches)."""
    role = getattr(cfg, name)
    if not role.packing:
        return None
    for same_gpus in (True, False):
        for cp in (2, 4, 8, 16):
            if cp <= role.parallel.cp or cp % role.parallel.cp:
                continue
            factor = cp // role.parallel.cp
            trial = copy.deepcopy(cfg)
            r = getattr(trial, name)
            if same_gpus and r.gpus % (r.parallel.tp * r.parallel.pp * cp):
                continue
            r.parallel.cp = cp
            r.max_tokens_per_micro_batch = -(-r.max_tokens_per_micro_batch // factor)  # same tokens per micro-batch
            r.forward_max_tokens_per_micro_batch = -(-r.forward_max_tokens_per_micro_batch // factor)
            if not same_gpus:
                grow(trial, name, factor)
            trial.cluster.nodes = 10 ** 6
            plan = plan_fn(trial)
            if not any(p.startswith(name + ":") for p in plan.problems):
                return (f"{name}: fits with {name}.parallel.cp={cp} and {name}.gpus={r.gpus} (context parallel: "
                        f"each sequence split over {cp} ranks, activations / {cp}; "
                        f"{name}.max_tokens_per_micro_batch={r.max_tokens_per_micro_batch} per GPU; "
                        f"{plan.nodes_needed} node(s))")
    return None
