"""A compact torch implementation of the HF decoder families the embedded server serves.

Families: llama (SmolLM2, Llama-2/3, Mistral-like), qwen2 (qkv bias), qwen3 (qk-norm),
qwen3_moe (qk-norm + top-k routed experts).  Parameters are held under their HF checkpoint
names (experts stacked per layer, addressable as `...mlp.experts.{e}.{gate,up,down}_proj.weight`),
so weight updates load by HF name.

KV cache: row-based and preallocated: `k_cache`, `v_cache` of shape
[layers, rows, kv_heads, max_len, head_dim], one tensor each, so one op moves or copies rows in
every layer. The engine keeps its running requests in rows [0, B): decode attends over a view of
the cache (no gather of the running rows), rows are copied to share a prompt's prefill between the
samples of a group (`copy_rows`), and moved to close the gaps finished requests leave. Prefill can
start at an offset: a row whose first positions were copied from another row computes only the
rest. Attention runs through `scaled_dot_product_attention` with an explicit mask, in the model
dtype (fp32 on CPU by default); logits are returned in fp32.

Parameters live in one flat buffer (views per HF name), so a release/resume of the weights brings
them back as one allocation -- at the same address, typically, which keeps the decode CUDA graphs
(`graphs.py`) valid across the colocated trainer's every-step release.

Tensor parallel (`tp_size` > 1, see `shard.py`): this object is ONE rank's part of the model --
its heads, its slice of the MLP / experts, its kv heads in the cache; `all_reduce` sums the
row-parallel partial outputs over the ranks. Every rank runs the same calls in the same order
(`tp.py`); only rank 0 computes logits (the head is replicated, so the others skip it).
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple

import numpy as np
import torch
import torch.nn.functional as F

from megarl.wire.numerics import fp32_logits

from megarl.quant.fp8_block import quantize_block_fp8
from megarl.quant.served import block_fp8_settings, scale_name, split_scale_name

from .fp8 import FP8_KEY, SCALE_KEY, Fp8Store
from . import fused_decode, fused_prefill
from .graphs import DecodeGraphs, PrefillGraphs
from .lora import Adapter, lora_delta
from .shard import local_part, local_shape
from .stable_memory import StableRegion, stable_memory_available

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe")


@dataclass
class Spec:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    max_position_embeddings: int
    # MoE (qwen3_moe)
    num_experts: int = 0
    top_k: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    moe_layers: Tuple[int, ...] = ()
    eos_token_ids: Tuple[int, ...] = ()

    @classmethod
    def from_hf_config(cls, cfg) -> "Spec":
        mt = cfg.model_type
        if mt not in SUPPORTED:
            raise ValueError(f"embedded server: unsupported model_type {mt!r} (supported: {SUPPORTED})")
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        moe_layers: Tuple[int, ...] = ()
        ne = 0
        if mt == "qwen3_moe":
            ne = cfg.num_experts
            step = getattr(cfg, "decoder_sparse_step", 1) or 1
            only = set(getattr(cfg, "mlp_only_layers", []) or [])
            moe_layers = tuple(i for i in range(cfg.num_hidden_layers)
                               if i not in only and ne > 0 and (i + 1) % step == 0)
        eos = getattr(cfg, "eos_token_id", None)
        eos = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        return cls(
            model_type=mt,
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_layers=cfg.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.rms_norm_eps,
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            qkv_bias=(mt == "qwen2") or bool(getattr(cfg, "attention_bias", False)),
            o_bias=(mt in ("llama", "mistral", "qwen3", "qwen3_moe")) and bool(getattr(cfg, "attention_bias", False)),
            mlp_bias=bool(getattr(cfg, "mlp_bias", False)),
            qk_norm=mt in ("qwen3", "qwen3_moe"),
            max_position_embeddings=getattr(cfg, "max_position_embeddings", 4096),
            num_experts=ne,
            top_k=getattr(cfg, "num_experts_per_tok", 0) if ne else 0,
            moe_intermediate_size=getattr(cfg, "moe_intermediate_size", 0) if ne else 0,
            norm_topk_prob=bool(getattr(cfg, "norm_topk_prob", False)),
            moe_layers=moe_layers,
            eos_token_ids=eos,
        )


def rope_inv_freq(cfg, head_dim: int) -> Tuple[torch.Tensor, float]:
    """inv_freq and attention scaling exactly as transformers computes them."""
    params = getattr(cfg, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type == "default":
        theta = params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
        dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
        inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim))
        return inv, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    inv, scale = ROPE_INIT_FUNCTIONS[rope_type](cfg, torch.device("cpu"))
    return inv.float(), float(scale)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    dt = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return w * x.to(dt)


def _rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def _triton_ok(head_dim: int, dtype: torch.dtype, projections: bool = False) -> Tuple[bool, str]:
    """Can the Triton decode step run here (Triton importable, a shape its kernels serve; with
    ``projections``, its projection kernels too)?"""
    try:
        from . import kernels, proj_kernels
    except ImportError as e:   # triton is not installed (CPU-only torch builds)
        return False, f"triton is not importable: {e}"
    if projections and not proj_kernels.supported(head_dim):
        return False, f"head_dim {head_dim} < 32: half a head is less than one 16-column dot block"
    return kernels.supported(head_dim, dtype)


_FUSED_RE = re.compile(r"^(.*\.)(?:(q|k|v)_proj|(gate|up)_proj)\.(weight|bias)$")


def _fused_group(name: str) -> Optional[str]:
    """The fused projection a parameter belongs to (``...qkv.weight``, ``...gate_up.bias``), or None."""
    m = _FUSED_RE.match(name)
    if m is None:
        return None
    return m.group(1) + ("qkv." if m.group(2) else "gate_up.") + m.group(4)


_EXPERT_RE = re.compile(r"^(model\.layers\.(\d+)\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


# memory a captured prefill's activations may hold (`DecoderModel._prefill_graph_limits`)
PREFILL_GRAPH_MIB = 128


def _env_int(name: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r}: expected a number of tokens or 'auto'") from None


def _floor_pow2(n: int) -> int:
    """The largest power of two <= n (0 for n < 1)."""
    return 1 << (int(n).bit_length() - 1) if n >= 1 else 0


class DecoderModel:
    """Weights by HF name + a forward over a slot KV cache (one TP rank's part of them)."""

    def __init__(self, hf_config, device: str = "cpu", dtype: torch.dtype = torch.float32,
                 tp_rank: int = 0, tp_size: int = 1,
                 all_reduce: Optional[Callable[[torch.Tensor], None]] = None,
                 fp32_lm_head: bool = False, record_routes: bool = False):
        self.cfg = hf_config
        self.fp32_lm_head = fp32_lm_head    # SGLang's --enable-fp32-lm-head: logits never rounded to bf16
        self.spec = s = Spec.from_hf_config(hf_config)
        self.device = torch.device(device)
        self.dtype = dtype
        if tp_size > 1 and all_reduce is None:
            raise ValueError("tp_size > 1 needs an all_reduce")
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self._all_reduce = all_reduce
        # this rank's query / kv heads
        self.nh, self.nkv = s.num_heads // tp_size, s.num_kv_heads // tp_size
        inv, self.rope_scale = rope_inv_freq(hf_config, s.head_dim)
        self.inv_freq = inv.to(self.device)
        self.params: Dict[str, torch.Tensor] = {}
        self.full_shapes = self._shapes()   # internal name -> FULL shape (as in the HF checkpoint)
        # a block-FP8 checkpoint (config.json quantization_config): FP8 bytes + scales as served,
        # dequantized into the compute weights once after they change (fp8.py)
        fp8 = block_fp8_settings(hf_config)
        self.fp8: Optional[Fp8Store] = Fp8Store(self.full_shapes, fp8[0], tp_rank, tp_size) if fp8 else None
        self._dequantize_pending = False
        self._flat: Optional[torch.Tensor] = None          # every parameter's bytes (params are views)
        self._host_copy: Optional[torch.Tensor] = None     # pinned bytes of a release that keeps them
        # CUDA VMM (stable_memory.py): weights and cache keep their addresses across a release, so
        # captured decode graphs stay valid; None where unavailable (CPU): plain torch allocations
        self._weights_region: Optional[StableRegion] = None
        self._cache_region: Optional[StableRegion] = None
        self._kept_at_release = False                      # the last release kept a host copy
        self._unwritten: Set[str] = set()   # HF names not rewritten since the weights were dropped
        self._layout: Dict[str, Tuple[int, torch.dtype, Tuple[int, ...]]] = {}
        self._alloc()
        self.k_cache: Optional[torch.Tensor] = None   # [layers, rows, kv_heads, max_len, head_dim]
        self.v_cache: Optional[torch.Tensor] = None
        self.row_ids: Optional[torch.Tensor] = None   # arange(rows) on the device
        # routed experts of every cached position (SGLang's --enable-return-routed-experts): int32
        # [rows, max_len, num_layers, top_k], written by prefill/decode of MoE layers where the
        # keys/values go, moved with them (copy_rows); rows of dense layers stay 0, as in SGLang
        self.record_routes = record_routes and bool(s.moe_layers)
        self.routes: Optional[torch.Tensor] = None
        self._route_ctx: Optional["_Attn"] = None
        self.max_slots = 0
        self.max_len = 0
        # CUDA graphs for decode (CUDA only), captured lazily per (batch, key-length) bucket.
        # (not with TP: the all-reduce would have to be captured in the graph on every rank)
        self.use_cuda_graphs = (self.device.type == "cuda" and tp_size == 1
                                and os.environ.get("MEGARL_CUDA_GRAPHS", "1") != "0")
        self.graphs: Optional[DecodeGraphs] = None
        # small fused prefills as CUDA graphs too (`PrefillGraphs`; MEGARL_PREFILL_GRAPH_TOKENS=0 turns
        # them off, see `_prefill_graph_limits`)
        self.prefill_graphs: Optional[PrefillGraphs] = None
        # Triton decode step (fused_decode.py): "auto" = on CUDA when Triton can serve the shape;
        # "triton" forces it (on CPU under TRITON_INTERPRET=1: the tests); "triton-proj" = the same
        # with the projections in Triton too (proj_kernels.py); "torch" = the reference
        self.decode_kernels = os.environ.get("MEGARL_DECODE_KERNELS", "auto")
        # queue decode step t+1 before step t's tokens reach the host (engine.py; graphs only)
        self.decode_overlap = os.environ.get("MEGARL_DECODE_OVERLAP", "1") != "0"
        self._fused_views: Optional[list] = None          # fused projection views (rebuilt on _carve)
        self._tensor_attrs: Optional[List[str]] = None    # attributes holding tensors (tensor_addresses)
        self.rope_cos: Optional[torch.Tensor] = None      # [max_len, head_dim / 2] in the model dtype
        self.rope_sin: Optional[torch.Tensor] = None
        # LoRA adapters by served name (`lora.py`), and the ones the current forward applies:
        # (adapter, batch rows it applies to -- None: every row)
        self.adapters: Dict[str, Adapter] = {}
        self._lora: List[Tuple[Adapter, Optional[torch.Tensor]]] = []

    # ---------------------------------------------------------------- parameters
    def _shapes(self) -> Dict[str, Tuple[int, ...]]:
        s = self.spec
        H, D = s.hidden_size, s.head_dim
        out: Dict[str, Tuple[int, ...]] = {"model.embed_tokens.weight": (s.vocab_size, H), "model.norm.weight": (H,)}
        if not s.tie_word_embeddings:
            out["lm_head.weight"] = (s.vocab_size, H)
        for i in range(s.num_layers):
            p = f"model.layers.{i}."
            out[p + "input_layernorm.weight"] = (H,)
            out[p + "post_attention_layernorm.weight"] = (H,)
            out[p + "self_attn.q_proj.weight"] = (s.num_heads * D, H)
            out[p + "self_attn.k_proj.weight"] = (s.num_kv_heads * D, H)
            out[p + "self_attn.v_proj.weight"] = (s.num_kv_heads * D, H)
            out[p + "self_attn.o_proj.weight"] = (H, s.num_heads * D)
            if s.qkv_bias:
                out[p + "self_attn.q_proj.bias"] = (s.num_heads * D,)
                out[p + "self_attn.k_proj.bias"] = (s.num_kv_heads * D,)
                out[p + "self_attn.v_proj.bias"] = (s.num_kv_heads * D,)
            if s.o_bias:
                out[p + "self_attn.o_proj.bias"] = (H,)
            if s.qk_norm:
                out[p + "self_attn.q_norm.weight"] = (D,)
                out[p + "self_attn.k_norm.weight"] = (D,)
            if i in s.moe_layers:
                E, I = s.num_experts, s.moe_intermediate_size
                out[p + "mlp.gate.weight"] = (E, H)
                out[p + "mlp.experts.gate_proj"] = (E, I, H)
                out[p + "mlp.experts.up_proj"] = (E, I, H)
                out[p + "mlp.experts.down_proj"] = (E, H, I)
            else:
                I = s.intermediate_size
                out[p + "mlp.gate_proj.weight"] = (I, H)
                out[p + "mlp.up_proj.weight"] = (I, H)
                out[p + "mlp.down_proj.weight"] = (H, I)
                if s.mlp_bias:
                    out[p + "mlp.gate_proj.bias"] = (I,)
                    out[p + "mlp.up_proj.bias"] = (I,)
                    out[p + "mlp.down_proj.bias"] = (H,)
        return out

    def _alloc(self):
        """Every parameter as a view into one zeroed byte buffer (256-byte aligned slices)."""
        entries = [(n, tuple(local_shape(n, shp, self.tp_rank, self.tp_size)), self.dtype)
                   for n, shp in self.full_shapes.items()]
        entries += self.fp8.entries() if self.fp8 is not None else []
        off = 0
        for j, (n, local, dtype) in enumerate(entries):
            self._layout[n] = (off, dtype, local)
            off += math.prod(local) * dtype.itemsize
            nxt = entries[j + 1][0] if j + 1 < len(entries) else None
            if nxt is None or _fused_group(n) is None or _fused_group(n) != _fused_group(nxt):
                off = -(-off // 256) * 256   # q/k/v and gate/up stay back to back (fused_decode views)
        if stable_memory_available(self.device):
            self._weights_region = StableRegion(off, self.device)
            self._flat = self._weights_region.tensor
            self._flat.zero_()
        else:
            self._flat = torch.zeros(off, dtype=torch.uint8, device=self.device)
        self._carve(self._flat)

    def _carve(self, flat: torch.Tensor) -> None:
        self._fused_views = None
        for n, (off, dtype, shape) in self._layout.items():
            size = math.prod(shape) * dtype.itemsize
            self.params[n] = flat[off:off + size].view(dtype).view(shape)

    def hf_names(self) -> Dict[str, Tuple[int, ...]]:
        """Every HF checkpoint name this model accepts, with its FULL shape (experts expanded)."""
        out = {}
        for n, shp in self.full_shapes.items():
            if n.endswith(("mlp.experts.gate_proj", "mlp.experts.up_proj", "mlp.experts.down_proj")):
                base, proj = n.rsplit(".", 1)
                for e in range(shp[0]):
                    out[f"{base}.{e}.{proj}.weight"] = tuple(shp[1:])
            else:
                out[n] = tuple(shp)
        if self.fp8 is not None:
            out.update({scale_name(name): self.hf_shape(scale_name(name)) for name in list(out)
                        if self._fp8_part(name) is not None})
        return out

    def _internal(self, name: str) -> Optional[str]:
        """The internal parameter an HF weight name belongs to (stacked experts: the stack)."""
        if name in self.full_shapes:
            return name
        m = _EXPERT_RE.match(name)
        return f"{m.group(1)}.{m.group(4)}" if m and f"{m.group(1)}.{m.group(4)}" in self.full_shapes else None

    def _fp8_part(self, name: str) -> Optional[Tuple[str, str]]:
        """(internal name, FP8_KEY or SCALE_KEY) when HF name ``name`` is stored as FP8 bytes or a
        scale grid; None for every other name (and every name of an unquantized model)."""
        if self.fp8 is None:
            return None
        weight = split_scale_name(name)
        internal = self._internal(weight or name)
        if internal is None or not self.fp8.is_quantized(internal):
            return None
        return internal, SCALE_KEY if weight else FP8_KEY

    def hf_shape(self, name: str) -> Optional[Tuple[int, ...]]:
        """Full HF shape of checkpoint name `name`, or None if the model has no such weight."""
        if split_scale_name(name):
            part = self._fp8_part(name)
            return self.fp8.hf_scale_shape(part[0]) if part else None
        shp = self.full_shapes.get(name)
        if shp is not None:
            return tuple(shp)
        m = _EXPERT_RE.match(name)
        if m:
            stacked = self.full_shapes.get(f"{m.group(1)}.{m.group(4)}")
            if stacked is not None and int(m.group(3)) < stacked[0]:
                return tuple(stacked[1:])
        return None

    def target(self, name: str) -> Optional[torch.Tensor]:
        """This rank's tensor (a view for one expert) that HF name `name` loads into, or None if
        unknown. `lm_head.weight` of a tied model is skipped, as sglang does (`is_ignored`).
        A block-FP8 model's quantized weights load into their FP8 bytes and scale grids."""
        part = self._fp8_part(name)
        if part is not None:
            stored = self.params[part[0] + part[1]]
            m = _EXPERT_RE.match(split_scale_name(name) or name)
            return stored[int(m.group(3))] if m else stored
        if split_scale_name(name):
            return None        # a scale of a weight this model does not quantize
        t = self.params.get(name)
        if t is not None:
            return t
        m = _EXPERT_RE.match(name)
        if m:
            stacked = self.params.get(f"{m.group(1)}.{m.group(4)}")
            e = int(m.group(3))
            if stacked is not None and e < stacked.shape[0]:
                return stacked[e]
        return None

    def place(self, name: str, full: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """(destination on this rank, the slice of the full HF tensor `full` that goes there).
        Refused while the weights are released: a write would land in the host copy or, dropped,
        nowhere (SGLang's order is resume, then push)."""
        if self._flat is not None and not self._resident():
            raise RuntimeError("the weights are released (/release_memory_occupation): resume them before updating")
        dst = self.target(name)
        if dst is None:
            raise KeyError(f"unknown weight name {name!r}")
        if split_scale_name(name):
            return dst, full       # every rank holds the whole (small) scale grid
        return dst, local_part(name, full, self.tp_rank, self.tp_size)

    def mark_weights_changed(self) -> None:
        """Weights were written (a push, a load): FP8 weights are dequantized before the next
        forward. A no-op for unquantized models."""
        self._dequantize_pending = self.fp8 is not None

    def note_written(self, names: Iterable[str]) -> None:
        """HF names an applied update (a push, a load) wrote: after a drop the model serves again
        once every one of its weights has been written."""
        if self._unwritten:
            self._unwritten.difference_update(names)

    def _before_forward(self) -> None:
        """Every forward's first step: refuse released weights (with stable regions their views
        point at unmapped pages, and a kernel reading them would lose the CUDA context), then
        dequantize FP8 weights that changed."""
        if self._flat is not None and not self._resident():
            raise RuntimeError("the weights are released (/release_memory_occupation): resume them before generating")
        if self._dequantize_pending:
            self.fp8.dequantize(self.params)
            self._dequantize_pending = False

    def is_ignored(self, name: str) -> bool:
        return self.spec.tie_word_embeddings and name == "lm_head.weight"

    def load_state(self, named: Iterable[Tuple[str, torch.Tensor]], strict: bool = True) -> List[str]:
        """Copy full HF-named tensors in, keeping this rank's slice (no verification beyond name
        and shape); returns the names seen."""
        seen = []
        for name, t in named:
            if self.is_ignored(name):
                continue
            shp = self.hf_shape(name)
            if shp is None:
                if strict:
                    raise KeyError(f"unknown weight name {name!r}")
                continue
            if shp != tuple(t.shape):
                raise ValueError(f"shape mismatch for {name}: got {tuple(t.shape)}, expected {shp}")
            dst, src = self.place(name, t)
            dst.copy_(src.to(device=dst.device, dtype=dst.dtype))
            seen.append(name)
        self.mark_weights_changed()
        self.note_written(seen)
        return seen

    def init_dummy(self, seed: int) -> None:
        """Random weights (sglang's `--load-format dummy`), the same full tensors on every rank
        whatever the TP size (each rank keeps its slice), so a TP-N dummy server equals TP-1."""
        g = torch.Generator(device=self.device).manual_seed(seed)
        for name, shp in sorted(self.hf_names().items()):
            if split_scale_name(name):
                continue           # made with its weight below
            full = torch.empty(shp, dtype=torch.float32, device=self.device)
            full.normal_(0.0, 0.02, generator=g) if len(shp) > 1 else full.fill_(1.0)
            if self._fp8_part(name) is not None:
                q, scale = quantize_block_fp8(full, self.fp8.block)
                self.load_state([(name, q), (scale_name(name), scale)])
            else:
                self.load_state([(name, full)])

    def offload_weights(self, keep: bool = True) -> None:
        """`/release_memory_occupation` of "weights": give the device memory back to the driver so a
        colocated trainer can use it. ``keep`` (SGLang's ``--enable-weights-cpu-backup``) copies the
        bytes into a pinned host buffer, made once and reused by every later release. Without it the
        bytes are dropped, as SGLang's memory saver drops them: the trainer pushes every weight
        before the next generation, so the copy (a fresh pageable buffer each step: ~0.19 s per
        step for SmolLM2-135M on the H100 box) bought nothing. Until the next weight update the
        model serves nothing until every weight has been written again (:meth:`weights_stale`)."""
        if not self._resident():
            return
        if keep:
            if self._host_copy is None or self._host_copy.numel() != self._flat.numel():
                self._host_copy = torch.empty(self._flat.numel(), dtype=torch.uint8,
                                              pin_memory=self.device.type == "cuda")
            self._host_copy.copy_(self._flat)
        else:
            self._unwritten = {n for n in self.hf_names() if not self.is_ignored(n)}
        self._kept_at_release = keep
        if self._weights_region is not None:
            self._weights_region.release()    # same address on resume: the decode graphs stay valid
            self._empty_device_cache()        # cached activation blocks go to the trainer too
            return
        held = self._host_copy if keep else torch.empty(self._flat.numel(), dtype=torch.uint8, device="meta")
        self._flat = held
        self._carve(held)
        self._empty_device_cache()

    def _resident(self) -> bool:
        """The weights are on the serving device (not released)."""
        if self._weights_region is not None:
            return self._weights_region.mapped
        return self._flat is not None and self._flat is not self._host_copy and self._flat.device.type != "meta"

    def weights_stale(self) -> bool:
        """Released without a host copy and not every weight written since: nothing valid to serve."""
        return bool(self._unwritten)

    def reload_weights(self) -> None:
        """Back onto the serving device (`/resume_memory_occupation`), as one allocation: the kept
        host copy, or -- dropped at release -- uninitialised bytes the next push overwrites."""
        if self._flat is None or self._resident():
            return
        if self._weights_region is not None:
            self._weights_region.restore()
            if self._kept_at_release:
                self._flat.copy_(self._host_copy)
            return
        flat = torch.empty(self._flat.numel(), dtype=torch.uint8, device=self.device)
        if self._flat.device.type != "meta":
            flat.copy_(self._flat)
        self._flat = flat
        self._carve(flat)
        self._mark_graphs_dirty()

    def _mark_graphs_dirty(self) -> None:
        for g in (self.graphs, self.prefill_graphs):
            if g is not None:
                g.mark_dirty()

    def _empty_device_cache(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def tensor_addresses(self, params: bool = True) -> Tuple[int, ...]:
        """Addresses of every tensor the forward reads: the parameters (``params``) and any tensor
        attribute (the cache, rope tables, ...), one level into dicts/lists. Decode graphs
        captured under one set of addresses are valid exactly while it stays the same. Without
        ``params`` it reads only the attributes that held tensors at the last full walk (a few
        pointers, cheap enough for every step; walking every attribute cost ~0.1 ms a step)."""
        if params or self._tensor_attrs is None:
            names = []
            for k, v in vars(self).items():
                if k in ("params", "_fused_views", "_tensor_attrs", "_host_copy"):   # parameter views: listed
                    # above; the released weights' host copy: no forward reads it
                    continue
                items = v.values() if isinstance(v, dict) else v if isinstance(v, (list, tuple)) else (v,)
                if any(isinstance(t, torch.Tensor) for t in items):
                    names.append(k)
            self._tensor_attrs = names
        out = [t.data_ptr() for t in self.params.values()] if params else []
        for k in self._tensor_attrs:
            v = getattr(self, k)
            items = v.values() if isinstance(v, dict) else v if isinstance(v, (list, tuple)) else (v,)
            out.extend(t.data_ptr() if isinstance(t, torch.Tensor) else 0 for t in items)
        return tuple(out)

    def load_hf_dir(self, path: str):
        from safetensors import safe_open
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {path}")
        seen = set()
        for f in files:
            with safe_open(os.path.join(path, f), framework="pt") as fh:
                for k in fh.keys():
                    seen.update(self.load_state([(k, fh.get_tensor(k))], strict=False))
        missing = set(self.hf_names()) - seen
        if missing:
            raise ValueError(f"checkpoint {path} lacks {len(missing)} weights, e.g. {sorted(missing)[:3]}")

    # ---------------------------------------------------------------- KV cache
    def alloc_cache(self, max_slots: int, max_len: int):
        """Rows ``[0, max_slots)`` of ``max_len`` positions each (zeroed)."""
        s = self.spec
        shp = (s.num_layers, max_slots, self.nkv, max_len, s.head_dim)
        self.k_cache = self.v_cache = self.routes = None
        parts = [(shp, self.dtype), (shp, self.dtype)]
        if self.record_routes:
            parts.append(((max_slots, max_len, s.num_layers, s.top_k), torch.int32))
        if self._weights_region is not None:     # stable memory chosen at construction (_alloc)
            self.k_cache, self.v_cache, *routes = self._cache_views(parts)
        else:
            self.k_cache, self.v_cache, *routes = (torch.zeros(p, dtype=d, device=self.device) for p, d in parts)
        self.routes = routes[0] if routes else None
        if self.row_ids is None or self.row_ids.numel() != max_slots:
            self.row_ids = torch.arange(max_slots, device=self.device)
        if self.rope_cos is None or self.rope_cos.shape[0] != max_len:
            # every position's cos/sin as `_rope` computes them (the fused decode step reads rows)
            cos, sin = self._rope(torch.arange(max_len, device=self.device)[None])
            half = s.head_dim // 2
            self.rope_cos = cos[0, 0, :, :half].contiguous()
            self.rope_sin = sin[0, 0, :, :half].contiguous()
        if (self.max_slots, self.max_len) != (max_slots, max_len):
            self.graphs = self.prefill_graphs = None   # bucketed for other sizes
        self.max_slots, self.max_len = max_slots, max_len
        self._mark_graphs_dirty()

    def _cache_views(self, parts: List[Tuple[Tuple[int, ...], torch.dtype]]) -> List[torch.Tensor]:
        """Zeroed tensors of ``parts`` (shape, dtype) carved from one stable region: the same
        sizes as last time come back at the same addresses (the decode graphs stay valid)."""
        sizes = [-(-math.prod(p) * d.itemsize // 256) * 256 for p, d in parts]
        if self._cache_region is not None and self._cache_region.nbytes != sum(sizes):
            self._cache_region.close()
            self._cache_region = None
        if self._cache_region is None:
            self._cache_region = StableRegion(sum(sizes), self.device)
        self._cache_region.restore()
        flat = self._cache_region.tensor
        flat.zero_()
        out, off = [], 0
        for (shape, dtype), size in zip(parts, sizes):
            out.append(flat[off:off + math.prod(shape) * dtype.itemsize].view(dtype).view(shape))
            off += size
        return out

    def free_cache(self):
        self.k_cache, self.v_cache = None, None
        self.routes = None
        if self._cache_region is not None:
            self._cache_region.release()
        self._empty_device_cache()

    def records_routes(self) -> bool:
        return self.routes is not None

    def routed_experts(self, row: int, start: int, end: int) -> torch.Tensor:
        """Experts chosen at positions ``[start, end)`` of cache row ``row``: int32 ``[end - start,
        num_hidden_layers, top_k]`` on the CPU (SGLang's layout; rows of dense layers are 0)."""
        if self.routes is None:
            raise RuntimeError("routed experts are not recorded (--enable-return-routed-experts, MoE models only)")
        return self.routes[row, start:end].to("cpu", copy=True)

    def _record_routes(self, layer: int, idx: torch.Tensor) -> None:
        """Store one MoE layer's top-k choices ``idx`` [B, T, k] where this forward stores its keys."""
        a = self._route_ctx
        if self.routes is None or a is None:
            return
        idx = idx.to(torch.int32)
        if a.kind == "decode":
            self.routes[a.rows, a.pos, layer] = idx[:, 0]
        elif a.write is not None:
            rows, pos, b, t = a.write
            self.routes[rows, pos, layer] = idx[b, t]

    def cache_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k_cache, self.v_cache) if t is not None)

    @torch.inference_mode()
    def copy_rows(self, src: Sequence[int], dst: Sequence[int], length: int) -> None:
        """Positions ``[0, length)`` of cache row ``src[i]`` into row ``dst[i]``, every layer: the
        prompt of a group's first sample into its siblings, or a running row into a gap."""
        if not len(src):
            return
        si = torch.as_tensor(np.asarray(src, dtype=np.int64), device=self.device)
        di = torch.as_tensor(np.asarray(dst, dtype=np.int64), device=self.device)
        for c in (self.k_cache, self.v_cache):
            c[:, di, :, :length] = c[:, si, :, :length]
        if self.routes is not None:
            self.routes[di, :length] = self.routes[si, :length]

    # ---------------------------------------------------------------- forward
    def _rope(self, pos: torch.Tensor):
        # pos: [B, T] int64 -> cos, sin [B, 1, T, D]
        freqs = pos[..., None].float() * self.inv_freq[None, None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.rope_scale).to(self.dtype)[:, None]
        sin = (emb.sin() * self.rope_scale).to(self.dtype)[:, None]
        return cos, sin

    def _mlp(self, i: int, x: torch.Tensor) -> torch.Tensor:
        p = f"model.layers.{i}.mlp."
        P = self.params
        if i not in self.spec.moe_layers:
            g = self._proj(x, i, p, "gate_proj")
            u = self._proj(x, i, p, "up_proj")
            return self._row_parallel_out(self._proj(F.silu(g) * u, i, p, "down_proj", bias=False),
                                          P.get(p + "down_proj.bias"))
        s = self.spec
        shp = x.shape
        h = x.reshape(-1, shp[-1])
        logits = F.linear(h, P[p + "gate.weight"])
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        w, idx = torch.topk(probs, s.top_k, dim=-1)
        self._record_routes(i, idx.view(*shp[:-1], s.top_k))
        if s.norm_topk_prob:
            w = w / w.sum(dim=-1, keepdim=True)
        w = w.to(h.dtype)
        out = torch.zeros_like(h)
        gp, up, dp = P[p + "experts.gate_proj"], P[p + "experts.up_proj"], P[p + "experts.down_proj"]
        for e in torch.unique(idx).tolist():
            tok, slot = torch.where(idx == e)
            xe = h[tok]
            ye = F.linear(F.silu(F.linear(xe, gp[e])) * F.linear(xe, up[e]), dp[e])
            out.index_add_(0, tok, ye * w[tok, slot, None])
        return self._row_parallel_out(out, None).reshape(shp)

    def _proj(self, x: torch.Tensor, i: int, prefix: str, proj: str, bias: bool = True) -> torch.Tensor:
        """A dense projection of layer ``i`` (this rank's part) plus the LoRA deltas of the forward's
        adapters on their rows. Row-parallel layers (o, down) are called without their bias: the
        delta is a partial sum like the base output, completed by the same all-reduce."""
        P = self.params
        y = F.linear(x, P[prefix + proj + ".weight"], P.get(prefix + proj + ".bias") if bias else None)
        for adapter, rows in self._lora:
            pair = adapter.pairs.get((i, proj))
            if pair is None:
                continue
            if rows is None:
                y = y + lora_delta(x, pair, adapter.scaling).to(y.dtype)
            else:
                y = y.index_add(0, rows, lora_delta(x[rows], pair, adapter.scaling).to(y.dtype))
        return y

    def unload_lora(self, name: str) -> None:
        self.adapters.pop(name, None)

    def use_adapters(self, names: Optional[Sequence[Optional[str]]]) -> None:
        """The adapters of the next forward: ``names[b]`` is batch row b's adapter (None: the base);
        rows are grouped per adapter, so a batch of one adapter costs one extra pair of matmuls."""
        self._lora = []
        if not names or not any(names):
            return
        for name in dict.fromkeys(n for n in names if n):
            if name not in self.adapters:
                raise KeyError(f"LoRA adapter {name!r} is not loaded on tp rank {self.tp_rank}")
            rows = [b for b, n in enumerate(names) if n == name]
            idx = None if len(rows) == len(names) else torch.tensor(rows, dtype=torch.long, device=self.device)
            self._lora.append((self.adapters[name], idx))

    def _row_parallel_out(self, y: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        """Finish a row-parallel layer: sum the ranks' partial outputs, then add the bias once."""
        if self.tp_size > 1:
            y = y.contiguous()
            self._all_reduce(y)
        return y if bias is None else y + bias

    def _layer(self, i: int, x, cos, sin, a: "_Attn"):
        s = self.spec
        P = self.params
        p = f"model.layers.{i}.self_attn."
        B, T, _ = x.shape
        nh, nkv = self.nh, self.nkv
        h = _rms(x, P[f"model.layers.{i}.input_layernorm.weight"], s.rms_norm_eps)
        q = self._proj(h, i, p, "q_proj").view(B, T, nh, s.head_dim).transpose(1, 2)
        k = self._proj(h, i, p, "k_proj").view(B, T, nkv, s.head_dim).transpose(1, 2)
        v = self._proj(h, i, p, "v_proj").view(B, T, nkv, s.head_dim).transpose(1, 2)
        if s.qk_norm:
            q = _rms(q, P[p + "q_norm.weight"], s.rms_norm_eps)
            k = _rms(k, P[p + "k_norm.weight"], s.rms_norm_eps)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        x = x + self._row_parallel_out(self._proj(self._attend(i, q, k, v, a), i, p, "o_proj", bias=False),
                                       P.get(p + "o_proj.bias"))
        h = _rms(x, P[f"model.layers.{i}.post_attention_layernorm.weight"], s.rms_norm_eps)
        return x + self._mlp(i, h)

    def _attend(self, i: int, q, k, v, a: "_Attn") -> torch.Tensor:
        """Store the new keys/values where ``a`` says, attend, and return ``[B, T, heads*D]``."""
        B, nh, T, D = q.shape
        nkv = self.nkv
        scale = 1.0 / math.sqrt(D)
        if a.kind == "decode":
            # T == 1; rows [0, B) of the cache: write at each row's position, attend over a view
            kc, vc = self.k_cache[i], self.v_cache[i]
            kc[a.rows, :, a.pos] = k[:, :, 0]
            vc[a.rows, :, a.pos] = v[:, :, 0]
            kk, vv = kc[:B, :, :a.Lk], vc[:B, :, :a.Lk]
            if nkv != nh:
                # GQA: fold each kv head's query group into the query-length axis instead of
                # repeating K/V (q head j uses kv head j // rep, as repeat_interleave does)
                qg = q.reshape(B, nkv, nh // nkv, D)
                return F.scaled_dot_product_attention(qg, kk, vv, attn_mask=a.mask, scale=scale).reshape(B, 1, nh * D)
        else:
            if a.write is not None:
                rows, pos, b, t = a.write
                self.k_cache[i][rows, :, pos] = k[b, :, t]
                self.v_cache[i][rows, :, pos] = v[b, :, t]
            if a.kind == "local":   # causal, no mask tensor, K/V heads shared by their query groups:
                # one flash/efficient-attention call per layer (no mask build, no K/V repeat)
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=nkv != nh)
                return out.transpose(1, 2).reshape(B, T, nh * D)
            # "cache": rows [row0, row0 + B) hold earlier positions (copied prefixes)
            kk = self.k_cache[i][a.row0:a.row0 + B, :, :a.Lk]
            vv = self.v_cache[i][a.row0:a.row0 + B, :, :a.Lk]
            if nkv != nh:
                kk = kk.repeat_interleave(nh // nkv, dim=1)
                vv = vv.repeat_interleave(nh // nkv, dim=1)
        out = F.scaled_dot_product_attention(q, kk, vv, attn_mask=a.mask, scale=scale)
        return out.transpose(1, 2).reshape(B, T, nh * D)

    def _head(self, x) -> Optional[torch.Tensor]:
        if self.tp_rank != 0:
            return None   # the head is replicated: only rank 0 (which samples) computes logits
        return self._logits(_rms(x, self.params["model.norm.weight"], self.spec.rms_norm_eps))

    def _logits(self, x, upcast: bool = True) -> torch.Tensor:
        """Logits of the final-normed hidden states ``x``: fp32, or (``upcast`` False) in the
        model's dtype for a consumer that upcasts as it reads (`sampler.sample_rows`); the values
        are the same either way."""
        w = self.params["model.embed_tokens.weight"] if self.spec.tie_word_embeddings else self.params["lm_head.weight"]
        if self.fp32_lm_head:
            return fp32_logits(x, w)
        out = F.linear(x, w)
        return out.float() if upcast else out

    @torch.inference_mode()
    def prefill(self, seqs: List[List[int]], row0: int, starts: Optional[List[int]] = None,
                loras: Optional[Sequence[Optional[str]]] = None) -> Optional[torch.Tensor]:
        """Run ``seqs`` (right-padded into one batch) into cache rows ``row0, row0 + 1, ...``:
        ``seqs[u]`` takes positions ``starts[u]...`` of its row, whose positions before that were
        already filled (copied from a row holding the same prefix); ``loras[u]`` is its LoRA
        adapter's name (None: the base model). fp32 logits ``[U, V]`` of each sequence's last token
        (None on TP ranks > 0)."""
        self._before_forward()
        U = len(seqs)
        views = self._fused_prefill_views(starts, loras)
        if views is not None and self._graphed():
            logits = self._prefill_graphs().run(seqs, row0)
            if logits is not None:
                return logits
        lens = torch.tensor([len(q) for q in seqs], dtype=torch.long)
        T = int(lens.max())
        ids = torch.zeros(U, T, dtype=torch.long)
        for b, q in enumerate(seqs):
            ids[b, : len(q)] = torch.tensor(q, dtype=torch.long)
        dev = self.device
        if views is not None:
            return fused_prefill.prefill_body(self, views, ids.to(dev), lens.to(dev),
                                              torch.arange(row0, row0 + U, device=dev), row0)
        st = torch.tensor(starts if starts is not None else [0] * U, dtype=torch.long)
        t_ar = torch.arange(T)
        pos = st[:, None] + t_ar[None, :]
        b_idx, t_idx = torch.nonzero(t_ar[None, :] < lens[:, None], as_tuple=True)
        write = tuple(z.to(dev) for z in (b_idx + row0, pos[b_idx, t_idx], b_idx, t_idx))
        if int(st.max()) == 0:   # from the start: causal over the batch's own keys -- rows are
            a = _Attn("local", None, write=write)   # right-padded, so a token's earlier positions are its own
        else:
            Lk = int((st + lens).max())
            mask = (torch.arange(Lk)[None, None, :] <= pos[:, :, None])[:, None].to(dev)
            a = _Attn("cache", mask, row0=row0, Lk=Lk, write=write)
        ids, pos = ids.to(dev), pos.to(dev)
        cos, sin = self._rope(pos)
        x = F.embedding(ids, self.params["model.embed_tokens.weight"])
        self._route_ctx = a
        self.use_adapters(loras)
        try:
            for i in range(self.spec.num_layers):
                x = self._layer(i, x, cos, sin, a)
        finally:
            self._route_ctx = None
            self._lora = []
        last = x[torch.arange(U, device=dev), (lens - 1).to(dev)]
        return self._head(last)

    @torch.inference_mode()
    def decode(self, tokens: Sequence[int], positions: Sequence[int],
               loras: Optional[Sequence[Optional[str]]] = None) -> Optional[torch.Tensor]:
        """``loras``: each row's adapter name (None: the base; any adapter: no CUDA graph). One step for the B running rows ``[0, B)``: token b sits at ``positions[b]`` of row b.
        logits ``[B, V]``, fp32 (the Triton step: the model's dtype, see `_logits`; None on TP
        ranks > 0); with CUDA graphs a view of the graph's output, valid until the next step."""
        self._before_forward()
        tokens = np.asarray(tokens, dtype=np.int64)
        positions = np.asarray(positions, dtype=np.int64)
        if self._graphed() and not (loras and any(loras)):
            return self._decode_graphs().run(tokens, positions)
        ids = torch.from_numpy(tokens).to(self.device)
        pos = torch.from_numpy(positions).to(self.device)
        self.use_adapters(loras)
        try:
            return self._decode_body(ids, pos, len(tokens), int(positions.max()) + 1, record=True)
        finally:
            self._lora = []

    def can_chain(self) -> bool:
        """Can a decode step be launched before the previous one's tokens reach the host
        (`decode_launch` with ``tokens`` None)? Only with CUDA graphs (they feed tokens back)."""
        return self.decode_overlap and self._graphed()

    def _decode_graphs(self) -> DecodeGraphs:
        """The decode steps' CUDA graphs (created on first use)."""
        if self.graphs is None:
            # the fused step's attention reads each row's own keys: one graph per split class of
            # key lengths, not per 64-key bucket (the torch body's mask is as long as its bucket)
            fused = self._fused_decode_views() is not None
            self.graphs = DecodeGraphs(self._decode_body, self.tensor_addresses, self.device,
                                       self.max_slots, self.max_len,
                                       key_length=fused_decode.graph_key_length if fused else None)
        return self.graphs

    def _prefill_graphs(self) -> PrefillGraphs:
        """The small fused prefills' CUDA graphs (created on first use)."""
        if self.prefill_graphs is None:
            def body(ids: torch.Tensor, lens: torch.Tensor, rows: torch.Tensor) -> Optional[torch.Tensor]:
                return fused_prefill.prefill_body(self, self._fused_decode_views(), ids, lens, rows)
            tokens, rows = self._prefill_graph_limits()
            self.prefill_graphs = PrefillGraphs(body, self.tensor_addresses, self.device, rows, self.max_len, tokens)
        return self.prefill_graphs

    def _prefill_graph_limits(self) -> Tuple[int, int]:
        """(padded tokens, rows) a captured prefill may hold. ``MEGARL_PREFILL_GRAPH_TOKENS``: unset or
        "auto" (the default), as many as PREFILL_GRAPH_MIB of activations (~2k tokens of
        Qwen2.5-0.5B, 512 of a 7B) in as many rows as half of PREFILL_GRAPH_MIB of fp32 logits holds
        -- the graphs' memory pool stays through every release (the colocated trainer's step); a
        number, that many tokens in up to as many rows (the engine's slots at most: the caller sized
        it, the fp32 logits buffer included); 0, none (every prefill launched eagerly). Why on: a
        one-prompt admission took 1.8 ms instead of 7.0, and a 500-token one 2.5 instead of 7-10
        (H100, Qwen2.5-0.5B shape, benchmarks/RESULTS.md, prefill and admissions)."""
        s = self.spec
        width = 3 * (s.intermediate_size or 0) + 4 * s.hidden_size + (self.nh + 2 * self.nkv) * s.head_dim
        budget = PREFILL_GRAPH_MIB << 20
        env = os.environ.get("MEGARL_PREFILL_GRAPH_TOKENS") or "auto"
        if env == "auto":
            tokens = min(2048, _floor_pow2(budget // (width * self.dtype.itemsize)))
            rows = _floor_pow2(budget // 2 // (s.vocab_size * 4))
        else:
            tokens = rows = _env_int("MEGARL_PREFILL_GRAPH_TOKENS", env)
        return tokens, max(min(self.max_slots, rows), 1)

    def _graphed(self) -> bool:
        """Do decode steps run as CUDA graphs (single GPU, dense model)?"""
        return self.use_cuda_graphs and not self.spec.moe_layers

    @torch.inference_mode()
    def decode_launch(self, tokens: Optional[Sequence[int]], positions: Sequence[int],
                      sample: Callable[[torch.Tensor, int], torch.Tensor], sample_key: Tuple = ()):
        """One decode step of rows ``[0, B)`` and its sampling, queued: ``sample(logits, rows)`` turns
        the fp32 logits of ``rows`` rows into ``[2, rows]`` (tokens, logprobs); with CUDA graphs it is
        captured into the step's graph and nothing waits for the GPU here (``tokens`` None: the
        tokens the previous launch sampled, see `DecodeGraphs.launch`). `decode_result` gives the
        output. Rank 0 only (TP > 1 runs `decode`)."""
        self._before_forward()
        positions = np.asarray(positions, dtype=np.int64)
        if self._graphed():
            return self._decode_graphs().launch(None if tokens is None else np.asarray(tokens, dtype=np.int64), positions,
                                      sample, sample_key)
        if tokens is None:
            raise RuntimeError("decode_launch without tokens needs CUDA graphs (can_chain)")
        # (an eager step samples here and now: the launch is the result)
        ids = torch.from_numpy(np.asarray(tokens, dtype=np.int64)).to(self.device)
        pos = torch.from_numpy(positions).to(self.device)
        return sample(self._decode_body(ids, pos, len(positions), int(positions.max()) + 1, record=True),
                      len(positions)).cpu().numpy()

    @staticmethod
    def decode_result(handle) -> np.ndarray:
        """``[2, B]`` float64 tokens and logprobs of a `decode_launch` (waits for it)."""
        return handle if isinstance(handle, np.ndarray) else DecodeGraphs.result(handle)

    def _decode_body(self, ids: torch.Tensor, pos: torch.Tensor, B: int, Lk: int,
                     record: bool = False) -> Optional[torch.Tensor]:
        """Decode rows ``[0, B)`` attending over positions ``[0, Lk)``; no host sync (graphed;
        ``record``: MoE routes too, eager only -- graphs never run MoE models)."""
        views = self._fused_decode_views()
        if views is not None:
            ctx = _Attn("decode", None, Lk=Lk, rows=self.row_ids[:B], pos=pos) if record else None
            return fused_decode.decode_body(self, views, ids, pos, B, Lk, route_ctx=ctx,
                                            projections=self.decode_kernels == "triton-proj")
        cos, sin = self._rope(pos[:, None])
        mask = (torch.arange(Lk, device=self.device)[None, :] <= pos[:, None])[:, None, None, :]
        a = _Attn("decode", mask, Lk=Lk, rows=self.row_ids[:B], pos=pos)
        x = F.embedding(ids[:, None], self.params["model.embed_tokens.weight"])
        self._route_ctx = a if record else None
        try:
            for i in range(self.spec.num_layers):
                x = self._layer(i, x, cos, sin, a)
        finally:
            self._route_ctx = None
        return self._head(x[:, 0])

    def uses_triton(self) -> bool:
        """Does a decode step run the Triton kernels (so the engine samples with them too)?"""
        return self._fused_decode_views() is not None

    def _fused_decode_views(self) -> Optional[list]:
        """The fused projection views when this decode step runs the Triton body, else None (the
        torch body: ``decode_kernels`` "torch", LoRA adapters in use, no Triton, a shape it does not
        serve, q/k/v or gate/up not adjacent in the buffer)."""
        mode = self.decode_kernels
        # "auto": only inside CUDA graphs -- launched one by one from Python, Triton kernels cost
        # more to launch than the torch body's (H200: 58 vs 88 tokens/s eager at batch 1)
        if mode == "torch" or self._lora or (mode == "auto" and not (self.device.type == "cuda" and self._graphed())):
            return None
        if self._fused_views is None:
            ok, why = _triton_ok(self.spec.head_dim, self.dtype, projections=mode == "triton-proj")
            views = fused_decode.layer_views(self) if ok else None
            if views is None and mode in ("triton", "triton-proj"):
                raise RuntimeError(f"MEGARL_DECODE_KERNELS={mode}: the fused decode step cannot serve this model "
                                   f"({why or 'q/k/v or gate/up weights are not adjacent'})")
            self._fused_views = views if views is not None else []
        return self._fused_views or None

    def _fused_prefill_views(self, starts: Optional[List[int]], loras: Optional[Sequence[Optional[str]]]) -> Optional[list]:
        """The fused projection views when a prefill runs the Triton kernels (`fused_prefill.py`):
        where the decode step does, from position 0 (no copied prefix), without LoRA, dense
        layers only (MoE routes are recorded by the torch body); else None (the torch body).
        ``MEGARL_PREFILL_KERNELS=torch`` keeps the torch body (the same-run baseline of benchmarks)."""
        if (os.environ.get("MEGARL_PREFILL_KERNELS", "auto") == "torch" or self.spec.moe_layers
                or (starts is not None and any(starts)) or (loras is not None and any(loras))):
            return None
        return self._fused_decode_views()

    @torch.inference_mode()
    def forward_full(self, ids: List[int], lora: Optional[str] = None) -> Optional[torch.Tensor]:
        """Logits [T, V] over a whole sequence, without the cache (None on TP ranks > 0), with adapter
        ``lora`` if given.  For tests."""
        return self._head(self._hidden_full(ids, lora))

    @torch.inference_mode()
    def prompt_logprobs(self, ids: List[int], start: int, lora: Optional[str] = None,
                        chunk: int = 1024) -> Optional[torch.Tensor]:
        """fp32 ``log p(ids[i] | ids[:i])`` of the given tokens for ``i`` in ``start + 1 .. T - 1``
        (``[T - 1 - start]``; None on TP ranks > 0): a teacher's scores of a sequence it did not
        generate. Raw logits (no temperature), as SGLang's input logprobs. The head runs over
        ``chunk`` positions at a time, so a long sequence never holds ``[T, V]`` logits."""
        h = self._hidden_full(ids, lora)
        if self.tp_rank != 0:
            return None
        x = _rms(h[start:len(ids) - 1], self.params["model.norm.weight"], self.spec.rms_norm_eps)
        nxt = torch.tensor(ids[start + 1:], dtype=torch.long, device=self.device)
        out = torch.empty(nxt.numel(), dtype=torch.float32, device=self.device)
        for a in range(0, nxt.numel(), chunk):
            logits = self._logits(x[a:a + chunk])
            out[a:a + chunk] = logits.gather(1, nxt[a:a + chunk, None])[:, 0] - torch.logsumexp(logits, -1)
        return out

    def _hidden_full(self, ids: List[int], lora: Optional[str]) -> torch.Tensor:
        """Hidden states ``[T, H]`` after the last layer (before the final norm) of a whole sequence,
        without the cache."""
        self._before_forward()
        T = len(ids)
        t = torch.tensor(ids, dtype=torch.long, device=self.device)[None]
        pos = torch.arange(T, device=self.device)[None]
        cos, sin = self._rope(pos)
        x = F.embedding(t, self.params["model.embed_tokens.weight"])
        a = _Attn("local", None)
        self.use_adapters([lora])
        try:
            for i in range(self.spec.num_layers):
                x = self._layer(i, x, cos, sin, a)
        finally:
            self._lora = []
        return x[0]


@dataclass
class _Attn:
    """How every layer of one forward stores keys/values and attends.

    kind: "local" (causal over the call's own keys, no mask: a prefill from position 0, or a
    cache-less forward),
    "cache" (over cache rows ``[row0, row0 + B)``, positions ``[0, Lk)``: a prefill after a copied
    prefix), "decode" (one token per row over rows ``[0, B)``, positions ``[0, Lk)``)."""

    kind: str
    mask: Optional[torch.Tensor]                # bool, True = attend, broadcast over heads (None: local)
    row0: int = 0
    Lk: int = 0
    write: Optional[Tuple[torch.Tensor, ...]] = None   # (cache row, position, batch index, token index)
    rows: Optional[torch.Tensor] = None                # decode: row ids [B]
    pos: Optional[torch.Tensor] = None                 # decode: positions [B]
