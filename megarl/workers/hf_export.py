"""Worker side of an HF export: each rank writes the HF-named tensors it owns to its own file.

Why per rank: no rank (nor the driver) ever holds the whole model; the driver only writes the
index that maps each name to the file of the rank that owns it (`megarl.checkpoint.hf_export`).
"""
from __future__ import annotations

import os
from typing import Iterable

import torch


def write_hf_shard(named: Iterable[tuple[str, torch.Tensor]], out_dir: str, rank: int) -> dict[str, str]:
    """Save ``named`` as ``model-rank<rank>.safetensors`` in ``out_dir``; {name: file name}."""
    from safetensors.torch import save_file

    tensors = {name: t.detach().to("cpu").contiguous() for name, t in named}
    if not tensors:
        return {}
    file_name = f"model-rank{rank:05d}.safetensors"
    save_file(tensors, os.path.join(out_dir, file_name), metadata={"format": "pt"})
    return {name: file_name for name in tensors}
