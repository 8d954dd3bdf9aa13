"""Expert choice in megarl's megatron MoE routers: HF-exact group-limited top-k, and routing
replay (R3: "Stabilizing MoE RL by aligning training and inference routers", Ma et al. 2025).

Where it plugs in. megatron-core 0.16.1 makes every top-k choice through
``topk_routing_with_score_function(..., router_replay=router.router_replay)``: when a router's
``router_replay`` is set, ``router_replay.get_replay_topk(scores, topk, num_groups, group_topk,
default_compute_topk)`` returns ``(gates, expert indices)``. megatron's own ``RouterReplay`` (turned
on by ``moe_enable_routing_replay``) registers every instance in one process-global list and
replays all of them from one flat list, which breaks when an actor and a reference share a process
(backend ``local``) and cannot say which layer a tensor belongs to under pipeline parallelism. So
megarl puts its own :class:`RouterHook` into that slot of each router of its own models, keyed by
the decoder layer (``router.layer_number - 1``), and leaves megatron's files alone.

What the hook does for the ``[tokens, experts]`` scores megatron hands it:

* **natural choice**: ``torch.topk`` (what megatron does), or for group-limited routing
  (DeepSeek-V3's ``n_group``/``topk_group``) HF's rule: a group's score is the sum of its best
  *two* experts. megatron's ``group_limited_topk`` sums the best ``topk // group_topk``, which is
  HF's rule only when that is 2 (DeepSeek-V3 itself: 8 // 4); ``tests/test_routing.py`` checks all
  valid small combinations against transformers' ``DeepseekV3TopkRouter``.
* **replay** (``target`` set): the experts the rollout recorded, per token (tokens without a
  record -- padding, the last position of a sequence -- keep the natural choice). The gates are
  ``scores.gather(1, replayed)``, and megatron then normalises/scales them as usual, so the router
  weights still receive gradients through the gates of the replayed experts (the choice itself is
  a top-k and has no gradient either way): with the replayed experts equal to the natural ones the
  gradients are exactly those of normal routing.
* **measure** (``reference`` set and ``measure``): per layer, how many of the rollout's top-k the
  natural choice shares (agreement), whether the whole set matches (exact), and the same overlap
  for the experts actually used.
"""
from __future__ import annotations

from typing import Callable, Iterable, Optional

import torch

STATS = ("natural_overlap", "natural_exact", "used_overlap", "tokens")


def hf_group_limited_topk(scores: torch.Tensor, topk: int, num_groups: int, group_topk: int) -> torch.Tensor:
    """Expert indices ``[tokens, topk]`` exactly as transformers' ``DeepseekV3TopkRouter``: keep the
    ``group_topk`` groups whose best two scores sum highest, then the ``topk`` best experts of those
    (other experts at ``-inf``). Needs at least two experts per group, as HF does."""
    tokens, experts = scores.shape
    per_group = experts // num_groups
    group_scores = scores.view(tokens, num_groups, per_group).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=group_topk, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores)
    group_mask.scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(tokens, num_groups, per_group).reshape(tokens, experts)
    masked = scores.masked_fill(~score_mask.bool(), float("-inf"))
    return torch.topk(masked, k=topk, dim=-1, sorted=False)[1]


def natural_topk(scores: torch.Tensor, topk: int, num_groups: Optional[int], group_topk: Optional[int]
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(gates, indices) of the router's own choice, HF's rule for group-limited routing."""
    if group_topk:
        idx = hf_group_limited_topk(scores, topk, int(num_groups), int(group_topk))
        return scores.gather(1, idx), idx
    return torch.topk(scores, k=topk, dim=1)


def overlap(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per row, how many of the indices in ``a`` [n, k] also appear in ``b`` [n, k] (sets)."""
    return (a.unsqueeze(-1) == b.unsqueeze(-2)).any(-1).sum(-1)


class RouterHook:
    """One megatron router's top-k choice (megatron calls ``get_replay_topk``)."""

    def __init__(self, layer: int, renormalize: bool = False):
        self.layer = layer                           # 0-based decoder layer (HF numbering)
        self.renormalize = renormalize               # gates / their sum (Qwen3-MoE top-1 + norm_topk_prob)
        self.target: Optional[torch.Tensor] = None   # [tokens, k] experts to use (replay)
        self.reference: Optional[torch.Tensor] = None  # [tokens, k] rollout's experts (measure)
        self.valid: Optional[torch.Tensor] = None    # [tokens] bool: tokens that have a record
        self.measure = False
        self.stats = torch.zeros(len(STATS), dtype=torch.float64)

    def set(self, reference: Optional[torch.Tensor], valid: Optional[torch.Tensor], replay: bool,
            measure: bool) -> None:
        self.reference, self.valid = reference, valid
        self.target = reference if replay else None
        self.measure = measure and reference is not None

    def clear(self) -> None:
        self.set(None, None, False, False)

    def take_stats(self) -> torch.Tensor:
        out, self.stats = self.stats.cpu(), torch.zeros(len(STATS), dtype=torch.float64)
        return out

    def get_replay_topk(self, scores: torch.Tensor, topk: int, num_groups: Optional[int] = None,
                        group_topk: Optional[int] = None, default_compute_topk: Optional[Callable] = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        gates, idx = natural_topk(scores, topk, num_groups, group_topk)
        if self.reference is None:
            return self._gates(gates), idx
        if self.reference.shape != idx.shape:
            raise RuntimeError(f"routing replay, layer {self.layer}: the router sees {idx.shape[0]} tokens x top-k "
                               f"{idx.shape[1]} but the recorded experts are {tuple(self.reference.shape)}")
        reference = self.reference.to(idx.device, torch.long)
        valid = self.valid.to(idx.device)
        used = idx
        if self.target is not None:
            used = torch.where(valid.unsqueeze(-1), reference, idx)
            gates = scores.gather(1, used)
        if self.measure:
            n = valid.sum()
            nat = overlap(idx, reference)[valid]
            counts = torch.stack([nat.sum() / topk, (nat == topk).sum(), overlap(used, reference)[valid].sum() / topk,
                                  n]).double()
            self.stats = self.stats.to(counts.device) + counts   # stays on the device: no sync per layer
        return self._gates(gates), used

    def _gates(self, gates: torch.Tensor) -> torch.Tensor:
        return gates / gates.sum(dim=-1, keepdim=True) if self.renormalize else gates


def routers(model: torch.nn.Module) -> Iterable[torch.nn.Module]:
    from megatron.core.transformer.moe.router import TopKRouter

    return (m for m in model.modules() if isinstance(m, TopKRouter))


def install_router_hooks(model: torch.nn.Module, renormalize: bool = False) -> list[RouterHook]:
    """Give every MoE router of ``model`` its :class:`RouterHook` (once; returns them by layer)."""
    hooks = []
    for router in routers(model):
        if not isinstance(router.router_replay, RouterHook):
            if router.layer_number is None:
                raise RuntimeError("a megatron router has no layer_number: cannot key its routing by layer")
            router.router_replay = RouterHook(int(router.layer_number) - 1, renormalize)
        hooks.append(router.router_replay)
    hooks = sorted(hooks, key=lambda h: h.layer)
    model._megarl_router_hooks = hooks
    return hooks


def router_hooks(model: torch.nn.Module) -> list[RouterHook]:
    """The hooks of ``model``'s routers (none for a dense model), by layer; ``model`` may be wrapped
    (megatron DDP: ``.module``)."""
    inner = model
    while not hasattr(inner, "_megarl_router_hooks") and hasattr(inner, "module"):
        inner = inner.module
    cached = getattr(inner, "_megarl_router_hooks", None)
    if cached is not None:
        return cached
    return sorted((r.router_replay for r in routers(model) if isinstance(r.router_replay, RouterHook)),
                  key=lambda h: h.layer)


def layer_targets(routes: list[Optional[torch.Tensor]], layer: int, batch: int, seq_len: int, top_k: int,
                  seq_slice: Optional[slice] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Recorded experts of one layer in megatron's router token order.

    ``routes[i]``: int ``[n_i, num_layers, top_k]``, the experts of positions ``0 .. n_i - 1`` of
    input row ``i`` (or None); a negative entry marks a position without a recorded route (the last
    token of each packed sequence, a sample the rollout sent none for). Returns ``(experts [seq*batch, top_k], valid [seq*batch])`` for the
    right-padded ``[batch, seq_len]`` input, flattened as megatron's ``[s, b]`` hidden states are
    (row ``s * batch + b``), restricted to ``seq_slice`` of the sequence (sequence parallel)."""
    experts = torch.arange(top_k, dtype=torch.long).expand(batch, seq_len, top_k).clone()
    valid = torch.zeros(batch, seq_len, dtype=torch.bool)
    for i, r in enumerate(routes):
        if r is None:
            continue
        n = min(int(r.shape[0]), seq_len)
        rows = r[:n, layer].to(torch.long)
        ok = rows[:, 0] >= 0
        experts[i, :n] = torch.where(ok.unsqueeze(1), rows, experts[i, :n])
        valid[i, :n] = ok
    experts, valid = experts.transpose(0, 1), valid.transpose(0, 1)   # [s, b, k], [s, b]
    if seq_slice is not None:
        experts, valid = experts[seq_slice], valid[seq_slice]
    return experts.reshape(-1, top_k), valid.reshape(-1)


def set_routes(model: torch.nn.Module, routes: Optional[list[Optional[torch.Tensor]]], shape: tuple[int, int],
               replay: bool, measure: bool, seq_slice: Optional[slice] = None) -> None:
    """Before a forward of ``[batch, seq_len]`` = ``shape`` inputs: give each router of ``model``
    its layer's recorded experts (replayed when ``replay``, counted when ``measure``); ``routes``
    None clears them (natural routing)."""
    for hook in router_hooks(model):
        if routes is None or not any(r is not None for r in routes):
            hook.clear()
            continue
        top_k = next(r for r in routes if r is not None).shape[-1]
        experts, valid = layer_targets(routes, hook.layer, shape[0], shape[1], top_k, seq_slice)
        hook.set(experts, valid, replay, measure)


def take_stats(model: torch.nn.Module) -> dict[int, list[float]]:
    """Per layer: the counters in ``STATS`` since the last call (then reset)."""
    return {h.layer: h.take_stats().tolist() for h in router_hooks(model)}


def agreement_metrics(per_layer: dict[int, list[float]]) -> dict[str, float]:
    """``routing/*`` metrics from summed per-layer counters: agreement (share of the rollout's top-k
    that the trainer's router picks itself), exact (whole set equal), used agreement (experts the
    forward really used: 1.0 under replay), per layer and over all layers."""
    out: dict[str, float] = {}
    total = torch.zeros(len(STATS), dtype=torch.float64)
    for layer in sorted(per_layer):
        s = torch.tensor(per_layer[layer], dtype=torch.float64)
        if s[3] <= 0:
            continue
        total += s
        out[f"routing/agreement_layer{layer:02d}"] = float(s[0] / s[3])
    if total[3] > 0:
        out.update({"routing/agreement": float(total[0] / total[3]), "routing/exact_match": float(total[1] / total[3]),
                    "routing/used_agreement": float(total[2] / total[3]), "routing/tokens": float(total[3])})
    return out
