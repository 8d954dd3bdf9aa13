"""Parameter counts of a model from ``model.arch``, whole and per pipeline stage / GPU.

Counted: embedding, output layer (unless tied), per layer two RMSNorms, attention (GQA/MHA
q/k/v/o projections, or DeepSeek MLA with its down/up projections and latent norms), SwiGLU MLP
(gate, up, down: 3 * hidden * ffn), MoE layers (router, routed experts, shared experts), final
norm. Not counted: biases (Qwen2's qkv bias, < 0.01 %), Qwen3's per-head q/k norms (2*head_dim per
layer), DeepSeek-V3's multi-token-prediction module (not trained in RL, as in verl and NeMo-RL).

MLA head widths are not in ``model.arch``: DeepSeek-V2/V3/R1 and Kimi-K2 all use
qk_nope_head_dim = 128, qk_rope_head_dim = 64, v_head_dim = 128, which are used here.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from megarl.config.schema import ModelArch, ParallelConfig

MLA_QK_NOPE = 128
MLA_QK_ROPE = 64
MLA_V = 128


def head_dim(arch: ModelArch) -> int:
    return arch.head_dim or arch.hidden_size // max(arch.num_attention_heads, 1)


def is_mla(arch: ModelArch) -> bool:
    return arch.kv_lora_rank > 0


@dataclass
class LayerParams:
    """Parameters of one transformer layer, split by how they shard."""

    attention: int = 0       # sharded over TP (heads)
    mlp: int = 0             # dense MLP or shared experts: sharded over TP
    experts: int = 0         # all routed experts of the layer: sharded over EP * ETP
    replicated: int = 0      # norms, router, MLA latent norms: on every TP rank

    @property
    def total(self) -> int:
        return self.attention + self.mlp + self.experts + self.replicated


def attention_params(arch: ModelArch) -> tuple[int, int]:
    """(TP-sharded, replicated) attention parameters of one layer."""
    h, nh = arch.hidden_size, arch.num_attention_heads
    if is_mla(arch):
        qk = MLA_QK_NOPE + MLA_QK_ROPE
        if arch.q_lora_rank:
            q = h * arch.q_lora_rank + arch.q_lora_rank * nh * qk      # q_a_proj, q_b_proj
            norms = arch.q_lora_rank                                   # q_a_layernorm
        else:
            q, norms = h * nh * qk, 0
        kv = h * (arch.kv_lora_rank + MLA_QK_ROPE) + arch.kv_lora_rank * nh * (MLA_QK_NOPE + MLA_V)
        o = nh * MLA_V * h
        return q + kv + o, norms + arch.kv_lora_rank                   # + kv_a_layernorm
    hd = head_dim(arch)
    q = h * nh * hd
    kv = 2 * h * arch.num_kv_heads * hd
    o = nh * hd * h
    return q + kv + o, 0


def layer_params(arch: ModelArch, index: int) -> LayerParams:
    h = arch.hidden_size
    attn, attn_rep = attention_params(arch)
    lp = LayerParams(attention=attn, replicated=2 * h + attn_rep)     # input + post-attention norms
    if is_moe_layer(arch, index):
        lp.experts = arch.num_experts * 3 * h * arch.moe_ffn_hidden_size
        lp.mlp = arch.num_shared_experts * 3 * h * arch.moe_ffn_hidden_size
        lp.replicated += arch.num_experts * h                           # router
    else:
        lp.mlp = 3 * h * arch.ffn_hidden_size
    return lp


def is_moe_layer(arch: ModelArch, index: int) -> bool:
    return arch.num_experts > 0 and index >= arch.first_k_dense


@dataclass
class ModelParams:
    embedding: int
    output: int              # 0 when tied to the embedding
    final_norm: int
    layers: list[LayerParams] = field(default_factory=list)

    @property
    def total(self) -> int:
        return self.embedding + self.output + self.final_norm + sum(l.total for l in self.layers)

    def active(self, arch: ModelArch) -> int:
        """Parameters one token goes through (top-k of the routed experts)."""
        total = self.total
        if arch.num_experts:
            routed = sum(l.experts for l in self.layers)
            total -= routed - routed * arch.moe_top_k // arch.num_experts
        return total

    largest_tensor: int = 0  # elements of the largest single HF tensor (a sync bucket holds it whole)


def model_params(arch: ModelArch, value_head: bool = False) -> ModelParams:
    """``value_head``: critic / reward model, whose output layer is hidden -> 1."""
    h = arch.hidden_size
    emb = arch.vocab_size * h
    if value_head:
        out = h
    else:
        out = 0 if arch.tie_word_embeddings else arch.vocab_size * h
    mp = ModelParams(embedding=emb, output=out, final_norm=h,
                     layers=[layer_params(arch, i) for i in range(arch.num_layers)])
    ffn = max(arch.ffn_hidden_size, arch.moe_ffn_hidden_size * max(arch.num_shared_experts, 1))
    hd = head_dim(arch)
    q_width = arch.num_attention_heads * (MLA_QK_NOPE + MLA_QK_ROPE if is_mla(arch) else hd)
    mp.largest_tensor = max(emb, h * ffn, h * q_width, arch.num_experts * h)
    return mp


def stage_counts(num_layers: int, p: ParallelConfig) -> list[int]:
    """Layers on each pipeline rank, as megatron-core splits them: ``first_stage_layers`` /
    ``last_stage_layers`` when set (megatron's ``num_layers_in_first/last_pipeline_stage``), the rest
    evenly over the middle ranks (validation refuses a split megatron would not build)."""
    if p.pp <= 1:
        return [num_layers]
    first, last = p.first_stage_layers, p.last_stage_layers
    middle = p.pp - bool(first) - bool(last)
    per = (num_layers - first - last) // middle if middle else 0
    return [first or per] + [per] * (p.pp - 2) + [last or per]


def stage_chunks(num_layers: int, p: ParallelConfig) -> list[list[range]]:
    """Global layer indices of each pipeline rank's model chunks (one per virtual stage).

    Megatron's interleaved order (``transformer_layer.get_transformer_layer_offset``): virtual
    stage v of every rank comes before virtual stage v + 1 of any, so chunk v of rank r starts at
    ``v * (layers of one chunk of every rank) + (chunk sizes of the ranks before r)``.
    ``tests/test_pipeline_layout.py`` holds this to megatron's own functions for every recipe."""
    vpp = max(p.vpp, 1) if p.pp > 1 else 1
    chunk = [c // vpp for c in stage_counts(num_layers, p)]
    per_round = sum(chunk)
    return [[range(v * per_round + sum(chunk[:r]), v * per_round + sum(chunk[:r]) + chunk[r]) for v in range(vpp)]
            for r in range(len(chunk))]


def stage_layers(num_layers: int, p: ParallelConfig) -> list[list[int]]:
    """Global layer indices held by each pipeline rank (all its virtual chunks), in order."""
    return [[i for c in chunks for i in c] for chunks in stage_chunks(num_layers, p)]


@dataclass
class StageShard:
    """Parameters one GPU holds for pipeline stage ``stage`` under a role's layout."""

    stage: int
    layers: list[int]           # global layer indices on this pipeline rank (every virtual chunk)
    moe_layers: int
    dense: int               # parameters reduced over the data-parallel group
    expert: int              # routed-expert parameters, reduced over the expert-data-parallel group

    @property
    def total(self) -> int:
        return self.dense + self.expert


def stage_shards(arch: ModelArch, mp: ModelParams, p: ParallelConfig) -> list[StageShard]:
    out = []
    stages = stage_layers(arch.num_layers, p)
    for s, layers in enumerate(stages):
        dense = expert = 0
        for i in layers:
            lp = mp.layers[i]
            dense += (lp.attention + lp.mlp) // p.tp + lp.replicated
            expert += lp.experts // (p.ep * p.etp)
        if s == 0:
            dense += mp.embedding // p.tp
        if s == len(stages) - 1:
            # Tied embeddings with pp > 1: the last stage keeps its own copy of the matrix
            # (megatron's shared embedding, kept in sync by an all-reduce).
            tied_copy = mp.embedding if (mp.output == 0 and len(stages) > 1) else 0
            out_params = mp.output if mp.output > arch.hidden_size else 0
            dense += (out_params + tied_copy) // p.tp + mp.final_norm + (mp.output if mp.output == arch.hidden_size else 0)
        out.append(StageShard(stage=s, layers=layers,
                              moe_layers=sum(1 for i in layers if is_moe_layer(arch, i)),
                              dense=dense, expert=expert))
    return out
