"""Core attention backed by ``torch.nn.functional.scaled_dot_product_attention``.

Drop-in replacement for megatron's local ``DotProductAttention`` (which materialises the full
[b, np, s, s] score matrix and ran out of memory on the H200 at batch 4 x 4096). Same constructor and forward
signature; works for GQA (``enable_gqa``) and MLA (different q/k and v head sizes via
``k_channels`` / ``v_channels``). Layouts follow megatron: inputs ``[s, b, heads, dim]``, output
``[s, b, heads * v_dim]``.

``attention_mask`` follows megatron's convention: a bool tensor broadcastable to [b, 1, sq, sk]
where ``True`` means *masked out*. With a causal ``attn_mask_type`` the causal mask is combined
with it. Rows that would be fully masked (e.g. left-padding) attend to themselves so no NaNs
appear (those positions are padding and must be ignored by the caller).

Packed sequences (``packed_seq_params.qkv_format == "thd"``): q/k/v arrive as ``[T, heads, dim]``
and each token attends causally within its own sequence only
(:func:`megarl.models.packed_attention.packed_causal_attention`); output ``[T, 1, heads * v_dim]``.
With context parallelism the packed parameters carry the rank's zig-zag split and the queries
attend to keys/values gathered over the CP group
(:func:`megarl.models.context_parallel.cp_packed_attention`).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule


class SDPAttention(MegatronModule):
    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str = "self", attention_dropout: Optional[float] = None,
                 softmax_scale: Optional[float] = None, k_channels: Optional[int] = None,
                 v_channels: Optional[int] = None, cp_comm_type: Optional[str] = None,
                 pg_collection=None, **kwargs):
        super().__init__(config=config)
        self.cp = config.context_parallel_size   # > 1: packed (THD) micro-batches only (see _packed)
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        k_channels = k_channels or config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else (
            config.softmax_scale if getattr(config, "softmax_scale", None) else 1.0 / math.sqrt(k_channels))
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Optional[Tensor],
                attn_mask_type: Optional[AttnMaskType] = None, attention_bias: Optional[Tensor] = None,
                packed_seq_params=None, **kwargs) -> Tensor:
        if attention_bias is not None:
            raise NotImplementedError("attention_bias is not supported by SDPAttention")
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        causal = mask_type in (AttnMaskType.causal, AttnMaskType.padding_causal)
        if packed_seq_params is not None:
            return self._packed(query, key, value, attention_mask, causal, packed_seq_params)
        if self.cp > 1:
            raise NotImplementedError("SDPAttention: context parallelism needs packed (THD) micro-batches "
                                      "(packing: true)")
        sq, b, nq, _ = query.shape
        sk, nk = key.shape[0], key.shape[2]
        q = query.permute(1, 2, 0, 3)  # [b, np, sq, hn]
        k = key.permute(1, 2, 0, 3)
        v = value.permute(1, 2, 0, 3)
        gqa = nq != nk
        if gqa and not hasattr(F, "scaled_dot_product_attention"):  # pragma: no cover
            k = k.repeat_interleave(nq // nk, dim=1)
            v = v.repeat_interleave(nq // nk, dim=1)
            gqa = False
        dropout = self.dropout_p if self.training else 0.0
        if attention_mask is None:
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=causal and sq > 1,
                                                 scale=self.softmax_scale, enable_gqa=gqa)
        else:
            allowed = ~attention_mask.to(torch.bool)
            if causal:
                tri = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(sk - sq)
                allowed = allowed & tri
            eye = torch.zeros(sq, sk, dtype=torch.bool, device=q.device)
            idx = torch.arange(sq, device=q.device)
            eye[idx, idx + (sk - sq)] = True
            allowed = allowed | eye
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=dropout,
                                                 scale=self.softmax_scale, enable_gqa=gqa)
        # [b, np, sq, hv] -> [sq, b, np*hv]
        return out.permute(2, 0, 1, 3).reshape(sq, b, -1)

    def _packed(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Optional[Tensor], causal: bool,
                params) -> Tensor:
        from .packed_attention import packed_causal_attention

        if params.qkv_format != "thd":
            raise NotImplementedError(f"SDPAttention: packed qkv_format {params.qkv_format!r} (only 'thd')")
        if attention_mask is not None or not causal:
            raise NotImplementedError("SDPAttention: packed sequences take no attention mask and are causal")
        if self.training and self.dropout_p > 0:
            raise NotImplementedError("SDPAttention: attention dropout with packed sequences")
        if query.dim() == 4:  # [T, 1, h, d] (not squeezed by the caller)
            query, key, value = query.squeeze(1), key.squeeze(1), value.squeeze(1)
        split = getattr(params, "cp", None)
        if self.cp > 1:
            if split is None:
                raise ValueError("SDPAttention: context parallel size > 1 but the packed micro-batch carries "
                                 "no CP split (megarl.workers.batch.packed_inputs with cp)")
            from .context_parallel import cp_packed_attention
            from .packed_attention import packed_attention_backend

            out = cp_packed_attention(query, key, value, split, self.softmax_scale,
                                      packed_attention_backend(query))
            return out.reshape(out.shape[0], 1, -1)
        out = packed_causal_attention(query, key, value, params.cu_seqlens_q, params.cu_seqlens_kv,
                                      params.max_seqlen_q, params.max_seqlen_kv, self.softmax_scale,
                                      getattr(params, "seq_lens", None))
        return out.reshape(out.shape[0], 1, -1)
