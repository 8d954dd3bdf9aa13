"""Compiled elementwise fusions for megatron's local (no Transformer Engine / apex) layers on CUDA.

Why: without TE or apex, megatron's local spec runs RMSNorm, rotary embeddings and SwiGLU as
chains of separate torch ops. At the 0.5B shape a profile of one actor step on an H100 put ~half
the CUDA time in such elementwise kernels (before these fusions; with them: benchmarks/RESULTS.md,
training step). TE's fused kernels are
the usual cure; where TE is not installed, ``torch.compile`` of the same math gives one kernel per
op in forward and backward:

* SwiGLU: megatron's own ``bias_activation_fusion`` (its ``jit_fuser`` is ``torch.compile``),
  switched on by :func:`megarl.models.config.transformer_config_from_hf` when fusions are on;
* RMSNorm: :class:`CompiledRMSNorm` replaces ``WrappedTorchNorm`` (same ``weight`` parameter, so
  checkpoints and weight names are unchanged);
* RoPE: megatron's unfused ``_apply_rotary_pos_emb_bshd`` is swapped for a compiled wrapper of
  itself (same function, same arguments; megatron looks it up at call time).

Fusions are on when CUDA is available and ``MEGARL_FUSIONS`` is not ``0`` (see :func:`fusions_enabled`). On CPU they stay off:
the inductor C++ backend would add compile minutes to every CPU run for little gain. The compiled
math rounds once per fused op instead of once per torch op, so bf16 results differ from the eager
path by bf16 rounding (fp32 results agree to ~1e-6).
"""
from __future__ import annotations

import os
from typing import Callable

import torch


def fusions_enabled() -> bool:
    """``MEGARL_FUSIONS``: unset/``1`` = on with CUDA, ``0`` = off, ``force`` = on also without CUDA
    (tests: the same module swaps and compiled code paths, run by inductor's CPU backend)."""
    mode = os.environ.get("MEGARL_FUSIONS", "1")
    return mode == "force" or (mode != "0" and torch.cuda.is_available())


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # the order of HF's Qwen2/Llama RMSNorm (and torch's): normalise in fp32, round, then scale
    xf = x.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (weight * y).to(x.dtype)


_compiled: dict = {}


def compiled(name: str, fn: Callable) -> Callable:
    """``torch.compile(fn, dynamic=True)``, built once per process under ``name`` (dynamic: token
    counts change every micro-batch, and one recompile per new shape would cost seconds each)."""
    if name not in _compiled:
        _compiled[name] = torch.compile(fn, dynamic=True)
    return _compiled[name]


class CompiledRMSNorm(torch.nn.Module):
    """RMSNorm with megatron's norm constructor signature; ``torch.compile``-fused on CUDA."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                 zero_centered_gamma: bool = False, normalization: str = "RMSNorm"):
        super().__init__()
        if config.normalization != "RMSNorm":
            raise ValueError(f"CompiledRMSNorm only implements RMSNorm, config has {config.normalization}")
        if getattr(config, "layernorm_zero_centered_gamma", False):
            raise ValueError("CompiledRMSNorm does not implement zero-centered gamma")
        self.eps = float(eps)
        # in params_dtype like megatron's own layers (HF's norms scale in the model dtype too);
        # default device like torch.nn.RMSNorm, which WrappedTorchNorm builds
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        # megatron all-reduces the grads of params marked so across the TP group under sequence parallel
        setattr(self.weight, "sequence_parallel", bool(config.sequence_parallel))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return compiled("rms_norm", _rms_norm)(x, self.weight, self.eps)


def use_compiled_norms(spec) -> None:
    """Swap megatron's ``WrappedTorchNorm`` for :class:`CompiledRMSNorm` in a decoder block spec."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    def swap(sub) -> None:
        for field in ("input_layernorm", "pre_mlp_layernorm", "q_layernorm", "k_layernorm", "kv_layernorm",
                      "pre_cross_attn_layernorm"):
            if getattr(sub, field, None) is WrappedTorchNorm:
                setattr(sub, field, CompiledRMSNorm)

    for layer_spec in spec.layer_specs:
        swap(layer_spec.submodules)
        attn = getattr(layer_spec.submodules, "self_attention", None)
        if attn is not None and getattr(attn, "submodules", None) is not None:
            swap(attn.submodules)
    if getattr(spec, "layer_norm", None) is WrappedTorchNorm:
        spec.layer_norm = CompiledRMSNorm


def install_rope_fusion() -> None:
    """Route megatron's unfused rotary embedding through a compiled copy of itself (idempotent)."""
    from megatron.core.models.common.embeddings import rope_utils

    if getattr(rope_utils._apply_rotary_pos_emb_bshd, "_megarl_compiled", False):
        return
    rope = compiled("rope", rope_utils._apply_rotary_pos_emb_bshd)
    rope._megarl_compiled = True
    rope_utils._apply_rotary_pos_emb_bshd = rope
