"""The rollout servers' checkpoint when it is not the trainer's (``rollout.model_path``).

Why: a block-FP8 copy of the model (`megarl convert hf-to-fp8`, or DeepSeek-V3's own checkpoint)
must describe the same network as ``model.hf_path``, in a format megarl can push; otherwise the
run would start servers and workers only to fail at the first push. And FP8 rollout makes the
rollout policy differ from the trainer's more than bf16 noise does (as off-policy rollout modes do
by design), so the rollout correction is turned on unless the recipe says otherwise
(``algorithm.rollout_correction.enabled``).
"""
from __future__ import annotations

import json
from pathlib import Path
import dataclasses
from typing import Any, Optional

from megarl.quant.fp8_block import BLOCK
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
    """(whether ``served_dir`` is block FP8, the line to log or None): the rollout correction
    resolved against it (:func:`resolve_rollout_correction`)."""
    fp8 = checkpoint_quant_method(served_dir) == "fp8"
    return fp8, resolve_rollout_correction(cfg, f"the servers serve block FP8 ({served_dir})" if fp8 else None)


def resolve_rollout_correction(cfg: Any, fp8_reason: Optional[str]) -> Optional[str]:
    """Set ``algorithm.rollout_correction.enabled`` when null; return the line to log or None.

    On where the rollout's policy differs from the trainer's by construction -- block-FP8 servers
    (``fp8_reason``), off-policy rollout modes -- or where the recipe set any other field of the
    section; off where the old logprobs are the rollout's (nothing left to correct). A legacy
    ``algorithm.tis_cap`` stays as it is (``algos.loss_settings.rollout_correction_of`` reads it)
    and is named in the line."""
    a = cfg.algorithm
    rc = a.rollout_correction
    if a.tis_cap is not None:
        meaning = (f"{{enabled: true, level: token, mode: truncate, upper: {a.tis_cap:g}}}" if a.tis_cap > 0
                   else "{enabled: false}")
        return f"algorithm.tis_cap: {a.tis_cap:g} is read as algorithm.rollout_correction {meaning}"
    if rc.enabled is not None:
        return None
    if a.old_logprobs == "rollout":
        rc.enabled = False
        return None
    reasons = [r for r in (fp8_reason, f"rollout.mode = {cfg.rollout.mode}" if cfg.rollout.mode != "sync" else None,
                           "algorithm.rollout_correction is set" if correction_configured(rc) else None) if r]
    rc.enabled = bool(reasons)
    if not reasons:
        return None
    bounds = f"[{'-' if rc.lower is None else f'{rc.lower:g}'}, {'-' if rc.upper is None else f'{rc.upper:g}'}]"
    return (f"rollout correction on ({'; '.join(reasons)}): level {rc.level}, {rc.mode} to {bounds} "
            f"(algorithm.rollout_correction.enabled: false turns it off)")


def correction_configured(rc: Any) -> bool:
    """Whether any field of ``algorithm.rollout_correction`` besides ``enabled`` differs from the
    schema's default (the recipe asked for a correction of its own)."""
    default = type(rc)()
    return any(getattr(rc, f.name) != getattr(default, f.name) for f in dataclasses.fields(rc) if f.name != "enabled")
