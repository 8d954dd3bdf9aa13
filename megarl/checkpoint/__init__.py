"""HF safetensors import/export (streaming), megatron torch_dist save/load, checksum manifests.

Public API:

- ``convert_hf_to_megatron(hf_dir, out_dir, *, tp=1, pp=1, ep=1, etp=1, vpp=None, dtype=None,
  verbose=True) -> dict`` (seconds, peak_rss_mb): streams safetensors into tp*pp*ep-sharded
  megatron models in local processes, verifies against a per-tensor checksum manifest, saves
  torch_dist (loadable at any tp/pp/ep/vpp).
- ``convert_megatron_to_hf(ckpt_dir, out_dir, hf_config_dir=None, *, tp=1, pp=1, ep=1,
  max_shard_gb=4.0) -> dict``: HF folder (safetensors + index, config.json, tokenizer files).
- ``save_megatron(chunks, dir, extra_state=None)`` / ``load_megatron(chunks, dir, verify=True)
  -> extra_state``: collective; atomic (tmp dir + rename); manifest written / checked.
- ``CheckpointVerificationError`` (``.missing``, ``.extra``, ``.mismatched``: tensor names).
- ``convert_main(argv) -> int``: ``megarl convert hf-to-megatron|megatron-to-hf ...``.
"""
from .manifest import MANIFEST_NAME, CheckpointVerificationError
from .megatron_io import load_megatron, read_meta, save_megatron, verify_model, model_manifest
from .convert import convert_hf_to_megatron, convert_megatron_to_hf
from .cli import convert_main

__all__ = ["MANIFEST_NAME", "CheckpointVerificationError", "load_megatron", "read_meta",
           "save_megatron", "verify_model", "model_manifest", "convert_hf_to_megatron",
           "convert_megatron_to_hf", "convert_main"]
