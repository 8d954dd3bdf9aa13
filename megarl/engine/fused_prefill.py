"""The embedded engine's prefill in ~11 kernels per layer, with the decode step's Triton kernels.

Why: every admission runs a prefill (a rollout's prompts, each agent turn's context), and the
torch body (`DecoderModel._layer`) launches ~41 kernels per layer for it -- RMSNorm, RoPE and the
cache write as chains of small elementwise ops, q/k/v and gate/up as separate GEMMs. On a GPU a
prefill of a few thousand tokens is then bound by those launches, not by its GEMMs, and the decode
rows wait for it. Here a layer is what the fused decode step runs (`fused_decode.run_layers`):
add + RMSNorm (one kernel), q/k/v as ONE GEMM, RoPE + the cache write of every token (one kernel,
`kernels.rope_and_store` with a cache row per token), causal attention (torch's SDPA, its flash
kernel on a GPU), o_proj, add + RMSNorm, gate/up as ONE GEMM, SiLU-and-mul (one), down_proj.

Same arithmetic as the torch body: the kernels round every product as torch's ops do, so the
logits and the cache agree with it to float noise (tests/test_decode_kernels.py).

Served: a prefill from position 0 (no copied prefix), without LoRA, of a dense model, where the
decode step runs the Triton kernels too (`DecoderModel._fused_prefill_views`). Rows are
right-padded to the longest sequence; the padding's keys and values are written to the cache
as well (past each row's end: decode overwrites a position before any query reads it), so the
attention over the cache rows never reads a value this prefill did not write.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, List, Optional

import torch
import torch.nn.functional as F

from .fused_decode import LayerViews, _Pending, qk_norm_weights, run_layers

if TYPE_CHECKING:
    from .model import DecoderModel


def prefill_body(model: "DecoderModel", views: List[LayerViews], ids: torch.Tensor, lens: torch.Tensor,
                 rows: torch.Tensor, row0: Optional[int] = None) -> Optional[torch.Tensor]:
    """Prefill ``ids`` ``[U, T]`` (right-padded on the device; ``lens`` ``[U]`` the real lengths,
    on the device) into cache rows ``rows`` ``[U]`` (on the device) from position 0. A row of -1 is
    a padding sequence of a captured bucket (`PrefillGraphs`): nothing of it is stored, and its
    logits are to be dropped. ``row0``: the rows are ``row0 ... row0 + U - 1``, so attention reads
    their slice of the cache (no gather; not graph-safe, the slice bakes in row0). fp32 logits
    ``[U, V]`` of each sequence's last token (None on TP ranks > 0). No host sync: capturable."""
    from . import kernels   # triton: imported only where the fused kernels run
    P = model.params
    U, T = ids.shape
    nh, nkv, D, eps = model.nh, model.nkv, model.spec.head_dim, model.spec.rms_norm_eps
    scale = 1.0 / math.sqrt(D)
    dev = ids.device
    pos = torch.arange(T, device=dev).repeat(U)         # token u*T + t sits at t
    # ... of cache row rows[u]; materialized: at U = 1 a reshape of the expanded rows is a stride-0
    # view of ONE element, and the kernel reads U * T of them (it faulted on the GPU)
    token_rows = rows[:, None].expand(U, T).contiguous().view(-1)
    read_rows = None if row0 is not None else rows.clamp(min=0)   # (padding: any row, outputs dropped)

    def attention(i: int, v: LayerViews, x: torch.Tensor, y: _Pending):
        h, x = y.norm(kernels, None, x, P[f"model.layers.{i}.input_layernorm.weight"], eps)
        kc, vc = model.k_cache[i], model.v_cache[i]
        q = kernels.rope_and_store(F.linear(h, v.qkv_weight, v.qkv_bias), pos, model.rope_cos, model.rope_sin,
                                   kc, vc, nh, nkv, *qk_norm_weights(model, i), rows=token_rows)
        if row0 is not None:
            keys, values = kc[row0:row0 + U, :, :T], vc[row0:row0 + U, :, :T]
        else:
            keys, values = kc[:, :, :T].index_select(0, read_rows), vc[:, :, :T].index_select(0, read_rows)
        # causal over the rows' own keys: right-padded, so a real token's earlier positions are its own
        out = F.scaled_dot_product_attention(q.view(U, T, nh, D).transpose(1, 2), keys, values, is_causal=True,
                                             scale=scale, enable_gqa=nkv != nh)
        return out.transpose(1, 2).reshape(U * T, nh * D), x

    x = F.embedding(ids.reshape(-1), P["model.embed_tokens.weight"])    # [U*T, H]: the residual stream
    x, y = run_layers(model, views, x, attention)
    if model.tp_rank != 0:
        return None
    last = torch.arange(U, device=dev) * T + lens - 1
    h, _ = _Pending(y.y[last]).norm(kernels, None, x[last], P["model.norm.weight"], eps)
    return model._logits(h)
