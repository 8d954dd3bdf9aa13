"""Parameter naming rules megatron <-> HF, per family, as data plus small transforms.

One source of truth for checkpoint conversion (``megarl.checkpoint``) and weight sync
(``megarl.sync`` via :func:`iter_hf_weights`).

Vocabulary
----------
* *local megatron name*: ``chunk.named_parameters()`` name (layer index local to the PP stage /
  VPP chunk, expert index local to the EP rank).
* *global megatron name*: the same with the global layer index (``TransformerLayer.layer_number-1``)
  and the global expert index (``ep_rank * num_local_experts + j``).
* *full tensor*: a parameter with its TP (or expert-TP) shards concatenated in megatron's layout.

``RULES`` maps a global megatron name (regex) to one or more HF names and a transform:

=========  ==================================================================================
copy       one HF tensor; TP shards are contiguous chunks along ``param.partition_dim``
vocab      like copy, plus vocab padding rows (zeros) dropped on export
qkv        HF q/k/v -> megatron fused ``linear_qkv`` interleaved per query group:
           ``[ng, (heads_per_group q | 1 k | 1 v), head_dim, ...]`` (contiguous TP chunks)
glu        HF gate/up -> ``linear_fc1``; each TP rank holds ``[gate_shard; up_shard]``
vqkv       Qwen2.5-VL vision ``qkv`` ``[(q|k|v), heads, head_dim, ...]`` -> per head
           ``[heads, (q|k|v), head_dim, ...]`` so a TP chunk holds whole heads
=========  ==================================================================================

Expert weights are per expert in HF on-disk layout (``mlp.experts.{e}.gate_proj.weight``), which
is what hub checkpoints and SGLang use (transformers 5 fuses them in memory only).
"""
from __future__ import annotations

import json
import os
import pathlib
import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional, Tuple, Union

import torch

L = r"decoder\.layers\.(?P<L>\d+)\."
HL = "model.layers.{L}."

# (megatron regex, [hf templates], transform)
_COMMON = [
    (r"embedding\.word_embeddings\.weight", ["model.embed_tokens.weight"], "vocab"),
    (r"decoder\.final_layernorm\.weight", ["model.norm.weight"], "copy"),
    (r"output_layer\.weight", ["lm_head.weight"], "vocab"),
    (L + r"input_layernorm\.weight", [HL + "input_layernorm.weight"], "copy"),
    (L + r"self_attention\.linear_qkv\.layer_norm_weight", [HL + "input_layernorm.weight"], "copy"),  # TE
    (L + r"pre_mlp_layernorm\.weight", [HL + "post_attention_layernorm.weight"], "copy"),
    (L + r"mlp\.linear_fc1\.layer_norm_weight", [HL + "post_attention_layernorm.weight"], "copy"),  # TE
    (L + r"self_attention\.linear_proj\.weight", [HL + "self_attn.o_proj.weight"], "copy"),
    # dense MLP
    (L + r"mlp\.linear_fc1\.weight", [HL + "mlp.gate_proj.weight", HL + "mlp.up_proj.weight"], "glu"),
    (L + r"mlp\.linear_fc2\.weight", [HL + "mlp.down_proj.weight"], "copy"),
    # MoE
    (L + r"mlp\.router\.weight", [HL + "mlp.gate.weight"], "copy"),
    (L + r"mlp\.router\.expert_bias", [HL + "mlp.gate.e_score_correction_bias"], "copy"),
    (L + r"mlp\.experts\.local_experts\.(?P<E>\d+)\.linear_fc1\.weight",
     [HL + "mlp.experts.{E}.gate_proj.weight", HL + "mlp.experts.{E}.up_proj.weight"], "glu"),
    (L + r"mlp\.experts\.local_experts\.(?P<E>\d+)\.linear_fc2\.weight",
     [HL + "mlp.experts.{E}.down_proj.weight"], "copy"),
    (L + r"mlp\.shared_experts\.linear_fc1\.weight",
     [HL + "mlp.shared_experts.gate_proj.weight", HL + "mlp.shared_experts.up_proj.weight"], "glu"),
    (L + r"mlp\.shared_experts\.linear_fc2\.weight", [HL + "mlp.shared_experts.down_proj.weight"], "copy"),
]
_GQA = [
    (L + r"self_attention\.linear_qkv\.weight",
     [HL + "self_attn.q_proj.weight", HL + "self_attn.k_proj.weight", HL + "self_attn.v_proj.weight"], "qkv"),
    (L + r"self_attention\.linear_qkv\.bias",
     [HL + "self_attn.q_proj.bias", HL + "self_attn.k_proj.bias", HL + "self_attn.v_proj.bias"], "qkv"),
    (L + r"self_attention\.q_layernorm\.weight", [HL + "self_attn.q_norm.weight"], "copy"),
    (L + r"self_attention\.k_layernorm\.weight", [HL + "self_attn.k_norm.weight"], "copy"),
]
_MLA = [
    (L + r"self_attention\.linear_q_proj\.weight", [HL + "self_attn.q_proj.weight"], "copy"),
    (L + r"self_attention\.linear_q_down_proj\.weight", [HL + "self_attn.q_a_proj.weight"], "copy"),
    (L + r"self_attention\.q_layernorm\.weight", [HL + "self_attn.q_a_layernorm.weight"], "copy"),
    (L + r"self_attention\.linear_q_up_proj\.layer_norm_weight", [HL + "self_attn.q_a_layernorm.weight"], "copy"),
    (L + r"self_attention\.linear_q_up_proj\.weight", [HL + "self_attn.q_b_proj.weight"], "copy"),
    (L + r"self_attention\.linear_kv_down_proj\.weight", [HL + "self_attn.kv_a_proj_with_mqa.weight"], "copy"),
    (L + r"self_attention\.kv_layernorm\.weight", [HL + "self_attn.kv_a_layernorm.weight"], "copy"),
    (L + r"self_attention\.linear_kv_up_proj\.layer_norm_weight", [HL + "self_attn.kv_a_layernorm.weight"], "copy"),
    (L + r"self_attention\.linear_kv_up_proj\.weight", [HL + "self_attn.kv_b_proj.weight"], "copy"),
]
# Qwen2.5-VL vision tower (megarl/models/qwen2_vl_vision.py), Hub layout ``visual.*``
V = r"vision_model\.blocks\.(?P<B>\d+)\."
HV = "visual.blocks.{B}."
_VISION = [
    (r"vision_model\.patch_embed", ["visual.patch_embed.proj.weight"], "copy"),
    (V + r"norm1\.weight", [HV + "norm1.weight"], "copy"),
    (V + r"norm2\.weight", [HV + "norm2.weight"], "copy"),
    (V + r"attn\.qkv\.weight", [HV + "attn.qkv.weight"], "vqkv"),
    (V + r"attn\.qkv\.bias", [HV + "attn.qkv.bias"], "vqkv"),
    (V + r"attn\.proj\.weight", [HV + "attn.proj.weight"], "copy"),
    (V + r"attn\.proj\.bias", [HV + "attn.proj.bias"], "copy"),
    (V + r"mlp\.linear_fc1\.weight", [HV + "mlp.gate_proj.weight", HV + "mlp.up_proj.weight"], "glu"),
    (V + r"mlp\.linear_fc1\.bias", [HV + "mlp.gate_proj.bias", HV + "mlp.up_proj.bias"], "glu"),
    (V + r"mlp\.linear_fc2\.weight", [HV + "mlp.down_proj.weight"], "copy"),
    (V + r"mlp\.linear_fc2\.bias", [HV + "mlp.down_proj.bias"], "copy"),
    (r"vision_model\.merger\.ln_q\.weight", ["visual.merger.ln_q.weight"], "copy"),
    (r"vision_model\.merger\.linear_fc1\.weight", ["visual.merger.mlp.0.weight"], "copy"),
    (r"vision_model\.merger\.linear_fc1\.bias", ["visual.merger.mlp.0.bias"], "copy"),
    (r"vision_model\.merger\.linear_fc2\.weight", ["visual.merger.mlp.2.weight"], "copy"),
    (r"vision_model\.merger\.linear_fc2\.bias", ["visual.merger.mlp.2.bias"], "copy"),
]
RULES: Dict[str, list] = {
    "llama": _COMMON + _GQA,
    "qwen2": _COMMON + _GQA,
    "qwen3": _COMMON + _GQA,
    "qwen3_moe": _COMMON + _GQA,
    "deepseek_v3": _COMMON + _MLA,
    "qwen2_5_vl": _COMMON + _GQA + _VISION,
}
_COMPILED = {fam: [(re.compile(p + r"$"), hf, t) for p, hf, t in rules] for fam, rules in RULES.items()}

VALUE_HEAD_HF_NAME = "score.weight"


@dataclass
class Rule:
    mcore_name: str          # global megatron name
    hf_names: List[str]
    transform: str           # copy | vocab | qkv | glu | vqkv


def hf_rule(global_name: str, family: str, value_head: bool = False) -> Rule:
    """The HF names and transform for one global megatron parameter name (KeyError if unknown)."""
    if value_head and global_name == "output_layer.weight":
        return Rule(global_name, [VALUE_HEAD_HF_NAME], "copy")
    for rx, hfs, t in _COMPILED[family]:
        m = rx.match(global_name)
        if m:
            return Rule(global_name, [h.format(**m.groupdict()) for h in hfs], t)
    raise KeyError(f"no HF naming rule for megatron parameter {global_name!r} (family {family})")


# ---------------------------------------------------------------------------------------------
# transforms between HF tensors and the megatron full (TP-merged) tensor
# ---------------------------------------------------------------------------------------------

def _gqa_dims(cfg):
    from .config import head_dim
    cfg = getattr(cfg, "text_config", None) or cfg   # multimodal configs: the decoder's fields
    nh = cfg.num_attention_heads
    ng = getattr(cfg, "num_key_value_heads", None) or nh
    return nh, ng, head_dim(cfg)


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg) -> torch.Tensor:
    """HF q/k/v (weight [out, in] or bias [out]) -> megatron interleaved ``linear_qkv``."""
    nh, ng, hd = _gqa_dims(cfg)
    rest = q.shape[1:]
    qg = q.reshape(ng, nh // ng, hd, *rest)
    kg = k.reshape(ng, 1, hd, *rest)
    vg = v.reshape(ng, 1, hd, *rest)
    return torch.cat([qg, kg, vg], dim=1).reshape(ng * (nh // ng + 2) * hd, *rest)


def split_qkv(qkv: torch.Tensor, cfg) -> List[torch.Tensor]:
    nh, ng, hd = _gqa_dims(cfg)
    rest = qkv.shape[1:]
    g = qkv.reshape(ng, nh // ng + 2, hd, *rest)
    q = g[:, : nh // ng].reshape(nh * hd, *rest)
    k = g[:, nh // ng].reshape(ng * hd, *rest)
    v = g[:, nh // ng + 1].reshape(ng * hd, *rest)
    return [q.contiguous(), k.contiguous(), v.contiguous()]


def _vision_heads(cfg) -> tuple:
    v = cfg.vision_config
    return v.num_heads, v.hidden_size // v.num_heads


def vision_qkv_to_heads(qkv: torch.Tensor, cfg) -> torch.Tensor:
    """HF vision ``qkv`` ``[(q|k|v), heads, hd, ...]`` -> megarl's ``[heads, (q|k|v), hd, ...]``."""
    nh, hd = _vision_heads(cfg)
    rest = qkv.shape[1:]
    return qkv.reshape(3, nh, hd, *rest).transpose(0, 1).reshape(3 * nh * hd, *rest).contiguous()


def vision_qkv_from_heads(qkv: torch.Tensor, cfg) -> torch.Tensor:
    nh, hd = _vision_heads(cfg)
    rest = qkv.shape[1:]
    return qkv.reshape(nh, 3, hd, *rest).transpose(0, 1).reshape(3 * nh * hd, *rest).contiguous()


def hf_to_local(rule: Rule, hf: List[torch.Tensor], cfg, *, tp_rank: int, tp_size: int,
                partition_dim: Optional[int], local_shape) -> torch.Tensor:
    """HF tensors -> this TP rank's shard of the megatron parameter."""
    t = rule.transform
    if t == "glu":
        gate, up = hf
        if partition_dim is None:
            return torch.cat([gate, up], 0)
        return torch.cat([gate.chunk(tp_size, 0)[tp_rank], up.chunk(tp_size, 0)[tp_rank]], 0)
    if t == "qkv":
        full = fuse_qkv(*hf, cfg)
    elif t == "vqkv":
        full = vision_qkv_to_heads(hf[0], cfg)
    else:
        (full,) = hf
    if t == "vocab":
        padded = local_shape[0] * (tp_size if partition_dim == 0 else 1)
        if full.shape[0] < padded:
            pad = full.new_zeros((padded - full.shape[0],) + tuple(full.shape[1:]))
            full = torch.cat([full, pad], 0)
    if partition_dim is None:
        return full
    return full.chunk(tp_size, partition_dim)[tp_rank]


def local_to_hf(rule: Rule, shards: List[torch.Tensor], cfg, *, partition_dim: Optional[int],
                vocab_size: Optional[int] = None) -> List[torch.Tensor]:
    """All TP shards (in TP-rank order) of one megatron parameter -> HF tensors (rule.hf_names)."""
    t = rule.transform
    if t == "glu":
        gates, ups = zip(*[s.chunk(2, 0) for s in shards]) if partition_dim is not None else [
            [shards[0].chunk(2, 0)[0]], [shards[0].chunk(2, 0)[1]]]
        return [torch.cat(gates, 0).contiguous(), torch.cat(ups, 0).contiguous()]
    full = torch.cat(shards, partition_dim) if partition_dim is not None else shards[0]
    if t == "qkv":
        return split_qkv(full, cfg)
    if t == "vqkv":
        return [vision_qkv_from_heads(full, cfg)]
    if t == "vocab" and vocab_size is not None:
        full = full[:vocab_size]
    return [full.contiguous()]


# ---------------------------------------------------------------------------------------------
# walking a model's parameters
# ---------------------------------------------------------------------------------------------

_LAYER_RX = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT_RX = re.compile(r"\.local_experts\.(\d+)\.")


@dataclass
class ParamInfo:
    local_name: str
    global_name: str
    tensor: torch.Tensor
    is_expert: bool
    partition_dim: Optional[int]
    rule: Rule


def _named_tensors(chunk):
    from .lora import is_adapter_param

    for n, p in chunk.named_parameters():
        if is_adapter_param(n):   # LoRA adapters have no HF name: they are merged into their layer's weight
            continue
        yield n, p
    for n, b in chunk.named_buffers():
        if n.endswith("router.expert_bias"):
            yield n, b


def param_infos(chunk) -> List[ParamInfo]:
    """Every weight of a chunk with its global name, HF rule and TP partitioning."""
    from megatron.core import parallel_state as mpu

    layers = chunk.decoder.layers if hasattr(chunk, "decoder") else []
    out = []
    for name, p in _named_tensors(chunk):
        g = name
        m = _LAYER_RX.match(name)
        if m:
            j = int(m.group(1))
            g = f"decoder.layers.{layers[j].layer_number - 1}." + name[m.end():]
        is_expert = ".local_experts." in name
        if is_expert:
            mlp = layers[int(m.group(1))].mlp
            em = _EXPERT_RX.search(g)
            ge = mlp.local_expert_indices[int(em.group(1))]
            g = g[: em.start()] + f".local_experts.{ge}." + g[em.end():]
        pdim = getattr(p, "partition_dim", None) if getattr(p, "tensor_model_parallel", False) else None
        tp = (mpu.get_expert_tensor_parallel_world_size() if is_expert
              else mpu.get_tensor_model_parallel_world_size())
        if tp == 1:
            pdim = None
        rule = hf_rule(g, chunk.family, value_head=getattr(chunk, "value_head", False) and g == "output_layer.weight")
        out.append(ParamInfo(name, g, p, is_expert, pdim, rule))
    return out


def is_tied(chunk) -> bool:
    return bool(getattr(chunk, "share_embeddings_and_output_weights", False))


def _hf_names_to_load(info: ParamInfo, chunk) -> List[str]:
    if info.global_name == "output_layer.weight" and is_tied(chunk):
        return ["model.embed_tokens.weight"]
    return info.rule.hf_names


# ---------------------------------------------------------------------------------------------
# HF safetensors source
# ---------------------------------------------------------------------------------------------

# (prefix as transformers 5 names it in memory, prefix on the Hub / in save_pretrained output)
_MEMORY_TO_HUB = (("model.language_model.", "model."), ("model.visual.", "visual."))


class SafetensorsSource:
    """Lazy reader over an HF folder's safetensors (index-aware), one file open at a time."""

    def __init__(self, hf_dir):
        self.dir = pathlib.Path(hf_dir)
        idx = self.dir / "model.safetensors.index.json"
        self.weight_map: Dict[str, str] = {}
        if idx.exists():
            with open(idx) as f:
                self.weight_map = dict(json.load(f)["weight_map"])
        else:
            from safetensors import safe_open
            files = sorted(self.dir.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"no *.safetensors in {self.dir}")
            for fn in files:
                with safe_open(str(fn), "pt") as f:
                    for k in f.keys():
                        self.weight_map[k] = fn.name
        # transformers 5 in-memory names of multimodal models -> the Hub layout the rules use
        self.stored: Dict[str, str] = {}
        for k in list(self.weight_map):
            for mem, hub in _MEMORY_TO_HUB:
                if k.startswith(mem):
                    alias = hub + k[len(mem):]
                    if alias not in self.weight_map:
                        self.weight_map[alias] = self.weight_map.pop(k)
                        self.stored[alias] = k
                    break

    def names(self) -> List[str]:
        return sorted(self.weight_map)

    def by_file(self, names) -> Dict[str, List[str]]:
        out = defaultdict(list)
        for n in names:
            if n not in self.weight_map:
                raise KeyError(f"HF checkpoint {self.dir} has no tensor {n!r}")
            out[self.weight_map[n]].append(n)
        return dict(sorted(out.items()))

    def read(self, names) -> Iterator[Tuple[str, torch.Tensor]]:
        from safetensors import safe_open
        for fn, ns in self.by_file(names).items():
            with safe_open(str(self.dir / fn), "pt") as f:
                for n in ns:
                    yield n, f.get_tensor(self.stored.get(n, n))


def load_hf_weights(chunks, source: Union[str, os.PathLike, Callable[[str], torch.Tensor], SafetensorsSource],
                    *, strict: bool = True, progress: bool = False) -> List[str]:
    """Load this rank's shards of the HF weights into megatron ``chunks``.

    ``source`` is an HF folder (safetensors, streamed file by file; only the tensors this rank
    needs are read), a ``SafetensorsSource`` or a getter ``name -> tensor``. Returns the HF names
    consumed by this rank. A parameter whose HF tensor is missing raises ``KeyError`` naming it
    (critic ``score.weight`` may be absent: the value head keeps its init).
    """
    from megatron.core import parallel_state as mpu

    chunks = list(chunks) if isinstance(chunks, (list, tuple)) else [chunks]
    plan = []  # (chunk, info, hf names)
    for c in chunks:
        for info in param_infos(c):
            plan.append((c, info, _hf_names_to_load(info, c)))
    needed = sorted({n for _, _, ns in plan for n in ns})
    if callable(source) and not isinstance(source, SafetensorsSource):
        getter = source
        avail = None
    else:
        src = source if isinstance(source, SafetensorsSource) else SafetensorsSource(source)
        getter = None
        avail = set(src.weight_map)
    optional = {VALUE_HEAD_HF_NAME}
    if avail is not None:
        missing = [n for n in needed if n not in avail and n not in optional]
        if missing:
            raise KeyError(f"HF checkpoint is missing tensor(s) needed by megatron: {missing[:10]}"
                           + (f" (+{len(missing) - 10} more)" if len(missing) > 10 else ""))
        needed = [n for n in needed if n in avail]
    # group params by the HF names they need; fill each as soon as all its inputs are read
    pending: Dict[int, dict] = {}
    waiting = defaultdict(list)
    for i, (_, _, ns) in enumerate(plan):
        for n in ns:
            waiting[n].append(i)
    consumed = []

    def assign(i, got):
        c, info, ns = plan[i]
        tp_rank = (mpu.get_expert_tensor_parallel_rank() if info.is_expert
                   else mpu.get_tensor_model_parallel_rank())
        tp_size = (mpu.get_expert_tensor_parallel_world_size() if info.is_expert
                   else mpu.get_tensor_model_parallel_world_size())
        rule = info.rule
        if ns != rule.hf_names:  # tied output layer loads the embedding
            rule = Rule(rule.mcore_name, ns, rule.transform)
        local = hf_to_local(rule, [got[n] for n in ns], c.hf_config, tp_rank=tp_rank,
                            tp_size=tp_size, partition_dim=info.partition_dim,
                            local_shape=tuple(info.tensor.shape))
        if tuple(local.shape) != tuple(info.tensor.shape):
            raise ValueError(f"shape mismatch for {info.global_name} <- {ns}: HF gives "
                             f"{tuple(local.shape)}, megatron expects {tuple(info.tensor.shape)}")
        with torch.no_grad():
            info.tensor.data.copy_(local.to(info.tensor.dtype))

    def feed(name, tensor):
        consumed.append(name)
        for i in waiting.get(name, []):
            d = pending.setdefault(i, {})
            d[name] = tensor
            if len(d) == len(plan[i][2]):
                assign(i, pending.pop(i))

    if getter is not None:
        for n in needed:
            try:
                t = getter(n)
            except KeyError:
                if n in optional:
                    continue
                raise
            feed(n, t)
    else:
        files = src.by_file(needed)
        for i, (fn, ns) in enumerate(files.items()):
            if progress:
                print(f"[megarl.convert] reading {fn} ({i + 1}/{len(files)}): {len(ns)} tensors",
                      flush=True)
            for n, t in src.read(ns):
                feed(n, t)
    unfilled = [plan[i][1].global_name for i in pending]
    if unfilled and strict:
        raise KeyError(f"megatron parameters not filled from HF: {unfilled}")
    return sorted(set(consumed))


# ---------------------------------------------------------------------------------------------
# THE sync contract
# ---------------------------------------------------------------------------------------------

def iter_hf_weights(chunks, hf_config=None, *, yield_on_all_ranks: bool = False, only: Optional[str] = None
                    ) -> Iterator[Tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, full_tensor)`` for the parameters this rank's PP stage / EP rank owns.

    Tensors are full HF tensors: TP shards all-gathered (expert params over the expert-TP group),
    qkv and gate/up un-fused, vocab padding removed, experts under their global index. Which
    ranks yield what (no duplicates across the world):

    * dense (non-expert) params of a PP stage: the rank with ``tp_rank == 0`` and
      ``dp_rank == 0`` (``cp_rank == 0``) of that stage;
    * expert params: the rank with ``expert_tp_rank == 0`` and ``expert_dp_rank == 0`` of each
      EP rank (each EP rank yields its own experts);
    * tied models: ``model.embed_tokens.weight`` once, from the first stage (the last stage's
      output-layer copy is not yielded); critics yield ``score.weight`` from the last stage.

    Collectives: every rank of a TP / expert-TP group must iterate (they all-gather in lockstep,
    one parameter at a time, so peak extra memory is one full parameter). Ranks with dp_rank > 0
    (expert_dp_rank > 0 for experts) do no communication for those params. Order is the
    chunk's ``named_parameters`` order (deterministic). ``yield_on_all_ranks=True`` makes every
    rank of the TP group yield (used for checksums / tests). ``only="dense"`` / ``only="experts"``
    walks one kind of parameter (``megarl.sync.stage`` streams a stage's dense weights first, then
    gathers the expert-parallel ranks' experts to the stage's sender).
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    from .lora import effective_weight

    if only not in (None, "dense", "experts"):
        raise ValueError(f"only must be None, 'dense' or 'experts', got {only!r}")
    chunks = list(chunks) if isinstance(chunks, (list, tuple)) else [chunks]
    dp_rank = mpu.get_data_parallel_rank(with_context_parallel=True)
    edp_rank = mpu.get_expert_data_parallel_rank()
    for c in chunks:
        from .builder import unwrap
        c = unwrap(c)
        cfg = c.hf_config
        for info in param_infos(c):
            if info.global_name == "output_layer.weight" and is_tied(c):
                continue
            if only is not None and info.is_expert != (only == "experts"):
                continue
            if info.is_expert:
                if edp_rank != 0 and not yield_on_all_ranks:
                    continue
                group = mpu.get_expert_tensor_parallel_group()
                rank = mpu.get_expert_tensor_parallel_rank()
            else:
                if dp_rank != 0 and not yield_on_all_ranks:
                    continue
                group = mpu.get_tensor_model_parallel_group()
                rank = mpu.get_tensor_model_parallel_rank()
            t = effective_weight(info.tensor)   # LoRA: W + scaling * B A
            if info.partition_dim is not None:
                shards = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
                dist.all_gather(shards, t.contiguous(), group=group)
            else:
                shards = [t]
            if rank != 0 and not yield_on_all_ranks:
                continue
            tensors = local_to_hf(info.rule, shards, cfg, partition_dim=info.partition_dim,
                                  vocab_size=getattr(c, "vocab_size", None) or cfg.vocab_size)
            for n, x in zip(info.rule.hf_names, tensors):
                yield n, x
