"""Adapter-only weight push: a LoRA actor's adapters to servers through SGLang 0.5.23's own LoRA API.

Why: a push of a 7B model moves ~15 GB; its rank-64 adapters move ~0.3 GB (fp16) and the base
stays on the server. SGLang 0.5.23 (``entrypoints/http_server.py``, ``managers/io_struct.py``)
serves adapters by name: ``/load_lora_adapter`` (a PEFT folder on disk),
``/load_lora_adapter_from_tensors`` (``lora_name``, the PEFT ``config_dict``, one pickled
``{name: tensor}`` payload per TP rank -- SGLang slices adapters over TP itself -- and optional
``expected_checksums``, sha256 of each tensor's bytes, checked by every TP rank before loading),
``/unload_lora_adapter``; a ``/generate`` request picks an adapter with ``lora_path`` (its name).
Each push loads the new version under its own name, then unloads the previous one, so requests
in flight keep a valid adapter.

Tensors travel by reference (CUDA IPC on a GPU, shared memory on CPU), as with
``/update_weights_from_tensor``: only towards servers on the sender's node.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from megarl.wire.checksum import tensor_sha256  # noqa: F401  (re-exported)
from megarl.wire.flattened import dumps_b64


def adapter_name(version: str) -> str:
    """The served name of the adapters of one weight version."""
    return f"megarl-lora-{version}"


def load_from_tensors_request(lora_name: str, config_dict: dict[str, Any], tensors: dict[str, torch.Tensor],
                              tp_size: int, checksums: bool = True) -> dict[str, Any]:
    """The JSON body of ``/load_lora_adapter_from_tensors``: every TP rank gets the full adapters
    (one payload each, of the same shared tensors). CPU tensors are moved to shared memory in place:
    the caller keeps ``tensors`` alive until the server has answered."""
    shared = {name: t.detach().contiguous().share_memory_() if t.device.type == "cpu" else t.detach().contiguous()
              for name, t in tensors.items()}
    # one pickle per TP rank: pickling a shared CPU storage takes one reference on it for its reader
    # (torch's file_system strategy), so a payload read by two ranks would drop the sender's own
    # and the next push of the same tensors (another server, a restarted one) would find no file
    body: dict[str, Any] = {"lora_name": lora_name, "config_dict": config_dict,
                            "serialized_named_tensors": [dumps_b64(shared) for _ in range(tp_size)]}
    if checksums:
        body["expected_checksums"] = {name: tensor_sha256(t) for name, t in shared.items()}
    return body


def load_from_disk_request(lora_name: str, adapter_dir: str) -> dict[str, Any]:
    """The JSON body of ``/load_lora_adapter``: a PEFT folder the server can read."""
    return {"lora_name": lora_name, "lora_path": adapter_dir}


def unload_request(lora_name: str) -> dict[str, Any]:
    return {"lora_name": lora_name}


def adapter_bytes(tensors: dict[str, torch.Tensor], dtype: Optional[torch.dtype] = None) -> int:
    """Bytes an adapter-only push moves (in ``dtype`` if given)."""
    return sum(t.numel() * (torch.empty((), dtype=dtype or t.dtype).element_size()) for t in tensors.values())
