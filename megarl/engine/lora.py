"""LoRA adapters served by the embedded engine, the way SGLang 0.5.23 serves them.

SGLang's API (``http_server.py``): ``/load_lora_adapter_from_tensors`` (``lora_name``, the PEFT
``config_dict``, one pickled ``{peft_name: full tensor}`` payload per TP rank, optional
``expected_checksums`` -- sha256 of each tensor's bytes, checked by every TP rank:
``tp_worker.py``), ``/load_lora_adapter`` (a PEFT folder), ``/unload_lora_adapter``; a
``/generate`` request picks an adapter with ``lora_path`` (its name).

Why adapters stay separate from the base weights (instead of merging ``W + s B A`` on load): a
server holds several versions at once (the new one is loaded before the old one is unloaded, so
requests in flight keep theirs), and each request runs the adapter it named.

Tensor parallel, sliced as SGLang slices them (``lora/layers.py``: ``slice_lora_a_weights`` /
``slice_lora_b_weights``): on a column-parallel projection (q/k/v, gate/up) ``B`` is split along
its rows like the base weight and ``A`` is replicated; on a row-parallel one (o, down) ``A`` is
split along its columns like the base weight and ``B`` replicated -- so each rank's
``(x_local A_local^T) B^T`` is a partial sum that the layer's existing all-reduce completes.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional, Tuple

import torch

from megarl.wire.checksum import tensor_sha256

from .shard import local_part, split_dim

PROJECTIONS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
               "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
# PEFT's saved names (``base_model.model.`` prefix; ``.default`` from an unsaved PeftModel state)
_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\."
                  r"(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.lora_([AB])(?:\.default)?\.weight$")
ADAPTER_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"


class AdapterError(ValueError):
    """An adapter that cannot be served (one line naming the field or tensor)."""


@dataclass
class Adapter:
    """One loaded adapter on one TP rank: per (layer, projection) this rank's ``(A, B)``."""

    name: str
    rank: int
    scaling: float
    pairs: Dict[Tuple[int, str], Tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for ab in self.pairs.values() for t in ab)


def verify_checksums(tensors: Mapping[str, torch.Tensor], expected: Optional[Mapping[str, str]]) -> None:
    """SGLang's ``expected_checksums`` check: every expected name present with its sha256, no extra
    tensor; else one line saying which."""
    if expected is None:
        return
    if not isinstance(expected, dict):
        raise AdapterError("expected_checksums must be an object {tensor name: sha256 hex}")
    missing = sorted(n for n in expected if n not in tensors)
    extra = sorted(n for n in tensors if n not in expected)
    bad = sorted(n for n, want in expected.items() if n in tensors and tensor_sha256(tensors[n]) != want)
    if missing or extra or bad:
        raise AdapterError(f"expected_checksums mismatch: {len(bad)} value-diff {bad[:3]}, {len(missing)} missing "
                           f"{missing[:3]}, {len(extra)} extra {extra[:3]}")


def scaling_of(config: Mapping[str, Any]) -> Tuple[int, float]:
    """(r, scaling) of a PEFT LoRA config: ``alpha / r`` (``alpha / sqrt(r)`` with rsLoRA)."""
    if not isinstance(config, dict):
        raise AdapterError("config_dict must be a PEFT adapter_config object")
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise AdapterError(f"config_dict.peft_type: only LORA is served, got {config.get('peft_type')!r}")
    if config.get("use_dora"):
        raise AdapterError("config_dict.use_dora: DoRA adapters are not served")
    r = config.get("r")
    if not isinstance(r, int) or r <= 0:
        raise AdapterError(f"config_dict.r: must be a positive integer, got {r!r}")
    alpha = config.get("lora_alpha", r)
    if not isinstance(alpha, (int, float)) or alpha <= 0:
        raise AdapterError(f"config_dict.lora_alpha: must be > 0, got {alpha!r}")
    return r, float(alpha) / (math.sqrt(r) if config.get("use_rslora") else r)


def build_adapter(name: str, config: Mapping[str, Any], tensors: Mapping[str, torch.Tensor], model: Any) -> Adapter:
    """Check full PEFT-named tensors against ``model`` (a ``DecoderModel``: one TP rank) and keep this
    rank's slices, on its device and in its dtype."""
    r, scaling = scaling_of(config)
    halves: Dict[Tuple[int, str], Dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.match(key)
        if m is None or PROJECTIONS[m.group(3)] != m.group(2):
            raise AdapterError(f"tensor {key!r}: not a LoRA weight of a dense q/k/v/o/gate/up/down projection")
        layer, proj, half = int(m.group(1)), m.group(3), m.group(4)
        weight = f"model.layers.{layer}.{m.group(2)}.{proj}.weight"
        full = model.full_shapes.get(weight)
        if full is None:
            raise AdapterError(f"tensor {key!r}: the model has no dense {weight} (MoE expert adapters are not served)")
        want = (r, full[1]) if half == "A" else (full[0], r)
        if tuple(t.shape) != want:
            raise AdapterError(f"tensor {key!r}: shape {tuple(t.shape)}, expected {want} (r={r})")
        if not torch.is_floating_point(t) or not bool(torch.isfinite(t).all()):
            raise AdapterError(f"tensor {key!r}: not finite floating-point values")
        # column-parallel base (split along dim 0): B's rows split; row-parallel (dim 1): A's columns
        split = (half == "B") == (split_dim(weight) == 0)   # the half whose axis the base weight splits
        local = local_part(weight, t, model.tp_rank, model.tp_size) if split else t
        # a copy: a payload's tensors are the sender's shared memory, never to be served from in place
        halves.setdefault((layer, proj), {})[half] = local.to(device=model.device, dtype=model.dtype,
                                                              copy=True).contiguous()
    adapter = Adapter(name=name, rank=r, scaling=scaling)
    for (layer, proj), ab in sorted(halves.items()):
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"layer {layer} {proj}: lora_{'B' if 'A' in ab else 'A'} is missing")
        adapter.pairs[(layer, proj)] = (ab["A"], ab["B"])
    if not adapter.pairs:
        raise AdapterError("the adapter has no LoRA tensors")
    return adapter


def read_peft_dir(path: str) -> Tuple[Dict[str, Any], Dict[str, torch.Tensor]]:
    """``adapter_config.json`` and ``adapter_model.safetensors`` of a PEFT folder (already resolved
    inside the server's allowed folder; the files' realpaths are checked again by the caller)."""
    from safetensors.torch import load_file

    with open(os.path.join(path, CONFIG_FILE)) as f:
        config = json.load(f)
    return config, load_file(os.path.join(path, ADAPTER_FILE))


def lora_delta(x: torch.Tensor, pair: Tuple[torch.Tensor, torch.Tensor], scaling: float) -> torch.Tensor:
    """``scaling * B A x`` over the last dim of ``x`` (this rank's share on a row-parallel layer)."""
    a, b = pair
    return torch.nn.functional.linear(torch.nn.functional.linear(x, a), b) * scaling
