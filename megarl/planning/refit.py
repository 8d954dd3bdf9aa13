"""Refit (weight push) time model: how long one push of the actor's weights to the servers takes.

Why a model: at the scale megarl promises, a push cannot be timed before launch, and which phase
keeps the time decides which change to the push pays. The model charges each phase of a push to
the resource it moves bytes over and adds the phases (no overlap assumed, so it errs long):

* **gather** -- the bytes a sender receives from the ranks holding the other shards (TP shards,
  expert-parallel ranks' experts, ETP shards; colocated IPC: the whole model on every rank), each
  peer's bytes over NVLink when the peer is on the sender's node, over the network otherwise;
* **quantize** -- block FP8 servers: the model-dtype bytes of the projections a sender quantizes;
* **convert** -- the sender's megatron -> HF layout (fused QKV / gate-up split into HF tensors: one
  copy of what it sends);
* **pack** -- the sender's copy into its buckets (and its checksum, when one is sent);
* **send** -- broadcast transport: every sender's bytes reach every server rank (a pipelined
  chain, as NCCL broadcasts): each node takes in every byte sent from another node over its NICs,
  each server GPU takes in every byte over NVLink, each sender pushes its bytes out once; the
  busiest of these links sets the time. CUDA IPC moves no byte here;
* **apply** -- each server rank: open the IPC payload (IPC only), verify (the embedded engine:
  checksum and finiteness; SGLang ignores ``megarl_checksums``), write its 1/TP slice;
* **buckets** -- a fixed cost per bucket (one HTTP round trip and the server's bookkeeping).

Senders run in parallel, so each phase costs its slowest sender. Two shapes are modelled:
``stage`` -- what ``megarl.sync`` does: one sender per pipeline stage gathers its TP shards and
every expert-parallel rank's experts, and ``expert`` -- the candidate where each expert-parallel
rank sends its own experts (the stage sender keeps the dense weights), so the expert gather goes
away and quantization is spread over the EP ranks (a run setting:
``sync.expert_senders``, which makes it the modelled push). Colocated CUDA IPC has two:
``everywhere`` -- what ``sync/colocated.py`` does, every rank gathers the whole model -- and, across
nodes, the candidate ``node`` (checkpoint-engine's shape, modelled only): each node fetches the
served model once, split over its GPUs, and all-gathers it over NVLink.

Bytes come from ``planning/params.py`` (the plan's own counts); the block-FP8 byte count is the
one the rollout memory plan uses. Rates are settings (``cluster.nvlink_gbps``,
``cluster.network_gbps``) or measured constants below; ``benchmarks/bench_refit_model.py`` checks
the structure against real pushes over network namespaces on CPU, with its rates measured in the
same run.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from megarl.config.schema import ModelArch
from megarl.planning.params import is_moe_layer, model_params, stage_layers

FP8_SCALE_OVERHEAD = 4 / 128 ** 2      # one fp32 scale per 128 x 128 block

# GPU rates, bytes per second. Each from benchmarks/RESULTS.md "Weight push": bench_sync.py
# --device cuda --shape qwen2.5-7b --transport tensor --bucket-mb 1024 (15.23 GB, 16 buckets,
# CUDA IPC into the embedded server on the same GPU), H200, 2026-12-03, unless said otherwise.
GPU_PACK_BPS = 15.23e9 / 12.1e-3                 # pack 12.1 ms (also the megatron -> HF copy's rate: not measured apart)
GPU_IPC_RECEIVE_BPS = 15.23e9 / 6.0e-3           # server receive 6.0 ms (opening the IPC payload)
GPU_VERIFY_BPS = 15.23e9 / 12.8e-3               # server verify 12.8 ms, bf16 (finiteness)
GPU_VERIFY_CHECKSUM_BPS = 15.23e9 / 30.0e-3      # server verify 30.0 ms with --checksum
GPU_VERIFY_FP8_BPS = 8.71e9 / 0.0115             # FP8 verify 10.0-13.1 ms of 8.71 GB with the byte-check kernel (same
#                                                  command --fp8, H100, 2026-12-08)
GPU_WRITE_BPS = 15.23e9 / 9.4e-3                 # server apply 9.4 ms
GPU_CHECKSUM_BPS = 15.23e9 / 3.9e-3              # sender checksum: --checksum push 0.0788 vs 0.0577 s, less the
#                                                  server's extra verify (30.0 - 12.8 ms): 3.9 ms
GPU_QUANTIZE_BPS = 13.05e9 / 8.71e-3             # the block-FP8 kernel: 13.05 GB of bf16 projections in 8.71 ms
#                                                  (bench_fp8_push_kernels.py --shape qwen2.5-7b, H100, 2026-12-08)
# Per bucket (a round trip) and per HF tensor (sender copy launch, metadata over HTTP, the server's
# checks, placement and copy launch), fit with every rate above to 16 one-GPU IPC pushes on an H100
# (2026-12-08; benchmarks/results/h100_fp8_push_kernels_sync.jsonl, h100_push_cost_sweep.jsonl):
# Qwen2.5 0.5B / 1.5B / 3B / 7B and Qwen2-shaped hidden 512 x 8 / 128 layers (75 vs 1,155 counted
# tensors at one width: the per-tensor cost apart from a per-push one), bf16 and FP8; predicted /
# measured 0.68-1.22. Tensors as `layer_tensors` counts them (Qwen2's q/k/v biases are not: the fit
# carries them, so a model without biases is overstated by up to a quarter)
GPU_BUCKET_OVERHEAD_S = 0.90e-3
GPU_TENSOR_OVERHEAD_S = 106e-6
SHAPES = {"stage": "one sender per pipeline stage", "expert": "every EP rank sends its own experts",
          "everywhere": "every rank gathers the whole model (CUDA IPC)",
          "node": "each node gathers the model once, split over its GPUs, shared over NVLink (CUDA IPC)"}
GBPS = 1e9                                        # the cluster.*_gbps settings are GB/s (bytes)


@dataclass(frozen=True)
class Rates:
    """Bytes per second of each resource a push uses (0 = that step does not happen)."""

    nvlink: float            # one GPU's in-node link, one direction (CPU netns: gloo inside a node)
    network: float           # one NIC across nodes (CPU netns: the node's veth)
    nics_per_node: int       # NICs a node's traffic spreads over
    pack: float
    convert: float           # megatron -> HF tensors on the sender (one copy)
    quantize: float
    checksum: float          # sender checksum (0: none sent)
    verify: float            # server verify (0: the server does not verify, e.g. SGLang)
    write: float             # server: copy its slice into its parameters
    ipc_receive: float       # server: open an IPC payload (tensor transport)
    bucket_overhead_s: float
    tensor_overhead_s: float = 0.0   # per HF tensor a server rank takes (checks, copies, metadata)


@dataclass(frozen=True)
class Layout:
    """Where the actor's ranks and the server ranks sit (megatron's rank order: tp-cp-dp inside a
    pipeline stage's block of ranks, experts etp-ep-edp; ranks fill nodes in order)."""

    tp: int
    pp: int
    ep: int
    etp: int
    world: int               # actor ranks
    ranks_per_node: int      # actor ranks per node
    server_tp: int
    servers: int
    server_first_node: int   # colocated: 0; disaggregated: the first node after the trainer's
    server_ranks_per_node: int

    def node(self, rank: int) -> int:
        return rank // max(self.ranks_per_node, 1)

    def server_nodes(self) -> list[int]:
        per = max(self.server_ranks_per_node, 1)
        return sorted({self.server_first_node + j // per for j in range(self.servers * self.server_tp)})


@dataclass(frozen=True)
class StageBytes:
    """Parameter counts of one pipeline stage, split by how they shard and how they are served."""

    tp_sharded: int          # attention, dense MLP / shared experts, embedding / output: over TP
    replicated: int          # norms, router, latent norms: whole on every TP rank
    experts: int             # routed experts of the stage, all EP ranks together
    projections: int         # of tp_sharded: the attention and MLP projections (block FP8 when served so)
    tensors: int = 0         # HF tensors of the stage (biases and per-head norms not counted)
    quantized_tensors: int = 0   # of those, block FP8 when served so (each then adds a scale tensor)


@dataclass
class Sender:
    rank: int
    gather_local: float = 0.0    # bytes from peers on its node
    gather_remote: float = 0.0   # bytes from peers on other nodes
    quantize_in: float = 0.0     # model-dtype bytes it quantizes
    held: float = 0.0            # model-dtype bytes of everything it sends (converted to HF tensors)
    payload: float = 0.0         # bytes it sends


@dataclass
class PhaseTime:
    name: str
    seconds: float
    bytes: float                 # the slowest sender's (send: the busiest link's) bytes
    link: str
    parallel: int                # senders working at once


@dataclass
class RefitEstimate:
    shape: str                   # stage | expert | everywhere | node (colocated IPC: see SHAPES)
    transport: str               # distributed | tensor
    senders: int
    payload_bytes: float         # every sender's bytes together
    seconds: float
    phases: list[PhaseTime] = field(default_factory=list)
    slowest_link: str = ""
    slowest_link_seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        return SHAPES[self.shape]

    def phase(self, name: str) -> PhaseTime:
        return next(p for p in self.phases if p.name == name)

    def to_json(self) -> dict:
        return asdict(self)


def stage_bytes(arch: ModelArch, layers_of_stages: list[list[int]]) -> list[StageBytes]:
    """Each stage's counts from ``params.model_params`` (embedding on the first stage, output layer
    and final norm on the last, as megatron builds them)."""
    mp = model_params(arch)
    out = []
    for s, layers in enumerate(layers_of_stages):
        tp_sharded = sum(mp.layers[i].attention + mp.layers[i].mlp for i in layers)
        projections = tp_sharded
        replicated = sum(mp.layers[i].replicated for i in layers)
        experts = sum(mp.layers[i].experts for i in layers)
        counts = [layer_tensors(arch, i) for i in layers]
        tensors, quantized = sum(c[0] for c in counts), sum(c[1] for c in counts)
        if s == 0:
            tp_sharded += mp.embedding
            tensors += 1
        if s == len(layers_of_stages) - 1:
            tp_sharded += mp.output
            replicated += mp.final_norm
            tensors += 1 + (1 if mp.output else 0)
        out.append(StageBytes(tp_sharded=tp_sharded, replicated=replicated, experts=experts, projections=projections,
                              tensors=tensors, quantized_tensors=quantized))
    return out


def layer_tensors(arch: ModelArch, index: int) -> tuple[int, int]:
    """(HF tensors, of them block-FP8 projections) of one layer: two norms; q/k/v/o, or MLA's
    q (or q_a, its norm, q_b), kv_a, its norm, kv_b and o; a dense MLP's gate/up/down, or a MoE
    layer's router, three per routed expert and three for the shared experts."""
    if arch.kv_lora_rank > 0:
        attn = 5 if arch.q_lora_rank else 4
        plain = 2 + (2 if arch.q_lora_rank else 1)
    else:
        attn, plain = 4, 2
    if is_moe_layer(arch, index):
        mlp = 3 * arch.num_experts + (3 if arch.num_shared_experts else 0)
        plain += 1
    else:
        mlp = 3
    return plain + attn + mlp, attn + mlp


def served_tensors(stages: list[StageBytes], fp8: bool) -> int:
    """HF tensors of the served model (block FP8: one scale tensor per quantized weight)."""
    return sum(st.tensors + (st.quantized_tensors if fp8 else 0) for st in stages)


def _served(params_fp8: float, params_plain: float, fp8: bool, elem: int) -> float:
    """Bytes on the wire: block FP8 projections at 1 byte + scales, everything else in the model dtype."""
    if fp8:
        return params_fp8 * (1 + FP8_SCALE_OVERHEAD) + params_plain * elem
    return (params_fp8 + params_plain) * elem


def _stage_served(st: StageBytes, fp8: bool, elem: int) -> float:
    """A whole stage's bytes as served: its projections and experts (block FP8 when so served) and
    the rest in the model dtype."""
    return _served(st.projections + st.experts, st.tp_sharded - st.projections + st.replicated, fp8, elem)


def _peer_bytes(sender: Sender, lay: Layout, peer: int, nbytes: float) -> None:
    if lay.node(peer) == lay.node(sender.rank):
        sender.gather_local += nbytes
    else:
        sender.gather_remote += nbytes


def broadcast_senders(stages: list[StageBytes], lay: Layout, shape: str, fp8: bool, elem: int) -> list[Sender]:
    """The senders of a broadcast push and what each gathers, quantizes and sends."""
    block = lay.world // lay.pp
    senders = []
    for s, st in enumerate(stages):
        first = s * block
        lead = Sender(rank=first)
        for t in range(1, lay.tp):                       # TP all-gather of the dense weights
            _peer_bytes(lead, lay, first + t, st.tp_sharded / lay.tp * elem)
        per_ep = st.experts / lay.ep
        for t in range(1, lay.etp):                      # expert-TP all-gather of its own experts
            _peer_bytes(lead, lay, first + t, per_ep / lay.etp * elem)
        dense_fp8 = st.projections
        dense_plain = st.tp_sharded - st.projections + st.replicated
        if shape == "stage" or lay.ep == 1:
            for e in range(1, lay.ep):                   # every other EP rank's experts, to the sender
                _peer_bytes(lead, lay, first + e * lay.etp, per_ep * elem)
            lead.quantize_in = (dense_fp8 + st.experts) * elem if fp8 else 0.0
            lead.held = (dense_fp8 + st.experts + dense_plain) * elem
            lead.payload = _served(dense_fp8 + st.experts, dense_plain, fp8, elem)
            senders.append(lead)
            continue
        lead.quantize_in = (dense_fp8 + per_ep) * elem if fp8 else 0.0
        lead.held = (dense_fp8 + per_ep + dense_plain) * elem
        lead.payload = _served(dense_fp8 + per_ep, dense_plain, fp8, elem)
        senders.append(lead)
        for e in range(1, lay.ep):                       # each EP rank's ETP0 sends its own experts
            r = Sender(rank=first + e * lay.etp)
            for t in range(1, lay.etp):
                _peer_bytes(r, lay, r.rank + t, per_ep / lay.etp * elem)
            r.quantize_in = per_ep * elem if fp8 else 0.0
            r.held = per_ep * elem
            r.payload = _served(per_ep, 0.0, fp8, elem)
            senders.append(r)
    return senders


def _stage_held(st: StageBytes, elem: int) -> float:
    """A whole stage in the model dtype (every TP shard and expert gathered)."""
    return (st.tp_sharded + st.replicated + st.experts) * elem


def _gather_own_stage(snd: Sender, lay: Layout, st: StageBytes, stage: int, pos: int, elem: int) -> None:
    """Its own stage's TP shards and other EP ranks' experts, from the next rank of the stage's block."""
    block = lay.world // lay.pp
    own = (st.tp_sharded / lay.tp + st.replicated + st.experts / (lay.ep * lay.etp)) * elem
    peer = stage * block + (pos + 1) % block if block > 1 else snd.rank
    _peer_bytes(snd, lay, peer, _stage_held(st, elem) - own)


def ipc_senders(stages: list[StageBytes], lay: Layout, fp8: bool, elem: int) -> list[Sender]:
    """Colocated CUDA IPC (``sync/colocated.py``): every rank gathers, quantizes and packs the
    whole model (TP / EP all-gathers in its stage, the other stages by a pipeline broadcast from the
    rank at its position in that stage)."""
    block = lay.world // lay.pp
    out = []
    for r in range(lay.world):
        s, pos = divmod(r, block)
        snd = Sender(rank=r)
        for t, st in enumerate(stages):
            if t == s:
                _gather_own_stage(snd, lay, st, s, pos, elem)
            else:
                _peer_bytes(snd, lay, t * block + pos, _stage_held(st, elem))
        snd.quantize_in = sum(st.projections + st.experts for st in stages) * elem if fp8 else 0.0
        snd.held = sum(_stage_held(st, elem) for st in stages)
        snd.payload = sum(_stage_served(st, fp8, elem) for st in stages)
        out.append(snd)
    return out


def node_ipc_senders(stages: list[StageBytes], lay: Layout, fp8: bool, elem: int) -> list[Sender]:
    """The colocated multi-node push (``sync/colocated.py::iter_hf_weights_by_node``, checkpoint-
    engine's shape): each stage's ranks gather their stage's TP shards and experts inside the node
    and quantize the stage; each stage's served bytes then cross to every other node once -- a
    node's k ranks take turns by tensor, so its k NICs share them -- and every tensor is broadcast
    inside the node (the ``send`` phase, NVLink), so every GPU holds the whole served model for its
    own server rank's IPC handles. A stage with ranks on a node is shared from them, without the
    network, in the share of its block that is there."""
    block = lay.world // lay.pp
    out = []
    for r in range(lay.world):
        node, (s, pos) = lay.node(r), divmod(r, block)
        k = sum(1 for q in range(lay.world) if lay.node(q) == node)
        snd = Sender(rank=r)
        for t, st in enumerate(stages):
            served = _stage_served(st, fp8, elem)
            if t == s:                                     # its own stage: gathered inside the stage's block
                _gather_own_stage(snd, lay, st, s, pos, elem)
                snd.held += _stage_held(st, elem)
                if fp8:
                    snd.quantize_in = (st.projections + st.experts) * elem
                continue
            here = sum(1 for q in range(t * block, (t + 1) * block) if lay.node(q) == node) / block
            snd.gather_local += served * here / k
            snd.gather_remote += served * (1 - here) / k
        snd.payload = sum(_stage_served(st, fp8, elem) for st in stages) / max(k, 1)
        out.append(snd)
    return out


def _send_phase(senders: list[Sender], lay: Layout, rates: Rates) -> PhaseTime:
    """Broadcast of every sender's payload to every server rank: the busiest link sets the time."""
    server_nodes = lay.server_nodes()
    links: list[tuple[float, float, str]] = []          # (seconds, bytes, link)
    for snd in senders:                                   # a sender's own way out
        remote = any(n != lay.node(snd.rank) for n in server_nodes)
        bps = rates.network if remote and lay.node(snd.rank) not in server_nodes else rates.nvlink
        links.append((snd.payload / bps, snd.payload,
                      f"sender rank {snd.rank} out ({'network' if bps == rates.network else 'NVLink'})"))
    nodes = sorted({lay.node(s.rank) for s in senders} | set(server_nodes))
    for n in nodes:                                       # a node's NICs: bytes in from other nodes, out to them
        into = sum(s.payload for s in senders if lay.node(s.rank) != n) if n in server_nodes else 0.0
        out = sum(s.payload for s in senders if lay.node(s.rank) == n) if any(m != n for m in server_nodes) else 0.0
        load = max(into, out)
        if load:
            links.append((load / (rates.network * max(rates.nics_per_node, 1)), load,
                          f"network of node {n} ({rates.nics_per_node} NIC{'s' if rates.nics_per_node > 1 else ''})"))
    if lay.server_ranks_per_node > 1:                     # inside a server node every GPU takes every byte
        total = sum(s.payload for s in senders)
        links.append((total / rates.nvlink, total, "NVLink into each server GPU"))
    seconds, nbytes, link = max(links)
    return PhaseTime("send", seconds, nbytes, link, len(senders))


def estimate(stages: list[StageBytes], lay: Layout, rates: Rates, *, transport: str, shape: str, fp8: bool,
             elem: int, bucket_bytes: int) -> RefitEstimate:
    """The modelled seconds of one push, phase by phase (see the module doc)."""
    if transport == "tensor" and shape == "node":
        senders = node_ipc_senders(stages, lay, fp8, elem)
    elif transport == "tensor":
        senders, shape = ipc_senders(stages, lay, fp8, elem), "everywhere"
    elif transport == "distributed":
        senders = broadcast_senders(stages, lay, shape, fp8, elem)
    else:
        raise ValueError(f"transport {transport!r} is not modelled (distributed | tensor)")
    n = len(senders)

    def slowest(name: str, cost, nbytes, link: str) -> PhaseTime:
        worst = max(senders, key=cost)
        return PhaseTime(name, cost(worst), nbytes(worst), link, n)

    gather = slowest("gather", lambda s: s.gather_local / rates.nvlink + s.gather_remote / rates.network,
                     lambda s: s.gather_local + s.gather_remote,
                     "network + NVLink" if any(s.gather_remote for s in senders) else "NVLink")
    phases = [gather]
    if fp8:
        phases.append(slowest("quantize", lambda s: s.quantize_in / rates.quantize, lambda s: s.quantize_in, "sender GPU"))
    phases.append(slowest("convert", lambda s: s.held / rates.convert, lambda s: s.held, "sender GPU"))
    pack_rate = (1 / rates.pack + (1 / rates.checksum if rates.checksum else 0.0))
    phases.append(slowest("pack", lambda s: s.payload * pack_rate, lambda s: s.payload, "sender GPU"))
    whole = sum(_stage_served(st, fp8, elem) for st in stages)   # the served model: one server rank's IPC receive
    if transport == "distributed":
        phases.append(_send_phase(senders, lay, rates))
    elif shape == "node":
        k = max(lay.ranks_per_node, 1)
        phases.append(PhaseTime("send", whole * (k - 1) / k / rates.nvlink, whole * (k - 1) / k,
                                "NVLink all-gather inside each node", n))
    else:
        phases.append(PhaseTime("send", 0.0, 0.0, "none (CUDA IPC: a handle to the same GPU)", n))
    received = sum(s.payload for s in senders) if transport == "distributed" else whole
    per_byte = (1 / rates.ipc_receive if transport == "tensor" and rates.ipc_receive else 0.0) \
        + (1 / rates.verify if rates.verify else 0.0) + 1 / (rates.write * lay.server_tp)
    phases.append(PhaseTime("apply", received * per_byte, received, "server GPU", lay.servers * lay.server_tp))
    buckets = max(math.ceil((whole if shape == "node" else s.payload) / max(bucket_bytes, 1)) for s in senders)
    phases.append(PhaseTime("buckets", buckets * rates.bucket_overhead_s, 0.0, f"{buckets} bucket round trips", n))
    if rates.tensor_overhead_s:
        count = served_tensors(stages, fp8)
        phases.append(PhaseTime("tensors", count * rates.tensor_overhead_s, 0.0,
                                f"{count} tensors through each server rank", lay.servers * lay.server_tp))
    total = sum(p.seconds for p in phases)
    linked = [p for p in phases if p.name in ("gather", "send") and p.seconds]
    worst = max(linked, key=lambda p: p.seconds) if linked else None
    return RefitEstimate(shape=shape, transport=transport, senders=n, payload_bytes=sum(s.payload for s in senders),
                         seconds=total, phases=phases, slowest_link=f"{worst.name}: {worst.link}" if worst else "none",
                         slowest_link_seconds=worst.seconds if worst else 0.0)


def gpu_rates(cfg: Any, fp8: bool, checksum: bool, engine_verifies: bool) -> Rates:
    """Rates of a GPU cluster: link settings from ``cluster.*_gbps``, the rest measured (above)."""
    c = cfg.cluster
    verify = 0.0
    if engine_verifies:
        verify = GPU_VERIFY_FP8_BPS if fp8 else (GPU_VERIFY_CHECKSUM_BPS if checksum else GPU_VERIFY_BPS)
    return Rates(nvlink=c.nvlink_gbps * GBPS, network=c.network_gbps * GBPS, nics_per_node=max(c.gpus_per_node, 1),
                 pack=GPU_PACK_BPS, convert=GPU_PACK_BPS, quantize=GPU_QUANTIZE_BPS,
                 checksum=GPU_CHECKSUM_BPS if checksum else 0.0,
                 verify=verify, write=GPU_WRITE_BPS, ipc_receive=GPU_IPC_RECEIVE_BPS,
                 bucket_overhead_s=GPU_BUCKET_OVERHEAD_S, tensor_overhead_s=GPU_TENSOR_OVERHEAD_S)


@dataclass
class RefitPlan:
    """The plan's refit section: the configured push and the candidate shape the model shows
    (broadcast with EP: expert senders; colocated IPC across nodes: one gather per node)."""

    transport: str
    current: Optional[RefitEstimate]
    candidate: Optional[RefitEstimate]
    notes: list[str] = field(default_factory=list)

    def cut(self) -> Optional[tuple[float, PhaseTime]]:
        """(seconds the candidate saves, the candidate's longest phase: what keeps the remainder)."""
        if self.current is None or self.candidate is None:
            return None
        return self.current.seconds - self.candidate.seconds, max(self.candidate.phases, key=lambda p: p.seconds)

    def to_json(self) -> dict:
        cut = self.cut()
        return {"transport": self.transport, "notes": self.notes,
                "candidate_saves_s": cut[0] if cut else None,
                "remainder_phase": cut[1].name if cut else None,
                "current": self.current.to_json() if self.current else None,
                "candidate": self.candidate.to_json() if self.candidate else None,
                "seconds": self.current.seconds if self.current else None,
                "slowest_link": self.current.slowest_link if self.current else None}


def plan_refit(cfg: Any, fp8: bool, server_tp: int, servers: int) -> RefitPlan:
    """The refit section of ``megarl plan`` for a GPU run (CPU runs: measured, not modelled)."""
    from megarl.config.validate import colocated_gather, node_gather_misfit, push_transport

    transport = push_transport(cfg)
    notes: list[str] = []
    if cfg.cluster.device != "cuda":
        return RefitPlan(transport, None, None, ["CPU run: GPU rates do not apply (benchmarks/bench_refit_model.py "
                                                 "measures CPU pushes)"])
    if transport not in ("distributed", "tensor"):
        return RefitPlan(transport, None, None, [f"sync.transport {cfg.sync.transport}: not modelled"])
    p = cfg.actor.parallel
    gpn = max(cfg.cluster.gpus_per_node, 1)
    colocated = cfg.placement.mode == "colocated"
    lay = Layout(tp=p.tp, pp=p.pp, ep=p.ep, etp=p.etp, world=cfg.actor.gpus, ranks_per_node=gpn, server_tp=server_tp,
                 servers=servers, server_first_node=0 if colocated else math.ceil(cfg.actor.gpus / gpn),
                 server_ranks_per_node=gpn)
    elem = 4 if cfg.model.dtype == "float32" else 2
    checksum = cfg.sync.verify_checksum if cfg.sync.verify_checksum is not None else transport != "tensor"
    rates = gpu_rates(cfg, fp8, checksum, engine_verifies=cfg.rollout.engine == "embedded")
    stages = stage_bytes(cfg.model.arch, stage_layers(cfg.model.arch.num_layers, p))
    bucket = int(cfg.sync.bucket_mb * (1 << 20))
    experts = transport == "distributed" and p.ep > 1 and cfg.sync.expert_senders
    gather = colocated_gather(cfg)
    shape = "expert" if experts else ("node" if gather == "node" else "stage")
    current = estimate(stages, lay, rates, transport=transport, shape=shape, fp8=fp8, elem=elem, bucket_bytes=bucket)
    candidate = None
    if transport == "distributed" and p.ep > 1 and not experts:
        candidate = estimate(stages, lay, rates, transport=transport, shape="expert", fp8=fp8, elem=elem,
                             bucket_bytes=bucket)
    multi_node = len({lay.node(r) for r in range(lay.world)}) > 1
    if transport == "tensor" and multi_node and gather == "everywhere":
        if not node_gather_misfit(p.tp, p.ep, p.etp, gpn):
            candidate = estimate(stages, lay, rates, transport=transport, shape="node", fp8=fp8, elem=elem,
                                 bucket_bytes=bucket)
            notes.append("sync.colocated_gather: everywhere -- the candidate is the one-gather-per-node push "
                         "(sync.colocated_gather: node or auto)")
    if transport == "tensor" and multi_node and gather == "node":
        everywhere = estimate(stages, lay, rates, transport=transport, shape="everywhere", fp8=fp8, elem=elem,
                              bucket_bytes=bucket)
        notes.append(f"one gather per node (sync.colocated_gather): the everywhere gather would take "
                     f"{everywhere.seconds:.2f} s")
    if cfg.rollout.engine == "sglang":
        notes.append("apply: SGLang's own load rate is not measured; the embedded engine's write rate stands in "
                     "(SGLang does not verify)")
    from megarl.config.colocation import adapter_push

    if adapter_push(cfg):
        notes.append("actor.lora.push: adapter -- each push loads LoRA adapters only; the seconds above are a full "
                     "(merged) push, e.g. a restarted server's")
    if any(is_moe_layer(cfg.model.arch, i) for i in range(cfg.model.arch.num_layers)) and p.ep == 1:
        notes.append("ep = 1: the expert-sender candidate is the current shape")
    return RefitPlan(transport, current, candidate, notes)
