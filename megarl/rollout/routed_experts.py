"""Routed experts (R3) on the RL side: which MoE rollouts record them, one sample's routes from
its requests' pieces, and the flat layout the trainer ships. The wire encoding is
`megarl.wire.routes`."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import torch

from megarl.wire.routes import decode_routed_experts, encode_routed_experts


def moe_routing_shape(model_dir: Path, cfg: Any) -> Optional[tuple[int, int]]:
    """(decoder layers, experts per token) when the rollout records routed experts of this MoE
    model (``rollout.return_routed_experts``, null = for MoE models), else None. Fills
    ``model.arch.num_experts`` from config.json when a recipe left it 0 (the launcher reads it)."""
    from megarl.rollout.launch import wants_routed_experts

    path = Path(model_dir) / "config.json"
    hf = json.loads(path.read_text()) if path.is_file() else {}
    experts = hf.get("num_experts") or hf.get("n_routed_experts") or hf.get("num_local_experts") or 0
    if experts and not cfg.model.arch.num_experts:
        cfg.model.arch.num_experts = int(experts)
    if not experts or not wants_routed_experts(cfg):
        return None
    return int(hf["num_hidden_layers"]), int(hf["num_experts_per_tok"])


def sample_routes(data: Optional[str], seq_len: int, shape: tuple[int, int], required: bool) -> Optional[torch.Tensor]:
    """One sample's routed experts from its ``meta_info.routed_experts``: int16 (int32 past 32767
    experts) ``[seq_len - 1, layers, top_k]``, checked against the sample's length. ``required``
    (routing replay): a server that sent none is an error naming the flag it needs."""
    if data is None:
        if required:
            raise RuntimeError("algorithm.routing_replay: rollout, but a rollout server returned no "
                               "meta_info.routed_experts (SGLang needs --enable-return-routed-experts; "
                               "rollout.return_routed_experts must not be false)")
        return None
    routes = decode_routed_experts(data, *shape)
    if routes.shape[0] != seq_len - 1:
        raise RuntimeError(f"routed experts of a sample cover {routes.shape[0]} positions, expected "
                           f"prompt + response - 1 = {seq_len - 1}")
    return _compact(routes)


def _compact(routes: torch.Tensor) -> torch.Tensor:
    """int16 unless an expert id needs more (a sample's routes are its largest per-token field)."""
    return routes.to(torch.int16) if routes.numel() == 0 or int(routes.max()) < 2 ** 15 else routes


def joined_routes(pieces: list[Optional[str]], covered: int, seq_len: int, shape: tuple[int, int],
                  required: bool) -> Optional[torch.Tensor]:
    """Routes of a sample that took several requests (a request continued after an abort, an
    agent's turns): each request asked for ``routed_experts_start_len`` = the first position the
    earlier ones had not covered, so the answers' pieces abut and together cover positions
    ``[0, covered)``. Returns ``[seq_len - 1, layers, top_k]`` (as :func:`sample_routes`), with -1
    rows for positions after ``covered`` that no request ran (an observation appended before a
    turn limit ended the trajectory)."""
    present = [p for p in pieces if p is not None]
    if not present:
        return sample_routes(None, seq_len, shape, required)
    if len(present) != len(pieces) and required:
        raise RuntimeError(f"{len(pieces) - len(present)} of a sample's {len(pieces)} requests returned no "
                           f"meta_info.routed_experts (algorithm.routing_replay: rollout needs every one)")
    parts = [decode_routed_experts(p, *shape) for p in present]
    rows = sum(int(p.shape[0]) for p in parts)
    if rows != covered or covered > seq_len - 1:
        raise RuntimeError(f"the routed experts of a sample's {len(parts)} requests cover {rows} positions, "
                           f"expected {covered} (of prompt + response - 1 = {seq_len - 1})")
    tail = torch.full((seq_len - 1 - covered, *shape), -1, dtype=torch.int32)
    routes = torch.cat(parts + [tail])
    return _compact(routes)


def routes_state(routes: Optional[torch.Tensor]) -> Optional[dict[str, Any]]:
    """A sample's routes for a JSON checkpoint (SGLang's base64 int32 + the row shape)."""
    if routes is None:
        return None
    return {"data": encode_routed_experts(routes), "shape": list(routes.shape[1:])}


def routes_from_state(state: Optional[dict[str, Any]]) -> Optional[torch.Tensor]:
    if not state:
        return None
    return _compact(decode_routed_experts(state["data"], *state["shape"]))


def flat_routes(routes: list[Optional[torch.Tensor]], seq_lens: list[int], shape: tuple[int, int]) -> torch.Tensor:
    """Per-sample routes (``[seq_len - 1, layers, top_k]`` or None) as one tensor aligned with a
    ``TokenBatch``'s tokens (``seq_fields``): ``[sum seq_len, layers, top_k]``, -1 where a position
    has no recorded route (each sequence's last token, samples without routes)."""
    dtype = torch.int32 if any(r is not None and r.dtype == torch.int32 for r in routes) else torch.int16
    out = torch.full((int(sum(seq_lens)), *shape), -1, dtype=dtype)
    pos = 0
    for r, n in zip(routes, seq_lens):
        if r is not None:
            out[pos:pos + r.shape[0]] = r.to(dtype)
        pos += n
    return out
