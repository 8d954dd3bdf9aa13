"""Per-tensor checksum manifests (HF names, full tensors) written on convert/save, checked on load.

A manifest is ``{"format": 1, "tensors": {hf_name: {"shape": [...], "dtype": "float32",
"sha256": "..."}}}``. Checks name every missing, extra or mismatching tensor — a converter that
drops experts, or a checkpoint with a corrupted / removed tensor, is refused by name.
"""
from __future__ import annotations

import hashlib
import json
import pathlib
from typing import Dict, Iterable, Tuple

import torch

MANIFEST_NAME = "megarl_manifest.json"


class CheckpointVerificationError(RuntimeError):
    """Missing, extra or corrupted tensors; ``.missing``, ``.extra``, ``.mismatched`` list names."""

    def __init__(self, missing=(), extra=(), mismatched=(), where=""):
        self.missing, self.extra, self.mismatched = list(missing), list(extra), list(mismatched)
        parts = []
        for label, names in (("missing", self.missing), ("extra", self.extra),
                             ("checksum/shape mismatch", self.mismatched)):
            if names:
                shown = ", ".join(names[:20]) + (f" (+{len(names) - 20} more)" if len(names) > 20 else "")
                parts.append(f"{label} tensor(s): {shown}")
        super().__init__(f"checkpoint verification failed{(' for ' + where) if where else ''}: "
                         + "; ".join(parts))


def tensor_digest(t: torch.Tensor) -> str:
    t = t.detach().contiguous().cpu()
    if t.numel() == 0:
        return hashlib.sha256(b"").hexdigest()
    return hashlib.sha256(t.view(-1).view(torch.uint8).numpy().data).hexdigest()


def entry(t: torch.Tensor) -> dict:
    return {"shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", ""), "sha256": tensor_digest(t)}


def build(named_tensors: Iterable[Tuple[str, torch.Tensor]]) -> Dict[str, dict]:
    out: Dict[str, dict] = {}
    for n, t in named_tensors:
        if n in out:
            raise ValueError(f"tensor {n!r} produced twice")
        out[n] = entry(t)
    return out


def compare(expected: Dict[str, dict], actual: Dict[str, dict], where: str = "",
            ignore_dtype: bool = False) -> None:
    missing = sorted(set(expected) - set(actual))
    extra = sorted(set(actual) - set(expected))
    bad = []
    for n in sorted(set(expected) & set(actual)):
        e, a = expected[n], actual[n]
        if list(e["shape"]) != list(a["shape"]):
            bad.append(n)
        elif ignore_dtype and e["dtype"] != a["dtype"]:
            continue
        elif e["sha256"] != a["sha256"] or e["dtype"] != a["dtype"]:
            bad.append(n)
    if missing or extra or bad:
        raise CheckpointVerificationError(missing, extra, bad, where)


def write(path, tensors: Dict[str, dict], **meta) -> None:
    path = pathlib.Path(path)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as f:
        json.dump({"format": 1, **meta, "tensors": dict(sorted(tensors.items()))}, f, indent=1)
    tmp.replace(path)


def read(path) -> Dict[str, dict]:
    with open(path) as f:
        return json.load(f)["tensors"]


def hf_folder_manifest(hf_dir, progress=None) -> Dict[str, dict]:
    """Checksums of every tensor in an HF safetensors folder, read file by file."""
    from megarl.models.naming import SafetensorsSource
    src = SafetensorsSource(hf_dir)
    out = {}
    for n, t in src.read(src.names()):
        out[n] = entry(t)
        del t
    return out
