"""Build megatron-core GPT models (actor / critic) from an HF config, and run their forward."""
from __future__ import annotations

from typing import List, Optional

import torch
from torch import nn

from .config import detect_family, load_hf_config, rope_params, transformer_config_from_hf


def _has_te() -> bool:
    try:
        import transformer_engine  # noqa: F401
        return True
    except Exception:
        return False


def _fix_mla_without_te():
    """megatron-core 0.16.1: without TE, ``multi_latent_attention.HAVE_TE`` is True because the TE
    extension module imports with MagicMock stand-ins, and ``isinstance(x, TELinear)`` then raises.
    Applies on CPU and GPU alike (the GPU box has no TE either)."""
    if _has_te():
        return
    from megatron.core.transformer import multi_latent_attention as mla
    mla.HAVE_TE = False


def layer_block_spec(config, vp_stage: Optional[int] = None, attention_backend: str = "sdpa"):
    """Decoder block spec: megatron's local modules with the core attention replaced by
    :class:`SDPAttention` (``attention_backend="sdpa"``), or megatron's Transformer Engine spec
    unchanged (``"te"``, needs TE installed)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    if attention_backend == "te":
        if not _has_te():
            raise RuntimeError("attention_backend='te' needs transformer_engine installed")
        return get_gpt_decoder_block_spec(config, use_transformer_engine=True,
                                          normalization="RMSNorm", vp_stage=vp_stage)
    from .attention import SDPAttention
    from .fusions import fusions_enabled, install_rope_fusion, use_compiled_norms
    from .packed import install_thd_rope

    if getattr(config, "multi_latent_attention", False):
        _fix_mla_without_te()
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False,
                                      normalization="RMSNorm", vp_stage=vp_stage)
    for layer_spec in spec.layer_specs:
        layer_spec.submodules.self_attention.submodules.core_attention = SDPAttention
    if fusions_enabled():
        use_compiled_norms(spec)
        install_rope_fusion()
    install_thd_rope()  # packed (THD) micro-batches: per-sequence RoPE positions without a host sync
    return spec


class ValueHead(nn.Module):
    """Scalar head replacing ``output_layer`` for critics (replicated over TP).

    Called like megatron's output layer: ``(hidden, weight=None, runtime_gather_output=None)``
    -> ``(values [s, b, 1], None)``. HF name ``score.weight`` (as in
    ``AutoModelForTokenClassification(num_labels=1)``).
    """

    def __init__(self, hidden_size: int, dtype=torch.float32):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1, hidden_size, dtype=dtype))

    def forward(self, hidden_states, weight=None, runtime_gather_output=None):
        return torch.nn.functional.linear(hidden_states, self.weight), None

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint
        return make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True),
                                                   prefix, {}, sharded_offsets)


def padded_vocab_size(vocab_size: int, tp: int, multiple: int = 1) -> int:
    m = tp * multiple
    return ((vocab_size + m - 1) // m) * m


def build_model(hf_config, *, value_head: bool = False, params_dtype: torch.dtype = torch.float32,
                vpp: Optional[int] = None, attention_backend: str = "sdpa",
                perform_initialization: bool = True, fp32_lm_head: bool = False,
                **config_overrides) -> List[nn.Module]:
    """Megatron model chunks (one per virtual pipeline stage) for this rank.

    Uses the current ``parallel_state`` (call ``megarl.parallel.init_model_parallel`` first).
    Each chunk is a ``GPTModel`` with attributes ``hf_config``, ``family``, ``vocab_size``
    (unpadded) and ``value_head``. Vocab is padded to a multiple of tp (padding rows are zeros
    and never exported). For critics the output layer is a :class:`ValueHead`. ``fp32_lm_head``:
    the output projection runs in fp32 (``models/fp32_head.py``). MoE routers get megarl's
    :class:`~megarl.models.routing_replay.RouterHook` (HF-exact group routing, routing replay).
    """
    from megatron.core import parallel_state as mpu
    from megatron.core.models.gpt.gpt_model import GPTModel

    cfg = load_hf_config(hf_config)
    family = detect_family(cfg)
    if family == "qwen2_5_vl":
        if value_head or (vpp and vpp > 1) or fp32_lm_head:
            raise NotImplementedError("qwen2_5_vl: value head, virtual pipeline and fp32 lm head are not built yet")
        from .qwen2_vl import build_qwen2_vl

        return build_qwen2_vl(cfg, params_dtype=params_dtype, attention_backend=attention_backend,
                              perform_initialization=perform_initialization, **config_overrides)
    tp = mpu.get_tensor_model_parallel_world_size()
    pp = mpu.get_pipeline_model_parallel_world_size()
    vpp = vpp or mpu.get_virtual_pipeline_model_parallel_world_size()
    tconf = transformer_config_from_hf(
        cfg, tp=tp, pp=pp, ep=mpu.get_expert_model_parallel_world_size(),
        etp=mpu.get_expert_tensor_parallel_world_size(), vpp=vpp if (vpp and vpp > 1) else None,
        cp=mpu.get_context_parallel_world_size(),
        params_dtype=params_dtype, perform_initialization=perform_initialization,
        **config_overrides)
    rp = rope_params(cfg)
    tied = bool(getattr(cfg, "tie_word_embeddings", False)) and not value_head
    chunks = []
    nchunks = vpp if (vpp and vpp > 1) else 1
    for i in range(nchunks):
        vp_stage = i if nchunks > 1 else None
        pre = mpu.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
        post = mpu.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
        spec = layer_block_spec(tconf, vp_stage=vp_stage, attention_backend=attention_backend)
        model = GPTModel(
            config=tconf,
            transformer_layer_spec=spec,
            vocab_size=padded_vocab_size(cfg.vocab_size, tp),
            max_sequence_length=int(getattr(cfg, "max_position_embeddings", 4096)),
            pre_process=pre,
            post_process=post,
            parallel_output=True,
            share_embeddings_and_output_weights=tied,
            position_embedding_type="rope" if family != "deepseek_v3" else "none",
            rotary_base=int(rp.get("rope_theta", 10000)),
            vp_stage=vp_stage,
        )
        if family != "deepseek_v3":
            _set_hf_inv_freq(model, cfg)
        _ensure_tp_attributes(model)
        if value_head and post:
            model.output_layer = ValueHead(cfg.hidden_size, dtype=params_dtype)
        elif fp32_lm_head and post:
            from .fp32_head import use_fp32_output_layer

            use_fp32_output_layer(model)
        if tconf.num_moe_experts:
            from .config import renormalized_top1
            from .routing_replay import install_router_hooks

            install_router_hooks(model, renormalize=renormalized_top1(cfg))
        model.hf_config = cfg
        model.family = family
        model.vocab_size = cfg.vocab_size
        model.value_head = value_head
        model.vp_stage = vp_stage
        chunks.append(model)
    return chunks


def _ensure_tp_attributes(model):
    """megatron only sets ``tensor_model_parallel/partition_dim`` on weights inside its init
    routines; with ``perform_initialization=False`` (conversion) set them from the layer type."""
    from megatron.core.tensor_parallel.layers import (ColumnParallelLinear, RowParallelLinear,
                                                      VocabParallelEmbedding,
                                                      set_tensor_model_parallel_attributes)
    for m in model.modules():
        w = getattr(m, "weight", None)
        if not isinstance(w, torch.nn.Parameter) or hasattr(w, "tensor_model_parallel"):
            continue
        if isinstance(m, (VocabParallelEmbedding, ColumnParallelLinear)):
            set_tensor_model_parallel_attributes(w, True, 0, 1)
        elif isinstance(m, RowParallelLinear):
            set_tensor_model_parallel_attributes(w, True, 1, 1)


def _set_hf_inv_freq(model, cfg):
    """Use transformers' own RoPE init (default, llama3, linear, dynamic...) so the frequencies are
    exactly HF's; megatron's built-in llama3 scaling hard-codes low/high-freq factors."""
    rot = getattr(model, "rotary_pos_emb", None)
    if rot is None:
        return
    rp = rope_params(cfg)
    rtype = rp.get("rope_type", "default")
    if rtype == "default":
        base = float(rp.get("rope_theta", 10000.0))
        dim = rot.inv_freq.numel() * 2
        inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    else:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
        inv, attn_factor = ROPE_INIT_FUNCTIONS[rtype](cfg, "cpu")
        if abs(float(attn_factor) - 1.0) > 1e-12:
            raise ValueError(f"rope_type {rtype!r} with attention scaling {attn_factor} is unsupported")
    rot.inv_freq = inv.to(device=rot.inv_freq.device, dtype=rot.inv_freq.dtype)


def unwrap(model):
    while hasattr(model, "module") and not hasattr(model, "decoder"):
        model = model.module
    return model


def built_layers(chunks) -> list[list[int]]:
    """Global layer indices megatron built in each model chunk (virtual stage) of this rank: the
    runtime's side of the pipeline split that validation and the plan assume."""
    return [[int(layer.layer_number) - 1 for layer in unwrap(c).decoder.layers] for c in chunks]


def forward_logits(chunks, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None,
                   attention_mask: Optional[torch.Tensor] = None, packed_seq_params=None) -> Optional[torch.Tensor]:
    """Forward only. Returns ``[b, s, vocab]`` logits (TP-gathered, vocab padding removed; for a
    critic ``[b, s]`` values) on the last pipeline stage and ``None`` on other stages.

    With one stage it calls the model directly; with pp > 1 (or vpp) it runs megatron's
    ``get_forward_backward_func()`` with ``forward_only=True, collect_non_loss_data=True`` and
    one micro-batch, so activations travel between stages through megatron's p2p schedule.
    Every rank of the model-parallel group must call it with the same ``input_ids``.
    ``attention_mask``: bool, True = masked, broadcastable to [b, 1, s, s] (None = causal).
    ``packed_seq_params``: sequences packed into ``input_ids [1, T]`` (see
    :func:`megarl.models.packed.pack_sequences`); logits are then ``[1, T, vocab]``.
    """

    chunks = [unwrap(c) for c in (chunks if isinstance(chunks, (list, tuple)) else [chunks])]
    modes = [c.training for c in chunks]
    for c in chunks:
        c.eval()  # megatron refuses MoE+TP without sequence parallel in training mode
    try:
        return _forward_logits(chunks, input_ids, position_ids, attention_mask, packed_seq_params)
    finally:
        for c, m in zip(chunks, modes):
            c.train(m)


def _forward_logits(chunks, input_ids, position_ids, attention_mask, packed_seq_params=None):
    from megatron.core import parallel_state as mpu
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    b, s = input_ids.shape
    if position_ids is None:
        position_ids = torch.arange(s, device=input_ids.device).unsqueeze(0).expand(b, s)
    head = chunks[-1]
    vocab = head.vocab_size

    def post(out):
        if head.value_head:
            return out[..., 0]
        out = gather_from_tensor_model_parallel_region(out)
        return out[..., :vocab]

    if len(chunks) == 1 and mpu.get_pipeline_model_parallel_world_size() == 1:
        with torch.no_grad():
            out = chunks[0](input_ids, position_ids, attention_mask, packed_seq_params=packed_seq_params)
        return post(out)

    def step(data_iter, model):
        batch = next(data_iter)
        out = model(batch["input_ids"], batch["position_ids"], batch["attention_mask"],
                    packed_seq_params=packed_seq_params)

        def collect(output_tensor, non_loss_data=True):
            return post(output_tensor)
        return out, collect

    # interleaved (vpp) schedules need >= pp micro-batches: split the batch when it divides,
    # else run the whole batch pp times and keep the first result.
    m = mpu.get_pipeline_model_parallel_world_size() if len(chunks) > 1 else 1
    if m > 1 and b % m == 0 and packed_seq_params is None:
        mbs, reps = b // m, None
        batches = [{"input_ids": input_ids[i * mbs:(i + 1) * mbs],
                    "position_ids": position_ids[i * mbs:(i + 1) * mbs],
                    "attention_mask": None if attention_mask is None else
                    attention_mask[i * mbs:(i + 1) * mbs]} for i in range(m)]
    else:
        mbs, reps = b, m
        batches = [{"input_ids": input_ids, "position_ids": position_ids,
                    "attention_mask": attention_mask}] * m
    data = [iter(list(batches)) for _ in chunks]
    fb = get_forward_backward_func()
    with torch.no_grad():
        res = fb(forward_step_func=step, data_iterator=data if len(chunks) > 1 else data[0],
                 model=chunks if len(chunks) > 1 else chunks[0], num_microbatches=m,
                 seq_length=s, micro_batch_size=mbs, forward_only=True, collect_non_loss_data=True)
    if mpu.is_pipeline_last_stage(ignore_virtual=True):
        return res[0] if (reps or len(res) == 1) else torch.cat(res, 0)
    return None
