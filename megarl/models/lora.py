"""LoRA adapters on megatron-core's tensor-parallel linear layers (attention QKV/output, dense MLP).

Why adapters are attached to the existing layers (a forward hook plus child parameters) instead
of replacing them: every HF naming rule, weight loader and checkpoint key of the base weights
stays as it is, and megatron's DDP and optimizer see the adapters as ordinary parameters of the
same module tree (the frozen base weights have ``requires_grad=False`` before DDP wraps the
model, so DDP allocates no gradient buffer and the optimizer holds no state for them).

One adapter per *HF* projection (PEFT's layout), so an exported adapter is exactly what ``peft``
builds on the HF model: the fused ``linear_qkv`` carries separate q/k/v adapters and the fused
``linear_fc1`` separate gate/up adapters; their outputs are laid out the way megatron fuses the
base weight (q/k/v interleaved per query group, ``[gate_shard; up_shard]`` per TP rank).

Tensor parallelism, with the reductions megatron itself uses:

* column-parallel layer (QKV, fc1): ``A`` [r, in] replicated, ``B`` [out/tp, r] sharded along 0.
  ``h = x A^T`` is the same on every rank; ``copy_to_tensor_model_parallel_region(h)`` all-reduces
  its gradient, because each rank's ``B`` shard only sees its own output slice.
* row-parallel layer (output proj, fc2): ``A`` [r, in/tp] sharded along 1, ``B`` [out, r]
  replicated. ``reduce_from_tensor_model_parallel_region(x_local A_local^T)`` sums the partial
  products (gradient passes through unchanged), then ``B`` maps the full rank-r activations.

``output += (alpha / r) * B A dropout(x)``; ``B`` starts at zero, so a fresh adapter leaves the
model's outputs unchanged bit for bit (adding exact zeros).
"""
from __future__ import annotations

import contextlib
import hashlib
import math
from dataclasses import dataclass
from typing import Iterable, Iterator, Optional

import torch
from torch import nn

from .naming import _gqa_dims

# megatron module (in a decoder layer) -> the HF projections it fuses, and the HF module path
MODULE_PARTS = {
    "self_attention.linear_qkv": (("q_proj", "k_proj", "v_proj"), "self_attn"),
    "self_attention.linear_proj": (("o_proj",), "self_attn"),
    "mlp.linear_fc1": (("gate_proj", "up_proj"), "mlp"),
    "mlp.linear_fc2": (("down_proj",), "mlp"),
}
ALL_TARGETS = tuple(p for parts, _ in MODULE_PARTS.values() for p in parts)


@dataclass(frozen=True)
class LoRASpec:
    """What to attach: rank, scaling numerator, dropout on the adapter input, HF projection names."""

    rank: int
    alpha: float
    dropout: float = 0.0
    targets: tuple[str, ...] = ALL_TARGETS
    seed: int = 0

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


class LoRAAdapters(nn.Module):
    """The adapters of one megatron linear layer, one (A, B) pair per targeted HF projection.

    Registered as the child ``lora`` of the layer; parameters ``lora.adapters.<hf_proj>.lora_A`` /
    ``lora.adapters.<hf_proj>.lora_B`` hold this rank's shards."""

    def __init__(self, layer: nn.Module, module_key: str, layer_index: int, spec: LoRASpec,
                 cfg, tp_rank: int, tp_size: int):
        super().__init__()
        from megatron.core.tensor_parallel.layers import ColumnParallelLinear

        parts, hf_module = MODULE_PARTS[module_key]
        self.column = isinstance(layer, ColumnParallelLinear)
        if self.column and getattr(layer, "gather_output", False):
            raise ValueError(f"LoRA on {module_key}: gather_output=True is not supported")
        self.module_key, self.layer_index, self.spec = module_key, layer_index, spec
        self.parts = parts
        self.hf_prefix = f"model.layers.{layer_index}.{hf_module}."
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.enabled = True
        self.out_sizes = _part_out_sizes(module_key, cfg, layer)
        in_full = layer.input_size
        self.head_dim = _gqa_dims(cfg)[2] if module_key == "self_attention.linear_qkv" else 0
        self.adapters = nn.ModuleDict()
        dtype, device = layer.weight.dtype, layer.weight.device
        for name in parts:
            if name not in spec.targets:
                continue
            a_full = torch.empty(spec.rank, in_full, dtype=torch.float32)
            # PEFT's init of lora_A (kaiming-uniform, a=sqrt(5)) from a generator keyed by the
            # adapter's HF name: the same full adapter whatever the TP/PP layout
            nn.init.kaiming_uniform_(a_full, a=math.sqrt(5), generator=_generator(spec.seed, self.hf_prefix + name))
            out_local = self.out_sizes[name]
            b_rows = out_local * (tp_size if self.column else 1)
            b_full = torch.zeros(b_rows, spec.rank, dtype=torch.float32)
            a = a_full if self.column else a_full.chunk(tp_size, 1)[tp_rank]
            b = b_full.chunk(tp_size, 0)[tp_rank] if self.column else b_full
            pair = nn.Module()
            pair.lora_A = nn.Parameter(a.to(device=device, dtype=dtype).contiguous())
            pair.lora_B = nn.Parameter(b.to(device=device, dtype=dtype).contiguous())
            sharded = pair.lora_B if self.column else pair.lora_A
            if tp_size > 1:
                from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
                set_tensor_model_parallel_attributes(sharded, True, 0 if self.column else 1, 1)
            self.adapters[name] = pair
        self.dropout = nn.Dropout(spec.dropout) if spec.dropout > 0 else None

    # ------------------------------------------------------------------ forward
    def _drop(self, x: torch.Tensor) -> torch.Tensor:
        if self.dropout is None or not self.training:
            return x
        if self.column:   # replicated input: the default generator draws the same mask on every TP rank
            return self.dropout(x)
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
        with get_cuda_rng_tracker().fork():  # sharded input: each rank's own stream
            return self.dropout(x)

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of ``scaling * B A x`` in the layer's (fused) output layout."""
        from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                            reduce_from_tensor_model_parallel_region)
        outs = {}
        for name, pair in self.adapters.items():
            h = torch.nn.functional.linear(self._drop(x), pair.lora_A)
            h = copy_to_tensor_model_parallel_region(h) if self.column else reduce_from_tensor_model_parallel_region(h)
            outs[name] = torch.nn.functional.linear(h, pair.lora_B)
        return self._assemble(outs, x) * self.spec.scaling

    def _assemble(self, outs: dict[str, torch.Tensor], like: torch.Tensor) -> torch.Tensor:
        """Per-projection outputs (last dim) -> the fused layout; untargeted projections are zero."""
        lead = next(iter(outs.values())).shape[:-1]
        full = [outs.get(n) if n in outs else like.new_zeros(*lead, self.out_sizes[n]) for n in self.parts]
        if self.head_dim:   # megatron's QKV: per query group [its q heads | k | v]
            q, k, v = full
            groups = k.shape[-1] // self.head_dim
            return torch.cat([q.reshape(*lead, groups, -1), k.reshape(*lead, groups, -1),
                              v.reshape(*lead, groups, -1)], -1).reshape(*lead, -1)
        return torch.cat(full, -1) if len(full) > 1 else full[0]

    def merged_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """``W + scaling * B A`` for this rank's shard of the base weight (a new tensor)."""
        with torch.no_grad():
            outs = {n: (p.lora_B.float() @ p.lora_A.float()).t() for n, p in self.adapters.items()}  # [in, out]
            if not outs:
                return weight
            delta = self._assemble(outs, weight.float().t()).t() * self.spec.scaling
            return (weight.float() + delta).to(weight.dtype)

    def hf_tensors(self) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
        """``(hf_module_name, full lora_A, full lora_B)`` per adapter, TP shards gathered (every TP rank
        must call it)."""
        import torch.distributed as dist
        from megatron.core import parallel_state as mpu

        for name, pair in self.adapters.items():
            a, b = pair.lora_A.detach(), pair.lora_B.detach()
            if self.tp_size > 1:
                t, dim = (b, 0) if self.column else (a, 1)
                shards = [torch.empty_like(t) for _ in range(self.tp_size)]
                dist.all_gather(shards, t.contiguous(), group=mpu.get_tensor_model_parallel_group())
                full = torch.cat(shards, dim)
                a, b = (a, full) if self.column else (full, b)
            yield self.hf_prefix + name, a, b


def _generator(seed: int, name: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


def _part_out_sizes(module_key: str, cfg, layer: nn.Module) -> dict[str, int]:
    """Each HF projection's output rows on this rank (column layers: per TP shard)."""
    parts, _ = MODULE_PARTS[module_key]
    if module_key == "self_attention.linear_qkv":
        nh, ng, hd = _gqa_dims(cfg)
        tp = layer.output_size // layer.output_size_per_partition
        return {"q_proj": nh * hd // tp, "k_proj": ng * hd // tp, "v_proj": ng * hd // tp}
    if module_key == "mlp.linear_fc1":
        half = layer.output_size_per_partition // 2
        return {"gate_proj": half, "up_proj": half}
    return {parts[0]: layer.output_size}


def _hook(layer: nn.Module, args, output):
    adapters: LoRAAdapters = layer.lora
    if not adapters.enabled or not adapters.adapters:
        return output
    out, bias = output
    return out + adapters.delta(args[0]).to(out.dtype), bias


def _sharded_state_dict(layer: nn.Module, prefix: str = "", sharded_offsets=(), metadata=None):
    """The layer's own checkpoint mapping plus the adapters' TP axes (megatron's would treat them
    as replicated)."""
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    axes = {"weight": 0, "bias": 0} if layer.lora.column else {"weight": 1}
    for name in layer.lora.adapters:
        axes[f"lora.adapters.{name}.lora_B" if layer.lora.column else f"lora.adapters.{name}.lora_A"] = \
            0 if layer.lora.column else 1
    return make_sharded_tensors_for_checkpoint(layer.state_dict(prefix="", keep_vars=True), prefix, axes,
                                               sharded_offsets, tp_group=layer.tp_group,
                                               dp_cp_group=(metadata or {}).get("dp_cp_group"))


def _target_layers(chunk: nn.Module) -> Iterator[tuple[nn.Module, str, int]]:
    layers = chunk.decoder.layers if hasattr(chunk, "decoder") else []
    for layer in layers:
        for key in MODULE_PARTS:
            mod = layer
            for part in key.split("."):
                mod = getattr(mod, part, None)
            if mod is not None and hasattr(mod, "weight"):
                yield mod, key, layer.layer_number - 1


def apply_lora(chunks: Iterable[nn.Module], spec: LoRASpec) -> int:
    """Freeze every parameter of ``chunks`` and attach adapters to the targeted layers. Call it
    after the base weights are loaded and before megatron's DDP wraps the chunks. Returns this
    rank's trainable parameter count."""
    import types

    from megatron.core import parallel_state as mpu

    from .builder import unwrap

    tp_rank, tp_size = mpu.get_tensor_model_parallel_rank(), mpu.get_tensor_model_parallel_world_size()
    trainable = 0
    for chunk in chunks:
        chunk = unwrap(chunk)
        for p in chunk.parameters():
            p.requires_grad_(False)
        for layer, key, index in _target_layers(chunk):
            parts, _ = MODULE_PARTS[key]
            if not any(p in spec.targets for p in parts):
                continue
            adapters = LoRAAdapters(layer, key, index, spec, chunk.hf_config, tp_rank, tp_size)
            layer.lora = adapters
            layer.weight.lora_merge = adapters.merged_weight   # read by naming.iter_hf_weights
            layer.register_forward_hook(_hook)
            layer.sharded_state_dict = types.MethodType(_sharded_state_dict, layer)
            trainable += sum(p.numel() for p in adapters.parameters())
        chunk.lora_spec = spec
    return trainable


def lora_layers(chunks: Iterable[nn.Module]) -> list[LoRAAdapters]:
    from .builder import unwrap
    return [m for c in chunks for m in unwrap(c).modules() if isinstance(m, LoRAAdapters)]


def has_lora(chunks: Iterable[nn.Module]) -> bool:
    from .builder import unwrap
    return any(getattr(unwrap(c), "lora_spec", None) is not None for c in chunks)


@contextlib.contextmanager
def adapters_disabled(chunks: Iterable[nn.Module]):
    """Run the base model: the reference policy of a LoRA run is the actor with adapters off."""
    layers = lora_layers(chunks)
    saved = [m.enabled for m in layers]
    for m in layers:
        m.enabled = False
    try:
        yield
    finally:
        for m, s in zip(layers, saved):
            m.enabled = s


def effective_weight(param: torch.Tensor) -> torch.Tensor:
    """The weight a server should run: the merged ``W + scaling * B A`` of an adapted layer, else the
    parameter itself."""
    merge = getattr(param, "lora_merge", None)
    return merge(param.detach()) if merge is not None else param.detach()


def is_adapter_param(name: str) -> bool:
    return ".lora.adapters." in name


def checkpoint_sharded_state(chunk: nn.Module) -> dict:
    """The chunk's megatron sharded state; with LoRA the adapters only (the frozen base is the HF
    model a run starts from, so a checkpoint is megabytes, not the model)."""
    state = chunk.sharded_state_dict()
    return {k: v for k, v in state.items() if is_adapter_param(k)} if has_lora([chunk]) else state


def load_checkpoint_state(chunk: nn.Module, state: dict) -> None:
    """Load what :func:`checkpoint_sharded_state` saved (all of it without LoRA); a missing adapter is an
    error naming it."""
    if not has_lora([chunk]):
        chunk.load_state_dict(state)
        return
    missing = [k for k in chunk.load_state_dict(state, strict=False).missing_keys if is_adapter_param(k)]
    if missing:
        raise KeyError(f"checkpoint has no LoRA adapter {missing[0]} (was it written with the same actor.lora?)")


def spec_from_config(lora_cfg, seed: int = 0) -> Optional[LoRASpec]:
    """``actor.lora`` (rank, alpha, dropout, target_modules) as a :class:`LoRASpec`; None when rank 0."""
    if not lora_cfg.rank:
        return None
    return LoRASpec(rank=lora_cfg.rank, alpha=lora_cfg.alpha, dropout=lora_cfg.dropout,
                    targets=tuple(lora_cfg.target_modules), seed=seed)


def peft_state_dict(chunks: Iterable[nn.Module]) -> dict[str, torch.Tensor]:
    """This rank's adapters under PEFT's saved names (``base_model.model.<hf module>.lora_A.weight``),
    full tensors; every TP rank must call it (shards are gathered), PP stages return their layers."""
    out: dict[str, torch.Tensor] = {}
    for layer in lora_layers(chunks):
        for module, a, b in layer.hf_tensors():
            out[f"base_model.model.{module}.lora_A.weight"] = a.cpu().clone()
            out[f"base_model.model.{module}.lora_B.weight"] = b.cpu().clone()
    return out


def gather_peft_tensors(group) -> dict[str, torch.Tensor]:
    """Driver side: the whole adapter in PEFT's names from an actor ``WorkerGroup`` (each rank's
    ``adapter_tensors``: TP shards all-gathered, one owner per pipeline stage). Adapters are
    megabytes, so they travel through Ray to the driver (the PEFT export and adapter pushes)."""
    tensors: dict[str, torch.Tensor] = {}
    for part in group.call("adapter_tensors"):
        tensors.update(part)
    return tensors


def write_peft_folder(folder, tensors: dict, config: dict) -> None:
    """A PEFT adapter folder: ``adapter_model.safetensors`` + ``adapter_config.json``, what
    ``peft.PeftModel.from_pretrained`` and SGLang's ``/load_lora_adapter`` read."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "adapter_model.safetensors"),
              metadata={"format": "pt"})
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=1))


def peft_config(spec: LoRASpec, base_model: str = "") -> dict:
    """``adapter_config.json`` of a PEFT LoRA adapter for a causal LM (what ``peft.LoraConfig`` reads)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
            "r": spec.rank, "lora_alpha": spec.alpha, "lora_dropout": spec.dropout,
            "target_modules": sorted(spec.targets), "bias": "none", "fan_in_fan_out": False,
            "use_rslora": False, "use_dora": False, "init_lora_weights": True, "modules_to_save": None,
            "layers_to_transform": None, "inference_mode": True}
