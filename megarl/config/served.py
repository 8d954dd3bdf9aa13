"""The rollout servers' checkpoint when it is not the trainer's (``rollout.model_path``).

Why: a block-FP8 copy of the model (`megarl convert hf-to-fp8`, or DeepSeek-V3's own checkpoint)
must describe the same network as ``model.hf_path``, in a format megarl can push; otherwise the
run would start servers and workers only to fail at the first push. And FP8 rollout makes the
rollout policy differ from the trainer's more than bf16 noise does, so truncated importance
sampling is turned on unless the recipe says otherwise (``algorithm.tis_cap``).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from megarl.quant.fp8_block import BLOCK

# the TIS cap FP8 rollout gets when algorithm.tis_cap is null (verl's default imp-ratio cap)
FP8_TIS_CAP = 2.0
# config.json fields that must agree between the trained and the served checkpoint
SAME_NETWORK = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "intermediate_size", "vocab_size", "moe_intermediate_size", "num_experts", "n_routed_experts",
                "head_dim", "tie_word_embeddings")


def _config(path: str) -> Optional[dict]:
    file = Path(path).expanduser() / "config.json"
    return json.loads(file.read_text()) if file.is_file() else None


def served_problems(cfg: Any, trained: Optional[dict]) -> list[str]:
    """One line per problem with ``rollout.model_path`` (checked at launch, with the files)."""
    path = cfg.rollout.model_path
    if not path:
        return []
    served = _config(path)
    if served is None:
        return [f"rollout.model_path: no config.json in {path!r}"]
    from megarl.quant.served import ServedFormatError, block_fp8_settings

    problems = []
    if trained is not None:
        for key in SAME_NETWORK:
            if trained.get(key) != served.get(key):
                problems.append(f"rollout.model_path: {key} = {served.get(key)!r} in {path}, but model.hf_path has "
                                f"{trained.get(key)!r}: the servers must serve the trained network")
                break
    try:
        fp8 = block_fp8_settings(served)
    except ServedFormatError as e:
        return problems + [f"rollout.model_path: {path}/config.json: {e}"]
    declared = cfg.rollout.quantization
    if declared is not None and (declared == "fp8") != bool(fp8):
        problems.append(f"rollout.quantization: {declared!r}, but {path}/config.json declares "
                        f"{'block FP8' if fp8 else 'no quantization'}")
    if fp8 and cfg.rollout.engine == "sglang":
        problems += _sglang_tp_alignment(cfg, served)
    return problems


def _sglang_tp_alignment(cfg: Any, served: dict) -> list[str]:
    """SGLang's FP8 linears need every TP shard of a quantized weight to be whole 128-blocks
    (``Fp8LinearMethod.validate_block_quant_shapes``): say so before launching."""
    from megarl.config.validate import server_tp_sizes

    dims = {"intermediate_size": served.get("intermediate_size"),
            "moe_intermediate_size": served.get("moe_intermediate_size")}
    for tp in sorted(set(server_tp_sizes(cfg))):
        for key, dim in dims.items():
            if dim and tp > 1 and (dim // tp) % BLOCK:
                return [f"rollout.tp: {key} {dim} / TP {tp} = {dim // tp} is not a multiple of {BLOCK}: SGLang's "
                        f"block-FP8 layers refuse that shard; use a TP size that divides it into 128-blocks"]
    return []


def checkpoint_quant_method(hf_dir: str) -> Optional[str]:
    """``quantization_config.quant_method`` of a checkpoint folder's config.json, if any."""
    config = _config(hf_dir) or {}
    return (config.get("quantization_config") or {}).get("quant_method")


def served_quant_method(cfg: Any, served_dir: Optional[str]) -> Optional[str]:
    """The servers' weight format: ``rollout.quantization`` when declared (plans of checkpoints not
    on this machine), else the served checkpoint's own; None = unquantized."""
    declared = cfg.rollout.quantization
    if declared is not None:
        return None if declared == "none" else declared
    return checkpoint_quant_method(served_dir) if served_dir else None


def rollout_is_fp8(cfg: Any) -> bool:
    """Whether the servers serve block FP8 (for the plan: nothing resolved yet)."""
    return served_quant_method(cfg, cfg.rollout.model_path) == "fp8"


def resolve_served_defaults(cfg: Any, served_dir: str) -> tuple[bool, Optional[str]]:
    """(whether ``served_dir`` is block FP8, the line to log or None). FP8 rollout turns on TIS at
    ``FP8_TIS_CAP`` when ``algorithm.tis_cap`` is null (not when the old logprobs are the rollout's:
    then there is no mismatch left to correct)."""
    fp8 = checkpoint_quant_method(served_dir) == "fp8"
    if not fp8 or cfg.algorithm.tis_cap is not None or cfg.algorithm.old_logprobs == "rollout":
        return fp8, None
    cfg.algorithm.tis_cap = FP8_TIS_CAP
    return fp8, (f"FP8 rollout ({served_dir}): truncated importance sampling on, algorithm.tis_cap = "
                 f"{FP8_TIS_CAP:g} (set algorithm.tis_cap: 0 to turn it off)")
