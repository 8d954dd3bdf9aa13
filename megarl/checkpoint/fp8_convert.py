"""``megarl convert hf-to-fp8``: an HF checkpoint as a block-FP8 checkpoint (DeepSeek-V3's format).

Why: FP8 rollout halves the servers' weight memory and runs their GEMMs on FP8 tensor cores, but only
DeepSeek-V3 ships that way. Converting Qwen/Llama the same way lets any recipe serve its rollout in
FP8 (``rollout.model_path``) while the trainer keeps bf16; every weight push is then quantized to
this checkpoint's format (``megarl.quant.served``).

What is quantized: the 2-D linear weights of the attention and MLP blocks (``model.layers.N.
self_attn.*`` / ``mlp.*``, experts included), as ``float8_e4m3fn`` plus ``X.weight_scale_inv``, one
fp32 scale per 128x128 block (dims that are not a multiple of 128 get a padded tail block, as
SGLang's loader expects). Norms, biases, embeddings, the LM head and MoE router gates stay as they
are. ``config.json`` gains ``quantization_config = {quant_method: fp8, fmt: e4m3,
activation_scheme: dynamic, weight_block_size: [128, 128]}`` (plus ``scale_fmt: ue8m0`` for
power-of-two scales). The output is written to a temporary folder and published whole.

Who reads a padded tail block (a dim that is not a multiple of 128) right -- measured against each
loader's own code:
- the embedded engine (``megarl serve``) and megarl's pushes: any dim (the block is the config's);
- transformers' FP8 loader (5.24, when it dequantizes, as it does on CPU): it infers the block from
  the scale grid, ``dim // ceil(dim / 128)``, so a dim above 128 that is not a multiple of 128 is
  refused (320 -> 3 scales) or silently read as smaller blocks (192 -> 2 scales of 96);
- SGLang 0.5.23: its block-FP8 linears fuse q/k/v and gate/up and refuse, at server start, a fused
  part whose rows are not a multiple of 128 (``Fp8LinearMethod.validate_block_quant_shapes``; at TP
  t each rank's part); tails along the hidden dim are read right.
A conversion that some loader cannot read says so in one line and records it in
``config.json`` (``megarl_fp8_readers``, beside ``quantization_config``, whose keys stay the format's
own); ``readable_by`` refuses it instead, writing nothing.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Optional, Sequence

import torch

from megarl.quant.fp8_block import BLOCK, quantize_block_fp8

from .atomic import replace_dir

_LINEAR = re.compile(r"^model\.layers\.\d+\.(self_attn|mlp)\.(.+)\.weight$")
SCALE_FORMATS = ("fp32", "ue8m0")


def quantizes(name: str, shape: tuple) -> bool:
    """Whether ``hf-to-fp8`` stores this tensor in FP8: a 2-D attention/MLP projection weight, not a
    norm and not a router gate."""
    m = _LINEAR.match(name)
    if m is None or len(shape) != 2:
        return False
    module = m.group(2)
    leaf = module.rsplit(".", 1)[-1]
    return "norm" not in leaf and not leaf.endswith("gate") and leaf != "gate"


def fp8_quantization_config(scale_format: str = "fp32") -> dict:
    """The ``quantization_config`` of a block-FP8 checkpoint megarl writes."""
    cfg = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [BLOCK, BLOCK]}
    if scale_format == "ue8m0":
        cfg["scale_fmt"] = "ue8m0"
    return cfg


READERS = ("sglang", "transformers")
# projections SGLang's Llama/Qwen-family models fuse (QKVParallelLinear, MergedColumnParallelLinear,
# the experts' w13): each part's rows must be whole blocks
SGLANG_FUSED = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")


def misread_by_transformers(shape: tuple, block: int = BLOCK) -> bool:
    """Whether transformers' FP8 loader reads this quantized weight wrong (or refuses it): it takes
    the block of each dim as ``dim // ceil(dim / block)``, which is ``block`` only for multiples of
    it; a dim up to ``block`` is one block of its own size, which is right."""
    return any(d > block and d % block for d in shape[-2:])


def refused_by_sglang(name: str, shape: tuple, block: int = BLOCK) -> bool:
    """Whether SGLang (TP 1) refuses to start on this quantized weight: a part of a fused linear
    whose rows are not whole blocks."""
    leaf = name.rsplit(".", 2)[-2] if name.endswith(".weight") else ""
    return leaf in SGLANG_FUSED and shape[0] % block != 0


def _quantized_shapes(files: list) -> dict:
    """Name -> shape of every weight ``hf-to-fp8`` quantizes, from the safetensors headers alone."""
    from safetensors import safe_open

    out: dict = {}
    for path in files:
        with safe_open(str(path), framework="pt") as fh:
            for name in fh.keys():
                shape = tuple(fh.get_slice(name).get_shape())
                if quantizes(name, shape):
                    out[name] = shape
    return out


def unreadable(files: list, block: int = BLOCK) -> dict:
    """Loader -> {name: shape} of the quantized weights it cannot read right (loaders with none are
    left out; ``megarl serve`` reads every one)."""
    shapes = _quantized_shapes(files)
    found = {"transformers": {n: s for n, s in shapes.items() if misread_by_transformers(s, block)},
             "sglang": {n: s for n, s in shapes.items() if refused_by_sglang(n, s, block)}}
    return {loader: names for loader, names in found.items() if names}


def readers_record(bad: dict, block: int = BLOCK) -> dict:
    """``config.json``'s ``megarl_fp8_readers``: what each loader does with this checkpoint (a
    config key SGLang and transformers do not read)."""
    def example(names: dict) -> str:
        name, shape = min(names.items())
        return f"{len(names)} weight(s), e.g. {name} {list(shape)}"

    t, s = bad.get("transformers"), bad.get("sglang")
    return {"megarl serve": "reads",
            "sglang": f"refuses at start: fused q/k/v or gate/up rows not a multiple of {block} ({example(s)})"
                      if s else "reads at TP 1",
            "transformers": f"misreads or refuses: a dim above {block} not a multiple of {block}, the block is "
                            f"inferred from the scale grid ({example(t)})" if t else "reads"}


def readers_note(record: dict) -> str:
    """The one line that says which loaders read the converted checkpoint."""
    return "; ".join(f"{loader}: {verdict}" for loader, verdict in record.items())


def _check(src: Path, out: Path, scale_format: str, readable_by: Sequence[str]) -> dict:
    """Everything that can be refused, before any tensor is read or written."""
    if scale_format not in SCALE_FORMATS:
        raise ValueError(f"--scale-fmt: {scale_format!r} not in {SCALE_FORMATS}")
    unknown = [r for r in readable_by if r not in READERS]
    if unknown:
        raise ValueError(f"--readable-by: {unknown} not in {READERS}")
    cfg_path = src / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"--hf: no config.json in {src}")
    config = json.loads(cfg_path.read_text())
    if config.get("quantization_config"):
        method = config["quantization_config"].get("quant_method")
        raise ValueError(f"{cfg_path}: quantization_config: already quantized ({method!r}); convert the "
                         f"high-precision checkpoint")
    if not sorted(src.glob("*.safetensors")):
        raise FileNotFoundError(f"--hf: no *.safetensors in {src}")
    if out.resolve() == src.resolve():
        raise ValueError("--out: must differ from --hf (the source is kept)")
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"--out: {out} exists and is not empty (nothing is overwritten)")
    return config


def convert_hf_to_fp8(hf_dir: str, out_dir: str, scale_format: str = "fp32", verbose: bool = True,
                      readable_by: Sequence[str] = ()) -> dict:
    """Write the block-FP8 copy of ``hf_dir`` to ``out_dir``; returns counts and bytes.

    A result some loader cannot read (see the module docstring) is announced in one line on stderr
    and in ``config.json``'s ``megarl_fp8_readers``; refused before anything is written when that
    loader is in ``readable_by``."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    src, out = Path(hf_dir).expanduser(), Path(out_dir).expanduser()
    config = _check(src, out, scale_format, readable_by)
    files = sorted(src.glob("*.safetensors"))
    bad = unreadable(files)
    record = readers_record(bad) if bad else None
    refused = [r for r in readable_by if r in bad]
    if record and refused:
        raise ValueError(f"--readable-by {','.join(refused)}: {readers_note(record)}")
    if record:
        print(f"[megarl.convert] warning: not every loader reads this checkpoint right: {readers_note(record)}",
              file=sys.stderr, flush=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    stats = {"quantized": 0, "kept": 0, "bytes_in": 0, "bytes_out": 0}
    weight_map: dict = {}
    try:
        for k, path in enumerate(files):
            tensors: dict = {}
            with safe_open(str(path), framework="pt") as fh:
                for name in fh.keys():
                    t = fh.get_tensor(name)
                    stats["bytes_in"] += t.numel() * t.element_size()
                    if quantizes(name, tuple(t.shape)):
                        q, s = quantize_block_fp8(t, BLOCK, scale_format)  # type: ignore[arg-type]
                        tensors[name], tensors[name + "_scale_inv"] = q, s
                        stats["quantized"] += 1
                    else:
                        tensors[name] = t.contiguous()
                        stats["kept"] += 1
            save_file(tensors, str(tmp / path.name), metadata={"format": "pt"})
            stats["bytes_out"] += sum(t.numel() * t.element_size() for t in tensors.values())
            weight_map.update({n: path.name for n in tensors})
            if verbose:
                print(f"[megarl.convert] {k + 1}/{len(files)} {path.name}: {stats['quantized']} weights in FP8 so far",
                      flush=True)
        for extra in src.iterdir():
            if extra.is_file() and not extra.name.endswith(".safetensors") and extra.name not in (
                    "config.json", "model.safetensors.index.json"):
                shutil.copy2(extra, tmp / extra.name)
        config["quantization_config"] = fp8_quantization_config(scale_format)
        if record:
            config["megarl_fp8_readers"] = record
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        if len(files) > 1 or (src / "model.safetensors.index.json").exists():
            (tmp / "model.safetensors.index.json").write_text(json.dumps(
                {"metadata": {"total_size": stats["bytes_out"]}, "weight_map": dict(sorted(weight_map.items()))},
                indent=2))
        out.parent.mkdir(parents=True, exist_ok=True)
        if out.exists():
            out.rmdir()        # empty (checked above)
        replace_dir(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if verbose:
        print(f"[megarl.convert] wrote {out}: {stats['quantized']} weights in FP8 (+ scales), {stats['kept']} kept; "
              f"{stats['bytes_in'] / 1e9:.2f} GB -> {stats['bytes_out'] / 1e9:.2f} GB", flush=True)
    return stats


def read_quantized(hf_dir: str, names: Optional[list] = None) -> dict:
    """Dequantized (fp32) tensors of a block-FP8 folder, by name (tests, inspection)."""
    from safetensors import safe_open

    from megarl.quant.fp8_block import dequantize_block_fp8

    out: dict = {}
    for path in sorted(Path(hf_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as fh:
            keys = set(fh.keys())
            for name in keys:
                if name.endswith("_scale_inv") or (names is not None and name not in names):
                    continue
                t = fh.get_tensor(name)
                if name + "_scale_inv" in keys:
                    t = dequantize_block_fp8(t, fh.get_tensor(name + "_scale_inv"), dtype=torch.float32)
                out[name] = t
    return out
