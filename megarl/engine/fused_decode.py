"""The embedded engine's decode step in ~10 kernels per layer (Triton, `kernels.py`).

Why: the torch decode body (`DecoderModel._layer`) is the reference and serves every other shape
of forward, but a decode step runs it with one token per row, where each of its ~37 kernels per
layer is tiny and the step is bound by kernel count, not bytes. Here a layer is: residual add +
RMSNorm (one kernel), the q/k/v projections as ONE GEMM, RoPE + the cache write (one kernel),
flash-decoding attention over the keys each row holds (one or two), o_proj, add + RMSNorm, the
gate/up projections as ONE GEMM, SiLU-and-mul (one), down_proj. The layer loop (`run_layers`) is
shared with the prefill (`fused_prefill.py`), which differs only in its attention.

The fused projections cost no copy: the model keeps q/k/v (and gate/up) weights back to back in
its flat parameter buffer (`DecoderModel._alloc`), so their concatenation is a view (`FusedViews`).
Layouts where they are not adjacent, LoRA adapters and head dims that are not powers of two use
the torch body instead (`DecoderModel.decode_kernels`).

With ``decode_kernels = "triton-proj"`` the projections are Triton kernels too (`proj_kernels.py`),
each folding in its neighbours: the residual add + RMSNorm (for a few rows) and RoPE + the cache
write into q/k/v, the add + RMSNorm and SiLU-and-mul into gate/up, and o/down's split-K partial
sums are reduced where they are consumed -- 7 kernels per layer, or 5 up to NORM_PROLOGUE_ROWS (q/k/v, attention,
o, gate/up, down; default 0). Opt-in: at parity with the cuBLAS step (benchmarks/RESULTS.md, decode and
prefill kernel choices).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, List, Optional, Tuple

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from .model import DecoderModel


@dataclass
class LayerViews:
    qkv_weight: torch.Tensor                 # [(nh + 2 nkv) * D, H]: q, k, v projections stacked
    qkv_bias: Optional[torch.Tensor]
    gate_up_weight: Optional[torch.Tensor]   # [2I, H] (None: an MoE layer)
    gate_up_bias: Optional[torch.Tensor]


def adjacent_view(model: "DecoderModel", names: List[str]) -> Optional[torch.Tensor]:
    """The parameters ``names`` (same dtype and trailing shape, in this order) as one tensor
    stacked on dim 0 -- a view of the flat buffer when they lie back to back in it, else None."""
    layout = model._layout
    if any(n not in layout for n in names):
        return None
    off0, dtype, shape0 = layout[names[0]]
    end, rows = off0, 0
    for n in names:
        off, dt, shape = layout[n]
        if off != end or dt != dtype or shape[1:] != shape0[1:]:
            return None
        end = off + math.prod(shape) * dt.itemsize
        rows += shape[0]
    return model._flat[off0:end].view(dtype).view((rows,) + tuple(shape0[1:]))


def layer_views(model: "DecoderModel") -> Optional[List[LayerViews]]:
    """Per layer fused projection views, or None when any layer's weights are not adjacent."""
    s = model.spec
    out = []
    for i in range(s.num_layers):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        qkv = adjacent_view(model, [a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"])
        qkv_b = adjacent_view(model, [a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"]) if s.qkv_bias else None
        if qkv is None or (s.qkv_bias and qkv_b is None):
            return None
        gu = gu_b = None
        if i not in s.moe_layers:
            gu = adjacent_view(model, [m + "gate_proj.weight", m + "up_proj.weight"])
            gu_b = adjacent_view(model, [m + "gate_proj.bias", m + "up_proj.bias"]) if s.mlp_bias else None
            if gu is None or (s.mlp_bias and gu_b is None):
                return None
        out.append(LayerViews(qkv, qkv_b, gu, gu_b))
    return out


class _Pending:
    """A branch output not yet added to the residual stream: a dense tensor ``y``, or (Triton
    projections) fp32 partial sums over K ranges plus the bias, summed where they are consumed."""

    def __init__(self, y: Optional[torch.Tensor] = None, parts: Optional[torch.Tensor] = None,
                 bias: Optional[torch.Tensor] = None):
        self.y, self.parts, self.bias = y, parts, bias

    def normed(self, proj, x: torch.Tensor, w: torch.Tensor, eps: float):
        """Triton projections: RMSNorm(x + branch) * w as a `proj_kernels.NormedInput`."""
        return proj.NormedInput(x, self.parts if self.parts is not None else self.y, self.bias, w, eps)

    def norm(self, kernels, proj, x: torch.Tensor, w: torch.Tensor, eps: float):
        """(RMSNorm(x + branch) * w in memory, the residual after the add): cuBLAS projections (``proj``
        None) add ``y`` into ``x`` in place, Triton ones write the sum out of place."""
        if proj is None:
            return kernels.add_rms_norm(x, self.y, w, eps), x
        inp = self.normed(proj, x, w, eps)
        return proj.add_norm(inp), inp.x_out


def _row_parallel(model: "DecoderModel", proj, x: torch.Tensor, w: torch.Tensor,
                  bias: Optional[torch.Tensor]) -> _Pending:
    """o_proj / down_proj of ``x``: cuBLAS (``proj`` None), else Triton partial sums that the next
    norm reduces -- unless TP must all-reduce them first."""
    if proj is None:
        return _Pending(model._row_parallel_out(F.linear(x, w), bias))
    parts = proj.linear_parts(x, w)
    if model.tp_size > 1:
        return _Pending(model._row_parallel_out(proj.parts_sum(parts, x.dtype), bias))
    return _Pending(parts=parts, bias=bias)


def graph_key_length(key_len: int, max_len: int) -> int:
    """The key length a fused decode step is captured for (`kernels.attention_len_class`)."""
    from . import kernels   # triton: imported only where the fused step runs
    return kernels.attention_len_class(key_len, max_len)


def run_layers(model: "DecoderModel", views: List[LayerViews], x: torch.Tensor, attention: Callable,
               proj=None) -> Tuple[torch.Tensor, _Pending]:
    """Every layer over the residual stream ``x`` ``[N, H]`` (one row per token): ``attention(i,
    views[i], x, y)`` -> (attention output ``[N, heads * D]``, the residual) makes the input norm of
    the branch output ``y`` still to add, q/k/v, RoPE, the cache write and attention -- what differs
    between a decode step and a prefill; o_proj and the MLP block (add + RMSNorm, gate/up as one
    GEMM, SiLU-and-mul, down_proj; an MoE layer's torch MLP) are the same for both. Returns (the
    residual, the last branch output, not yet added)."""
    from . import kernels   # triton: imported only where the fused kernels run
    P, eps = model.params, model.spec.rms_norm_eps
    y = _Pending()                                              # the branch output still to add
    for i, v in enumerate(views):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        w_post = P[f"model.layers.{i}.post_attention_layernorm.weight"]
        o, x = attention(i, v, x, y)
        y = _row_parallel(model, proj, o, P[a + "o_proj.weight"], P.get(a + "o_proj.bias"))
        if v.gate_up_weight is None:   # MoE layer: the torch path (routing needs the host)
            h, x = y.norm(kernels, proj, x, w_post, eps)
            y = _Pending(model._mlp(i, h[:, None])[:, 0])
            continue
        if proj is not None:
            inp = y.normed(proj, x, w_post, eps)
            act = proj.gate_up_silu(proj.projection_input(inp), v.gate_up_weight, v.gate_up_bias)
            x = inp.x_out
        else:
            h, x = y.norm(kernels, proj, x, w_post, eps)
            act = kernels.silu_mul(F.linear(h, v.gate_up_weight, v.gate_up_bias))
        y = _row_parallel(model, proj, act, P[m + "down_proj.weight"], P.get(m + "down_proj.bias"))
    return x, y


def qk_norm_weights(model: "DecoderModel", i: int) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor], float]:
    """Layer ``i``'s (q_norm, k_norm, eps): qwen3's per-head norms, None for the other families."""
    a, P = f"model.layers.{i}.self_attn.", model.params
    return P.get(a + "q_norm.weight"), P.get(a + "k_norm.weight"), model.spec.rms_norm_eps


def decode_body(model: "DecoderModel", views: List[LayerViews], ids: torch.Tensor, pos: torch.Tensor,
                B: int, Lk: int, route_ctx=None, projections: bool = False) -> Optional[torch.Tensor]:
    """Decode rows ``[0, B)`` (token ``ids[b]`` at ``pos[b]``) attending over at most ``Lk`` keys;
    logits ``[B, V]`` in the model's dtype (None on TP ranks > 0). No host sync: graph-capturable.
    ``projections``: the q/k/v, o, gate/up and down projections run as Triton kernels with the
    residual add + RMSNorm (up to NORM_PROLOGUE_ROWS rows), RoPE + the cache write, SiLU, and the
    partial-sum reduction folded in (`proj_kernels.py`)."""
    from . import kernels   # triton: imported only where the fused step runs
    proj = None
    if projections:
        from . import proj_kernels as proj
    P = model.params
    nh, nkv, eps = model.nh, model.nkv, model.spec.rms_norm_eps
    scale = 1.0 / math.sqrt(model.spec.head_dim)
    splits = kernels.attention_splits(Lk)

    def attention(i: int, v: LayerViews, x: torch.Tensor, y: _Pending):
        w_in = P[f"model.layers.{i}.input_layernorm.weight"]
        qk_norm = qk_norm_weights(model, i)
        rope = (pos, model.rope_cos, model.rope_sin, model.k_cache[i], model.v_cache[i], nh, nkv) + qk_norm
        in_attention = None   # RoPE + the cache write done by the attention kernel
        if proj is not None:
            inp = y.normed(proj, x, w_in, eps)
            q = proj.qkv_rope(proj.projection_input(inp), v.qkv_weight, v.qkv_bias, *rope)
            x = inp.x_out
        else:
            h, x = y.norm(kernels, proj, x, w_in, eps)
            q = F.linear(h, v.qkv_weight, v.qkv_bias)
            if kernels.ROPE_IN_ATTENTION:
                in_attention = (nh, model.rope_cos, model.rope_sin) + qk_norm
            else:
                q = kernels.rope_and_store(q, *rope)
        return kernels.decode_attention(q, model.k_cache[i], model.v_cache[i], pos, Lk, scale, splits, in_attention), x

    x = F.embedding(ids, P["model.embed_tokens.weight"])       # [B, H]: the residual stream
    model._route_ctx = route_ctx
    try:
        x, y = run_layers(model, views, x, attention, proj)
    finally:
        model._route_ctx = None
    if model.tp_rank != 0:
        return None
    h, _ = y.norm(kernels, proj, x, P["model.norm.weight"], eps)
    # in the model's dtype: the sampler upcasts as it reads (no [B, V] fp32 copy in the step)
    return model._logits(h, upcast=False)
