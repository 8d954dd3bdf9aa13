"""What a Megatron rank does about MoE routing and the LM head's precision (fidelity options).

* ``routing_flags``: the actor replays the rollout's experts (``algorithm.routing_replay:
  rollout``) in the old-logprob and training passes; its old-logprob pass also measures how often
  its own router agrees with the rollout (whatever the mode). Other roles route on their own.
* ``set_batch_routes``: before each micro-batch forward, hand each router of the chunk its layer's
  recorded experts (``batch.seq_fields["routed_experts"]``, ``[tokens, layers, top_k]`` aligned with the
  batch's tokens, -1 where none), in the
  token order megatron's router sees (sequence parallel: this rank's part of the sequence).
* ``collect_routing_stats``: the per-layer counters of this rank's routers since the last call,
  from the ranks that see distinct tokens (tp rank 0, or every TP rank under sequence parallel).
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from megarl.models.routing_replay import set_routes, take_stats

from megarl.data.batch import ROUTES_KEY



def trainer_fp32_lm_head(cfg: Any) -> bool:
    """``model.fp32_lm_head``, or when null the rollout's ``rollout.fp32_lm_head`` (both sides agree)."""
    own = cfg.model.fp32_lm_head
    return bool(cfg.rollout.fp32_lm_head if own is None else own)


def routing_flags(role: str, cfg: Any, forward_only: bool) -> dict[str, bool]:
    actor = role == "actor"
    return {"replay": actor and cfg.algorithm.routing_replay == "rollout", "measure": actor and forward_only}


def _seq_slice(seq_len: int) -> Optional[slice]:
    from megatron.core import parallel_state as mpu

    tp = mpu.get_tensor_model_parallel_world_size()
    if tp == 1:
        return None
    part = seq_len // tp
    rank = mpu.get_tensor_model_parallel_rank()
    return slice(rank * part, (rank + 1) * part)


def batch_rows_routes(mi: Any) -> Optional[list[Optional[torch.Tensor]]]:
    """Recorded experts per input row of micro-batch ``mi`` (``MicroInputs``): the packed row is
    the batch's sequences end to end (as ``tokens``), a padded row is one sample; None when the
    batch carries no routes (a placeholder micro-batch, a dense model, routing replay off)."""
    routes = mi.batch.seq_fields.get(ROUTES_KEY)
    if routes is None or mi.empty:
        return None
    if mi.cp is not None:   # context parallel: the rank's zig-zag rows of the padded sequences
        rows = torch.full((int(mi.cp.global_order.numel()),) + tuple(routes.shape[1:]), -1, dtype=routes.dtype)
        rows[mi.token_rows] = routes
        return [rows[mi.cp.local_rows.cpu()]]
    if mi.packed is not None:
        return [routes]
    offs = mi.batch.seq_offsets.tolist()
    return [routes[offs[i]:offs[i + 1]] for i in range(len(mi.batch))]


def set_batch_routes(model: torch.nn.Module, mi: Any, replay: bool, measure: bool) -> None:
    """Routes of micro-batch ``mi`` for the next forward of ``model`` on its ``[b, s]`` inputs; a
    batch without routes clears them (natural routing)."""
    shape = tuple(mi.input_ids.shape)
    seq_parallel = bool(getattr(getattr(model, "config", None), "sequence_parallel", False))
    set_routes(model, batch_rows_routes(mi), shape, replay, measure, _seq_slice(shape[1]) if seq_parallel else None)


def collect_routing_stats(chunks: list) -> dict[int, list[float]]:
    """This rank's per-layer routing counters (empty on ranks whose tokens another rank already
    counted)."""
    from megatron.core import parallel_state as mpu

    stats: dict[int, list[float]] = {}
    for chunk in chunks:
        stats.update(take_stats(chunk))
    seq_parallel = bool(chunks and getattr(chunks[0].config, "sequence_parallel", False))
    if mpu.get_tensor_model_parallel_rank() != 0 and not seq_parallel:
        return {}
    return stats


def merge_routing_stats(per_rank: list[dict[int, list[float]]]) -> dict[int, list[float]]:
    """Sum the ranks' per-layer counters (data-parallel ranks saw different samples, pipeline
    stages hold different layers)."""
    out: dict[int, list[float]] = {}
    for stats in per_rank:
        for layer, values in (stats or {}).items():
            acc = out.setdefault(int(layer), [0.0] * len(values))
            for i, v in enumerate(values):
                acc[i] += float(v)
    return out
