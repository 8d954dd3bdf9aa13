"""Qwen2.5-VL vision tower on megatron-core tensor-parallel linears, plus the M-RoPE index.

The math follows transformers' ``Qwen2_5_VisionTransformerPretrainedModel`` (read, not copied):
patches -> Conv3d patch embedding -> tokens reordered into attention windows -> ``depth`` blocks
(RMSNorm, attention with a 2-D rotary embedding, RMSNorm, SwiGLU MLP) where the blocks at
``fullatt_block_indexes`` attend over a whole image and the others within a window -> RMSNorm +
2x2 patch merger MLP -> tokens back in the original order.

Tensor parallelism: ``qkv`` / MLP ``linear_fc1`` / merger ``linear_fc1`` are
:class:`ColumnParallelLinear` (each rank holds whole heads: ``qkv`` is stored per head as
``[heads, (q|k|v), head_dim]``, see ``naming.py`` transform ``vqkv``), ``proj`` / ``linear_fc2``
are :class:`RowParallelLinear` (all-reduced), so the tower output is replicated over TP like the
decoder's embeddings. Norms and the patch embedding are replicated.

The tower's modules are ``MegatronModule`` s, so ``sharded_state_dict`` (megatron's distributed
checkpoint) saves the parallel linears as TP shards and the norms / patch embedding as replicated.

Megatron's column/row linears take ``[s, b, h]``; the tower's token axis is passed as ``s`` with
``b = 1`` so their backward (which flattens the first two dims) works when the tower is trained.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from megatron.core.transformer.module import MegatronModule


class VisionRMSNorm(nn.Module):
    """RMSNorm computed in fp32 and cast back before the weight, as HF's ``Qwen2_5_VLRMSNorm``
    (megatron's norm multiplies in fp32 first, which differs in bf16)."""

    def __init__(self, dim: int, eps: float = 1e-6, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def _rotate_half(x: Tensor) -> Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def _init(std: float):
    def init(w: Tensor) -> Tensor:
        return nn.init.normal_(w, mean=0.0, std=std)
    return init


def _column(cfg, n_in: int, n_out: int, std: float):
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear
    return ColumnParallelLinear(n_in, n_out, config=cfg, init_method=_init(std), bias=True,
                                gather_output=False)


def _row(cfg, n_in: int, n_out: int, std: float):
    from megatron.core.tensor_parallel.layers import RowParallelLinear
    return RowParallelLinear(n_in, n_out, config=cfg, init_method=_init(std), bias=True,
                             input_is_parallel=True, skip_bias_add=False)


class VisionAttention(MegatronModule):
    """Bidirectional attention within segments (``cu_seqlens``: windows or whole images)."""

    def __init__(self, tconf, dim: int, heads: int, std: float):
        super().__init__(config=tconf)
        from megatron.core import parallel_state as mpu

        tp = mpu.get_tensor_model_parallel_world_size()
        if heads % tp:
            raise ValueError(f"vision num_heads={heads} is not divisible by tensor parallel size {tp}")
        self.local_heads = heads // tp
        self.head_dim = dim // heads
        self.qkv = _column(tconf, dim, 3 * dim, std)
        self.proj = _row(tconf, dim, dim, std)

    def forward(self, x: Tensor, cu_seqlens: List[int], cos: Tensor, sin: Tensor) -> Tensor:
        n = x.shape[0]
        qkv, _ = self.qkv(x)                                        # [n, 1, local_heads*3*hd]
        q, k, v = qkv.view(n, self.local_heads, 3, self.head_dim).unbind(2)   # each [n, h, hd]
        # 2-D rotary embedding in fp32 (cos/sin [n, hd])
        c, s = cos[:, None, :], sin[:, None, :]
        q = (q.float() * c + _rotate_half(q.float()) * s).to(v.dtype)
        k = (k.float() * c + _rotate_half(k.float()) * s).to(v.dtype)
        rows, valid = segment_batch(cu_seqlens, x.device)                     # [S, L]
        # all segments in one call: [S, h, L, hd], padded keys masked out
        qb, kb, vb = (t[rows].transpose(1, 2) for t in (q, k, v))
        # equal segments (no padding) take no mask, so the fused (flash) kernels stay eligible
        mask = None if valid.numel() == n else valid[:, None, None, :]
        o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=self.head_dim ** -0.5)
        out = o.transpose(1, 2)[valid]                                          # [n, h, hd], token order
        return self.proj(out.reshape(n, 1, -1))[0]


class VisionMLP(MegatronModule):
    """SwiGLU with biases; ``linear_fc1`` holds ``[gate_shard; up_shard]`` per TP rank."""

    def __init__(self, tconf, dim: int, ffn: int, act: str, std: float):
        super().__init__(config=tconf)
        if act not in ("silu", "swish"):
            raise ValueError(f"vision hidden_act {act!r} is not supported (Qwen2.5-VL uses silu)")
        self.linear_fc1 = _column(tconf, dim, 2 * ffn, std)
        self.linear_fc2 = _row(tconf, ffn, dim, std)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        """As megatron's gated ``MLP``: ``linear_fc1`` is saved as separate gate and up tensors, so a
        checkpoint saved at one TP size loads at another (each rank holds ``[gate_i; up_i]``)."""
        from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

        singleton = (metadata or {}).get("singleton_local_shards", False)
        out = {}
        for name, module in self._modules.items():
            sub = module.sharded_state_dict(f"{prefix}{name}.", sharded_offsets, metadata)
            if name == "linear_fc1":
                sub = {k: apply_swiglu_sharded_factory(v, sharded_offsets, singleton)
                       if k in (f"{prefix}{name}.weight", f"{prefix}{name}.bias") else v for k, v in sub.items()}
            out.update(sub)
        return out

    def forward(self, x: Tensor) -> Tensor:
        h, _ = self.linear_fc1(x)
        gate, up = h.chunk(2, dim=-1)
        return self.linear_fc2(F.silu(gate) * up)[0]


class VisionBlock(MegatronModule):
    def __init__(self, tconf, vcfg, std: float):
        super().__init__(config=tconf)
        dt = tconf.params_dtype
        self.norm1 = VisionRMSNorm(vcfg.hidden_size, dtype=dt)
        self.norm2 = VisionRMSNorm(vcfg.hidden_size, dtype=dt)
        self.attn = VisionAttention(tconf, vcfg.hidden_size, vcfg.num_heads, std)
        self.mlp = VisionMLP(tconf, vcfg.hidden_size, vcfg.intermediate_size, vcfg.hidden_act, std)

    def forward(self, x: Tensor, cu_seqlens: List[int], cos: Tensor, sin: Tensor) -> Tensor:
        x = x + self.attn(self.norm1(x), cu_seqlens, cos, sin)
        return x + self.mlp(self.norm2(x))


class _BlockList(nn.ModuleList):
    """The blocks; for megatron's distributed checkpoint each block gives its own (TP-sharded) state
    (a plain ``ModuleList`` would be saved as one TP-replicated state dict)."""

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        out = {}
        for i, blk in enumerate(self):
            out.update(blk.sharded_state_dict(f"{prefix}{i}.", sharded_offsets, metadata))
        return out


class PatchMerger(MegatronModule):
    """RMSNorm, then each 2x2 group of neighbouring patches (consecutive tokens) -> one LM token."""

    def __init__(self, tconf, vcfg, std: float):
        super().__init__(config=tconf)
        self.group = vcfg.hidden_size * vcfg.spatial_merge_size ** 2
        self.ln_q = VisionRMSNorm(vcfg.hidden_size, dtype=tconf.params_dtype)
        self.linear_fc1 = _column(tconf, self.group, self.group, std)
        self.linear_fc2 = _row(tconf, self.group, vcfg.out_hidden_size, std)

    def forward(self, x: Tensor) -> Tensor:
        h = self.ln_q(x).reshape(-1, 1, self.group)
        h, _ = self.linear_fc1(h)
        return self.linear_fc2(F.gelu(h))[0][:, 0]


# ---------------------------------------------------------------------------------------------
# token layout: positions, windows, segments (host-side integer bookkeeping per image)
# ---------------------------------------------------------------------------------------------

def segment_batch(cu_seqlens: List[int], device) -> Tuple[Tensor, Tensor]:
    """Segments (windows or frames) as a padded batch: ``rows [S, L]`` token indices (padding
    points at token 0) and ``valid [S, L]``; ``t[rows][valid]`` is ``t`` in its original order."""
    lens = torch.tensor([b - a for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:])], device=device)
    lens = lens[lens > 0]
    starts = torch.cumsum(lens, 0) - lens
    offs = torch.arange(int(lens.max()), device=device)
    valid = offs[None, :] < lens[:, None]
    rows = torch.where(valid, starts[:, None] + offs[None, :], torch.zeros_like(valid, dtype=torch.long))
    return rows, valid


def _grids(grid_thw: Tensor) -> List[Tuple[int, int, int]]:
    return [tuple(int(v) for v in g) for g in grid_thw.tolist()]


def patch_positions(grid_thw: Tensor, merge: int) -> Tensor:
    """``[n_patches, 2]`` (row, col) of every patch, in the processor's order: per frame, merge
    blocks row-major, and the ``merge x merge`` patches of a block row-major inside it."""
    out = []
    for t, h, w in _grids(grid_thw):
        rows = torch.arange(h).view(h // merge, merge, 1, 1).expand(-1, -1, w // merge, merge)
        cols = torch.arange(w).view(1, 1, w // merge, merge).expand(h // merge, merge, -1, -1)
        # [bh, i, bw, j] -> [bh, bw, i, j]: block-major
        rc = torch.stack([rows.permute(0, 2, 1, 3).reshape(-1), cols.permute(0, 2, 1, 3).reshape(-1)], -1)
        out.append(rc.repeat(t, 1))
    return torch.cat(out, 0)


def window_layout(grid_thw: Tensor, merge: int, window_size: int, patch_size: int
                  ) -> Tuple[Tensor, List[int]]:
    """Order of merged tokens (2x2 groups) grouped by attention window, and the cumulative patch
    counts of the windows. A window is ``window_size // merge // patch_size`` merged tokens on a
    side, tiling each frame from the top-left; edge windows are smaller."""
    ws = window_size // merge // patch_size
    unit = merge * merge
    order: List[Tensor] = []
    cu = [0]
    base = 0
    for t, h, w in _grids(grid_thw):
        lh, lw = h // merge, w // merge
        idx = torch.arange(t * lh * lw).view(t, lh, lw) + base
        for f in range(t):
            for r0 in range(0, lh, ws):
                for c0 in range(0, lw, ws):
                    win = idx[f, r0:r0 + ws, c0:c0 + ws].reshape(-1)
                    order.append(win)
                    cu.append(cu[-1] + win.numel() * unit)
        base += t * lh * lw
    return torch.cat(order), cu


def frame_segments(grid_thw: Tensor) -> List[int]:
    """Cumulative patch counts of the full-attention segments: one per frame of each image."""
    cu = [0]
    for t, h, w in _grids(grid_thw):
        for _ in range(t):
            cu.append(cu[-1] + h * w)
    return cu


class VisionTower(MegatronModule):
    """Pixels (``[n_patches, C * T * P * P]``, as the HF processor emits) + ``grid_thw`` ->
    ``[n_patches / merge^2, out_hidden_size]`` LM-space features, images concatenated in order."""

    def __init__(self, tconf, vcfg):
        super().__init__(config=tconf)
        std = float(getattr(vcfg, "initializer_range", 0.02))
        self.vcfg = vcfg
        self.merge = int(vcfg.spatial_merge_size)
        self.kernel = (int(vcfg.temporal_patch_size), int(vcfg.patch_size), int(vcfg.patch_size))
        d = vcfg.hidden_size
        # Conv3d weight in HF's shape [D, C, T, P, P]; stride == kernel, so one linear per patch
        self.patch_embed = nn.Parameter(torch.empty(d, vcfg.in_channels, *self.kernel, dtype=tconf.params_dtype))
        if tconf.perform_initialization:
            nn.init.normal_(self.patch_embed, std=std)
        self.blocks = _BlockList([VisionBlock(tconf, vcfg, std) for _ in range(vcfg.depth)])
        self.merger = PatchMerger(tconf, vcfg, std)
        self.full_attention = set(int(i) for i in vcfg.fullatt_block_indexes)
        rp = dict(getattr(vcfg, "rope_parameters", None) or {})
        theta = float(rp.get("rope_theta", 10000.0))
        quarter = (d // vcfg.num_heads) // 2      # each of (row, col) rotates half the head dim
        self.register_buffer("inv_freq", 1.0 / (theta ** (torch.arange(0, quarter, 2, dtype=torch.float) / quarter)),
                             persistent=False)

    def rotary(self, pos: Tensor) -> Tuple[Tensor, Tensor]:
        """cos/sin ``[n, head_dim]``: angles (row freqs | col freqs), repeated for the two halves."""
        ang = pos[..., None].float() * self.inv_freq.float()      # [n, 2, hd/4]
        ang = torch.cat([ang[:, 0], ang[:, 1]], -1)
        ang = torch.cat([ang, ang], -1)
        return ang.cos(), ang.sin()

    def forward(self, pixel_values: Tensor, grid_thw: Tensor) -> Tensor:
        c = self.vcfg.in_channels
        x = pixel_values.reshape(-1, c, *self.kernel).to(self.patch_embed.dtype)
        x = F.conv3d(x, self.patch_embed, stride=self.kernel).reshape(x.shape[0], -1)
        n, unit = x.shape[0], self.merge ** 2
        order, cu_window = window_layout(grid_thw, self.merge, int(self.vcfg.window_size), int(self.vcfg.patch_size))
        order = order.to(x.device)
        cu_full = frame_segments(grid_thw)

        def by_window(t: Tensor) -> Tensor:
            return t.reshape(n // unit, unit, -1)[order].reshape(n, -1)

        x = by_window(x)
        cos, sin = self.rotary(patch_positions(grid_thw, self.merge).to(x.device))
        cos, sin = by_window(cos), by_window(sin)
        x = x[:, None]                                           # [n, 1, D]: megatron's [s, b, h]
        for i, blk in enumerate(self.blocks):
            x = blk(x, cu_full if i in self.full_attention else cu_window, cos, sin)
        merged = self.merger(x[:, 0])
        return merged[torch.argsort(order)]


# ---------------------------------------------------------------------------------------------
# 3-D M-RoPE position ids (text: t = h = w; image tokens: (t, row, col) offset by the text before)
# ---------------------------------------------------------------------------------------------

def mrope_position_ids(input_ids: Tensor, image_grid_thw: Optional[Tensor], image_token_id: int,
                       merge: int, attention_mask: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """``(position_ids [3, b, s], deltas [b, 1])`` as ``Qwen2_5_VLModel.get_rope_index`` for
    text + images: a text run continues 1-D from the running position; an image of LM grid
    ``(t, h, w)`` (after merging) gets ``start + (frame, row, col)`` and advances the running
    position by ``max(h, w)``. Padding (``attention_mask == 0``) keeps position 0; ``deltas`` =
    ``max position + 1 - length`` (for continuing generation). Adjacent images with no token in
    between are taken one after the other (HF would group them as one)."""
    b, s = input_ids.shape
    grids = iter(_grids(image_grid_thw)) if image_grid_thw is not None else iter(())
    pos = torch.zeros(3, b, s, dtype=input_ids.dtype, device=input_ids.device)
    deltas = []
    for i in range(b):
        keep = attention_mask[i].bool() if attention_mask is not None else torch.ones(s, dtype=torch.bool,
                                                                                      device=input_ids.device)
        ids = input_ids[i][keep].tolist()
        parts: List[Tensor] = []
        cur, j = 0, 0
        while j < len(ids):
            if ids[j] != image_token_id:
                k = j
                while k < len(ids) and ids[k] != image_token_id:
                    k += 1
                parts.append(torch.arange(cur, cur + k - j).expand(3, -1))
                cur += k - j
                j = k
                continue
            t, h, w = next(grids)
            lh, lw = h // merge, w // merge
            grid = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(lh), torch.arange(lw),
                                              indexing="ij")).reshape(3, -1)
            parts.append(grid + cur)
            cur += max(lh, lw)
            j += t * lh * lw
        full = torch.cat(parts, 1) if parts else torch.zeros(3, 0, dtype=torch.long)
        pos[:, i, keep] = full.to(pos)
        deltas.append(int(full.max()) + 1 - len(ids) if full.numel() else 0)
    return pos, torch.tensor(deltas, device=input_ids.device).unsqueeze(1)
