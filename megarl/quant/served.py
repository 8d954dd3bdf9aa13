"""The weight format a rollout server serves, read from its checkpoint, and the push stream in it.

Why: SGLang serves a checkpoint as its ``config.json`` declares it. An FP8 block-quantized
checkpoint (DeepSeek-V3's format: ``quantization_config = {quant_method: fp8, fmt: e4m3,
weight_block_size: [128, 128], activation_scheme: dynamic}``) holds ``X.weight`` in
``float8_e4m3fn`` plus ``X.weight_scale_inv`` for exactly the linears it quantizes; norms,
embeddings, router gates and the LM head stay in high precision. A weight push into such a server
must send the same names, dtypes and layout, or SGLang's loader refuses or silently corrupts them.

Which weights are quantized is read off the checkpoint itself (the names that have a
``weight_scale_inv`` companion), never guessed from module names. Pure functions and JSON only:
this package imports nothing of megarl.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Mapping, Optional, Tuple

import torch

from .fp8_block import BLOCK, ScaleFormat, quantize_block_fp8

SCALE_SUFFIX = "_scale_inv"          # X.weight -> X.weight_scale_inv
Named = Iterable[Tuple[str, torch.Tensor]]


class ServedFormatError(ValueError):
    """A served checkpoint's quantization megarl cannot produce (one line naming the field)."""


def scale_name(weight_name: str) -> str:
    """The scale tensor's checkpoint name of a quantized weight."""
    return weight_name + SCALE_SUFFIX


def split_scale_name(name: str) -> Optional[str]:
    """``X.weight_scale_inv`` -> ``X.weight``; None for any other name."""
    return name[: -len(SCALE_SUFFIX)] if name.endswith(".weight" + SCALE_SUFFIX) else None


def quantization_config(hf_config: Any) -> Optional[dict]:
    """``quantization_config`` of an HF config (object or dict), or None."""
    q = hf_config.get("quantization_config") if isinstance(hf_config, Mapping) else \
        getattr(hf_config, "quantization_config", None)
    if q is None:
        return None
    return q if isinstance(q, dict) else dict(q.to_dict() if hasattr(q, "to_dict") else vars(q))


@dataclass(frozen=True)
class BlockFp8Format:
    """DeepSeek-V3-style block FP8: which weights, the block and the scale convention."""

    quantized: frozenset          # checkpoint names of the weights served in float8_e4m3fn
    block: int = BLOCK
    scale_format: ScaleFormat = "fp32"

    @property
    def name(self) -> str:
        return "fp8"

    def stream(self, named: Named) -> Iterator[Tuple[str, torch.Tensor]]:
        """The push stream in this format: each quantized weight becomes its FP8 bytes and its
        scale grid; the rest passes as is. Small tensors (norms, biases, scales) are held back and
        sent after the large ones, so dtypes do not alternate every tensor (a bucket holds one
        dtype: alternating would cut one bucket per tensor)."""
        small: list = []
        small_bytes = 0
        for name, t in named:
            if name in self.quantized:
                q, s = quantize_block_fp8(t.detach(), self.block, self.scale_format)
                yield name, q
                small.append((scale_name(name), s))
                small_bytes += s.numel() * s.element_size()
            elif t.dim() < 2:
                small.append((name, t.detach().clone()))
                small_bytes += t.numel() * t.element_size()
            else:
                yield name, t
        small.sort(key=lambda nt: str(nt[1].dtype))
        yield from small


def block_fp8_settings(hf_config: Any) -> Optional[Tuple[int, str]]:
    """(block, scale format) of a block-FP8 ``quantization_config``; None when the config declares
    no quantization. Raises ServedFormatError, naming the field, for one megarl does not produce."""
    q = quantization_config(hf_config)
    if q is None:
        return None
    method = str(q.get("quant_method", "")).lower()
    if method != "fp8":
        raise ServedFormatError(f"quantization_config.quant_method: {method!r} is not served by megarl "
                                f"(block FP8 'fp8' is)")
    fmt = str(q.get("fmt", "e4m3")).lower()
    if fmt != "e4m3":
        raise ServedFormatError(f"quantization_config.fmt: {fmt!r}; megarl quantizes to float8_e4m3fn ('e4m3')")
    block = q.get("weight_block_size")
    if block is None or list(block) != [BLOCK, BLOCK]:
        raise ServedFormatError(f"quantization_config.weight_block_size: {block}; megarl produces "
                                f"[{BLOCK}, {BLOCK}] blocks (per-tensor FP8 is not supported)")
    act = str(q.get("activation_scheme", "dynamic")).lower()
    if act != "dynamic":
        raise ServedFormatError(f"quantization_config.activation_scheme: {act!r}; only 'dynamic' (no static "
                                f"activation scales to push) is supported")
    scale_fmt = str(q.get("scale_fmt") or "fp32").lower()
    if scale_fmt not in ("ue8m0", "fp32"):
        raise ServedFormatError(f"quantization_config.scale_fmt: {scale_fmt!r} (known: ue8m0, fp32)")
    return BLOCK, scale_fmt


def served_format(hf_config: Any, checkpoint_names: Optional[Iterable[str]]) -> Optional[BlockFp8Format]:
    """The served format of a checkpoint (its config and its tensor names); None = as trained.

    Raises ServedFormatError, naming the field, for a quantization megarl does not produce."""
    settings = block_fp8_settings(hf_config)
    if settings is None:
        return None
    block, scale_fmt = settings
    quantized = frozenset(filter(None, map(split_scale_name, checkpoint_names or ())))
    if not quantized:
        raise ServedFormatError("quantization_config declares block FP8 but the checkpoint holds no "
                                "'*.weight_scale_inv' tensors: is it a config-only folder?")
    return BlockFp8Format(quantized=quantized, block=block, scale_format=scale_fmt)  # type: ignore[arg-type]


def read_served_format(hf_dir: str, checkpoint_names: Optional[Iterable[str]]) -> Optional[BlockFp8Format]:
    """`served_format` of a checkpoint folder (its config.json)."""
    path = os.path.join(hf_dir, "config.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return served_format(json.load(f), checkpoint_names)
