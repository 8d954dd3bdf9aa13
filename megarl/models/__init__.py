"""Megatron-Core models from HF configs, naming rules megatron <-> HF, and the sync contract.

Public API (others depend on these names):

- ``detect_family(hf_config) -> str``: 'llama' | 'qwen2' | 'qwen3' | 'qwen3_moe' | 'deepseek_v3' |
  'qwen2_5_vl' (vision-language: ``build_model`` returns a
  :class:`~megarl.models.qwen2_vl.Qwen2VLModel`, a ``GPTModel`` with M-RoPE and a vision tower that
  takes ``pixel_values`` / ``image_grid_thw``; RL runs refuse it for now, see ``hf_audit``).
  ``hf_config`` may be a transformers config, a dict, a config.json path or an HF folder.
- ``transformer_config_from_hf(hf_config, *, tp, pp, ep, etp, vpp, params_dtype, ...)``
  -> megatron ``TransformerConfig`` (``MLATransformerConfig`` for DeepSeek-V3).
- ``build_model(hf_config, *, value_head=False, params_dtype=torch.float32, vpp=None,
  attention_backend='sdpa') -> list[GPTModel]``: this rank's model chunks under the current
  megatron ``parallel_state``; megatron's local layer spec with SDPA core attention
  (``attention_backend='te'`` = megatron's Transformer Engine spec when TE is installed).
  ``value_head=True`` builds a critic: same trunk, :class:`ValueHead` (HF name ``score.weight``).
  The model's context-parallel size is megatron's ``parallel_state``'s; cp > 1 needs packed
  micro-batches carrying a :class:`~megarl.models.context_parallel.CPSplit`
  (``megarl/models/context_parallel.py``: zig-zag split, K/V all-gather attention).
- ``forward_logits(chunks, input_ids, position_ids=None, attention_mask=None)``: full-vocab
  logits ``[b, s, V]`` (values ``[b, s]`` for critics) on the last PP stage, ``None`` elsewhere.
  pp == 1: direct call; pp > 1: megatron ``get_forward_backward_func()`` with
  ``forward_only=True, collect_non_loss_data=True``.
- ``load_hf_weights(chunks, hf_dir_or_getter) -> list[str]``: loads this rank's shards,
  streaming safetensors file by file; missing tensors raise ``KeyError`` naming them.
- ``iter_hf_weights(chunks, hf_config=None) -> Iterator[(hf_name, tensor)]``: THE weight-sync
  contract: full HF-named tensors; dense params yielded by tp_rank 0 & dp_rank 0 of each PP stage,
  experts by expert-tp rank 0 & expert-dp rank 0 of each EP rank (see its docstring).
- Naming rules: ``RULES`` (data), ``hf_rule(global_name, family)``, ``fuse_qkv``/``split_qkv``,
  ``hf_to_local``/``local_to_hf``, ``param_infos(chunk)``.
"""
from .config import (FAMILIES, detect_family, load_hf_config, moe_layer_pattern, rope_params,
                     transformer_config_from_hf)
from .builder import ValueHead, build_model, forward_logits, layer_block_spec, padded_vocab_size, unwrap
from .naming import (RULES, VALUE_HEAD_HF_NAME, Rule, SafetensorsSource, fuse_qkv, hf_rule,
                     hf_to_local, iter_hf_weights, load_hf_weights, local_to_hf, param_infos,
                     split_qkv)

__all__ = [
    "FAMILIES", "detect_family", "load_hf_config", "moe_layer_pattern", "rope_params",
    "transformer_config_from_hf", "ValueHead", "build_model", "forward_logits", "layer_block_spec",
    "padded_vocab_size", "unwrap", "RULES", "VALUE_HEAD_HF_NAME", "Rule", "SafetensorsSource",
    "fuse_qkv", "hf_rule", "hf_to_local", "iter_hf_weights", "load_hf_weights", "local_to_hf",
    "param_infos", "split_qkv",
]
