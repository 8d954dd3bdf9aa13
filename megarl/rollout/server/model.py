"""A compact torch implementation of the HF decoder families the embedded server serves.

Families: llama (SmolLM2, Llama-2/3, Mistral-like), qwen2 (qkv bias), qwen3 (qk-norm),
qwen3_moe (qk-norm + top-k routed experts).  Parameters are held under their HF checkpoint
names (experts stacked per layer, addressable as `...mlp.experts.{e}.{gate,up,down}_proj.weight`),
so weight updates load by HF name.

KV cache: slot-based and preallocated: per layer `k`, `v` of shape
[max_slots, kv_heads, max_len, head_dim].  A request owns one slot for its lifetime.
Attention runs through `scaled_dot_product_attention` with an explicit mask, in the model dtype
(fp32 on CPU by default); logits are returned in fp32.

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
from typing import Callable, Dict, Iterable, List, Optional, Tuple

import torch
import torch.nn.functional as F

from megarl.algos.fidelity import fp32_logits

from .shard import local_part, local_shape

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


_EXPERT_RE = re.compile(r"^(model\.layers\.(\d+)\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


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
        self._alloc()
        self.k_cache: List[torch.Tensor] = []
        self.v_cache: List[torch.Tensor] = []
        # routed experts of every cached position (SGLang's --enable-return-routed-experts): int32
        # [slots, max_len, num_layers, top_k], filled by prefill/decode of MoE layers (rank 0 only:
        # routing is replicated over TP ranks); rows of dense layers stay 0, as in SGLang
        self.record_routes = record_routes and bool(s.moe_layers)
        self.routes: Optional[torch.Tensor] = None
        self._route_ctx: Optional[tuple] = None
        self.max_slots = 0
        self.max_len = 0
        # CUDA graphs for decode (CUDA only): one graph per (batch bucket, kv-length bucket),
        # captured lazily; dropped whenever the cache or the parameter tensors are replaced.
        # (not with TP: the all-reduce would have to be captured in the graph on every rank)
        self.use_cuda_graphs = (self.device.type == "cuda" and tp_size == 1
                                and os.environ.get("MEGARL_CUDA_GRAPHS", "1") != "0")
        self._graphs: Dict[Tuple[int, int], tuple] = {}
        self._graph_pool = None
        self._graph_io = None

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
        for n, shp in self.full_shapes.items():
            self.params[n] = torch.zeros(local_shape(n, shp, self.tp_rank, self.tp_size),
                                         device=self.device, dtype=self.dtype)

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
        return out

    def hf_shape(self, name: str) -> Optional[Tuple[int, ...]]:
        """Full HF shape of checkpoint name `name`, or None if the model has no such weight."""
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
        unknown. `lm_head.weight` of a tied model is skipped, as sglang does (`is_ignored`)."""
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
        """(destination on this rank, the slice of the full HF tensor `full` that goes there)."""
        dst = self.target(name)
        if dst is None:
            raise KeyError(f"unknown weight name {name!r}")
        return dst, local_part(name, full, self.tp_rank, self.tp_size)

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
        return seen

    def init_dummy(self, seed: int) -> None:
        """Random weights (sglang's `--load-format dummy`), the same full tensors on every rank
        whatever the TP size (each rank keeps its slice), so a TP-N dummy server equals TP-1."""
        g = torch.Generator(device=self.device).manual_seed(seed)
        for name, shp in sorted(self.hf_names().items()):
            full = torch.empty(shp, dtype=torch.float32, device=self.device)
            full.normal_(0.0, 0.02, generator=g) if len(shp) > 1 else full.fill_(1.0)
            self.load_state([(name, full)])

    def offload_weights(self) -> None:
        """Move the weights to host memory (`/release_memory_occupation` of "weights")."""
        for k, t in self.params.items():
            self.params[k] = t.to("cpu")
        self._graphs, self._graph_io, self._graph_pool = {}, None, None

    def reload_weights(self) -> None:
        """Back onto the serving device (`/resume_memory_occupation`)."""
        for k, t in self.params.items():
            self.params[k] = t.to(self.device)
        self._graphs, self._graph_io, self._graph_pool = {}, None, None

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
        s = self.spec
        self._graphs, self._graph_io, self._graph_pool = {}, None, None
        # with CUDA graphs one extra scratch slot takes the padding rows of a bucketed batch
        extra = 1 if self.use_cuda_graphs else 0
        shp = (max_slots + extra, self.nkv, max_len, s.head_dim)
        self.k_cache = [torch.zeros(shp, device=self.device, dtype=self.dtype) for _ in range(s.num_layers)]
        self.v_cache = [torch.zeros(shp, device=self.device, dtype=self.dtype) for _ in range(s.num_layers)]
        if self.record_routes:
            self.routes = torch.zeros(max_slots + extra, max_len, s.num_layers, s.top_k, dtype=torch.int32,
                                      device=self.device)
        self.max_slots, self.max_len = max_slots, max_len

    def free_cache(self):
        self._graphs, self._graph_io, self._graph_pool = {}, None, None
        self.k_cache, self.v_cache = [], []
        self.routes = None

    def records_routes(self) -> bool:
        return self.routes is not None

    def routed_experts(self, slot: int, start: int, end: int) -> torch.Tensor:
        """Experts chosen at positions ``[start, end)`` of ``slot``: int32 ``[end - start,
        num_hidden_layers, top_k]`` on the CPU (SGLang's layout; rows of dense layers are 0)."""
        if self.routes is None:
            raise RuntimeError("routed experts are not recorded (--enable-return-routed-experts, MoE models only)")
        return self.routes[slot, start:end].to("cpu", copy=True)

    def _record_routes(self, layer: int, idx: torch.Tensor) -> None:
        """Store one MoE layer's top-k choices ``idx`` [B, T, k] at the positions being run."""
        if self.routes is None or self._route_ctx is None:
            return
        kind, slots, where = self._route_ctx
        idx = idx.to(torch.int32)
        if kind == "prefill":
            for b, (slot, n) in enumerate(zip(slots, where)):
                self.routes[slot, :n, layer] = idx[b, :n]
        else:
            self.routes[slots, where, layer] = idx[:, 0]

    def cache_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k_cache + self.v_cache)

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
            g = F.linear(x, P[p + "gate_proj.weight"], P.get(p + "gate_proj.bias"))
            u = F.linear(x, P[p + "up_proj.weight"], P.get(p + "up_proj.bias"))
            return self._row_parallel_out(F.linear(F.silu(g) * u, P[p + "down_proj.weight"]), P.get(p + "down_proj.bias"))
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

    def _row_parallel_out(self, y: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        """Finish a row-parallel layer: sum the ranks' partial outputs, then add the bias once."""
        if self.tp_size > 1:
            y = y.contiguous()
            self._all_reduce(y)
        return y if bias is None else y + bias

    def _layer(self, i: int, x, cos, sin, slots, pos, attn_mask, prefill_lens=None, Lm: Optional[int] = None):
        s = self.spec
        P = self.params
        p = f"model.layers.{i}.self_attn."
        B, T, _ = x.shape
        nh, nkv = self.nh, self.nkv
        h = _rms(x, P[f"model.layers.{i}.input_layernorm.weight"], s.rms_norm_eps)
        q = F.linear(h, P[p + "q_proj.weight"], P.get(p + "q_proj.bias")).view(B, T, nh, s.head_dim).transpose(1, 2)
        k = F.linear(h, P[p + "k_proj.weight"], P.get(p + "k_proj.bias")).view(B, T, nkv, s.head_dim).transpose(1, 2)
        v = F.linear(h, P[p + "v_proj.weight"], P.get(p + "v_proj.bias")).view(B, T, nkv, s.head_dim).transpose(1, 2)
        if s.qk_norm:
            q = _rms(q, P[p + "q_norm.weight"], s.rms_norm_eps)
            k = _rms(k, P[p + "k_norm.weight"], s.rms_norm_eps)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        kc, vc = self.k_cache[i], self.v_cache[i]
        if prefill_lens is not None:
            # prefill: write the first len_b positions of each row into its slot, attend locally
            for b in range(B):
                L = prefill_lens[b]
                kc[slots[b], :, :L] = k[b, :, :L]
                vc[slots[b], :, :L] = v[b, :, :L]
            kk, vv = k, v
        else:
            # decode (T == 1): write at pos, attend over the slot's prefix
            kc[slots, :, pos] = k[:, :, 0]
            vc[slots, :, pos] = v[:, :, 0]
            if Lm is None:
                Lm = int(pos.max().item()) + 1
            kk = kc[slots, :, :Lm]
            vv = vc[slots, :, :Lm]
        if prefill_lens is None and nkv != nh:
            # decode (T == 1), GQA: fold each kv head's query group into the query-length axis
            # instead of repeating K/V (q head j uses kv head j // rep, as repeat_interleave does)
            rep = nh // nkv
            qg = q.reshape(B, nkv, rep, s.head_dim)
            a = F.scaled_dot_product_attention(qg, kk, vv, attn_mask=attn_mask, scale=1.0 / math.sqrt(s.head_dim))
            a = a.reshape(B, nh * s.head_dim)[:, None]
            x = x + self._row_parallel_out(F.linear(a, P[p + "o_proj.weight"]), P.get(p + "o_proj.bias"))
            h = _rms(x, P[f"model.layers.{i}.post_attention_layernorm.weight"], s.rms_norm_eps)
            return x + self._mlp(i, h)
        if nkv != nh:
            rep = nh // nkv
            kk = kk.repeat_interleave(rep, dim=1)
            vv = vv.repeat_interleave(rep, dim=1)
        a = F.scaled_dot_product_attention(q, kk, vv, attn_mask=attn_mask, scale=1.0 / math.sqrt(s.head_dim))
        a = a.transpose(1, 2).reshape(B, T, nh * s.head_dim)
        x = x + self._row_parallel_out(F.linear(a, P[p + "o_proj.weight"]), P.get(p + "o_proj.bias"))
        h = _rms(x, P[f"model.layers.{i}.post_attention_layernorm.weight"], s.rms_norm_eps)
        return x + self._mlp(i, h)

    def _head(self, x) -> Optional[torch.Tensor]:
        if self.tp_rank != 0:
            return None   # the head is replicated: only rank 0 (which samples) computes logits
        x = _rms(x, self.params["model.norm.weight"], self.spec.rms_norm_eps)
        w = self.params["model.embed_tokens.weight"] if self.spec.tie_word_embeddings else self.params["lm_head.weight"]
        if self.fp32_lm_head:
            return fp32_logits(x, w)
        return F.linear(x, w).float()

    @torch.inference_mode()
    def prefill(self, seqs: List[List[int]], slots: List[int]) -> Optional[torch.Tensor]:
        """Run prompts (right-padded into one batch) and fill their slots; fp32 logits [B, V] of
        each prompt's last position (None on TP ranks > 0)."""
        B = len(seqs)
        lens = [len(q) for q in seqs]
        T = max(lens)
        ids = torch.zeros(B, T, dtype=torch.long)
        for b, q in enumerate(seqs):
            ids[b, : len(q)] = torch.tensor(q, dtype=torch.long)
        ids = ids.to(self.device)
        pos = torch.arange(T, device=self.device)[None].expand(B, T)
        cos, sin = self._rope(pos)
        mask = torch.ones(T, T, dtype=torch.bool, device=self.device).tril()[None, None].expand(B, 1, T, T)
        x = F.embedding(ids, self.params["model.embed_tokens.weight"])
        self._route_ctx = ("prefill", slots, lens)
        try:
            for i in range(self.spec.num_layers):
                x = self._layer(i, x, cos, sin, slots, None, mask, prefill_lens=lens)
        finally:
            self._route_ctx = None
        last = x[torch.arange(B, device=self.device), torch.tensor(lens, device=self.device) - 1]
        return self._head(last)

    @torch.inference_mode()
    def decode(self, tokens: List[int], slots: List[int], positions: List[int]) -> Optional[torch.Tensor]:
        """One step for B running requests: token b sits at positions[b] of slot slots[b].
        Returns fp32 logits [B, V] (None on TP ranks > 0)."""
        if self.use_cuda_graphs and not self.spec.moe_layers:
            return self._decode_graphed(tokens, slots, positions)
        ids = torch.tensor(tokens, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        sl = torch.tensor(slots, dtype=torch.long, device=self.device)
        self._route_ctx = ("decode", sl, pos)
        try:
            return self._decode_body(ids, pos, sl, int(max(positions)) + 1)
        finally:
            self._route_ctx = None

    def _decode_body(self, ids, pos, sl, Lm: int) -> torch.Tensor:
        cos, sin = self._rope(pos[:, None])
        mask = (torch.arange(Lm, device=self.device)[None, :] <= pos[:, None])[:, None, None, :]
        x = F.embedding(ids[:, None], self.params["model.embed_tokens.weight"])
        for i in range(self.spec.num_layers):
            x = self._layer(i, x, cos, sin, sl, pos, mask, Lm=Lm)
        return self._head(x[:, 0])

    _B_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256)
    _L_BUCKET = 256

    def _decode_graphed(self, tokens, slots, positions) -> torch.Tensor:
        B = len(tokens)
        Bb = next((b for b in self._B_BUCKETS if b >= B), ((B + 63) // 64) * 64)
        Lm = int(max(positions)) + 1
        Lb = min(((Lm + self._L_BUCKET - 1) // self._L_BUCKET) * self._L_BUCKET, self.max_len)
        if self._graph_io is None or self._graph_io.shape[1] < Bb:
            nmax = max(Bb, self.max_slots)
            self._graph_io = torch.zeros(3, ((nmax + 63) // 64) * 64, dtype=torch.long, device=self.device)
            self._graphs, self._graph_pool = {}, None
        io = self._graph_io
        host = torch.empty(3, Bb, dtype=torch.long)
        host[0, :B] = torch.tensor(tokens, dtype=torch.long)
        host[1, :B] = torch.tensor(positions, dtype=torch.long)
        host[2, :B] = torch.tensor(slots, dtype=torch.long)
        host[0, B:] = 0
        host[1, B:] = 0
        host[2, B:] = self.max_slots  # scratch slot
        io[:, :Bb].copy_(host)
        ids, pos, sl = io[0, :Bb], io[1, :Bb], io[2, :Bb]
        key = (Bb, Lb)
        entry = self._graphs.get(key)
        if entry is None:
            if self._graph_pool is None:
                self._graph_pool = torch.cuda.graph_pool_handle()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):  # warm-up: same inputs, so the KV writes are idempotent
                    self._decode_body(ids, pos, sl, Lb)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._graph_pool):
                out = self._decode_body(ids, pos, sl, Lb)
            entry = self._graphs[key] = (graph, out)
        graph, out = entry
        graph.replay()
        return out[:B].clone()

    @torch.inference_mode()
    def forward_full(self, ids: List[int]) -> Optional[torch.Tensor]:
        """Logits [T, V] over a whole sequence without touching running slots (uses slot 0 of a
        private 1-slot cache; None on TP ranks > 0).  For tests and prompt logprobs."""
        saved = (self.k_cache, self.v_cache, self.max_slots, self.max_len, self.routes)
        try:
            self.alloc_cache(1, len(ids))
            T = len(ids)
            t = torch.tensor(ids, dtype=torch.long, device=self.device)[None]
            pos = torch.arange(T, device=self.device)[None]
            cos, sin = self._rope(pos)
            mask = torch.ones(T, T, dtype=torch.bool, device=self.device).tril()[None, None]
            x = F.embedding(t, self.params["model.embed_tokens.weight"])
            for i in range(self.spec.num_layers):
                x = self._layer(i, x, cos, sin, [0], None, mask, prefill_lens=[T])
            return self._head(x[0])
        finally:
            self.k_cache, self.v_cache, self.max_slots, self.max_len, self.routes = saved
