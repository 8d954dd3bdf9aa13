"""What both ends of a push agree a bucket's bytes are: dtype names and the checksum.

Checksum ("megarl-sum64-v1", device-side, deterministic, no host copy):
  words = the first floor(L/8)*8 bytes viewed as int64 (little endian), tail = the last L%8 bytes
  s1 = sum(words)            (wrapping int64 arithmetic)
  s2 = sum(words * (i + 1))  (wrapping; i = word index, makes reordering visible)
  s3 = sum(tail[j] << (8*j))
  checksum = f"{L:x}-{s1 & M:016x}-{s2 & M:016x}-{s3:x}"   (M = 2**64 - 1)
Any single corrupted byte changes s1 (or s3), so a flipped bit is always detected.
Computed in a handful of kernels and ONE host sync: the words are viewed as an [R, C] matrix
(C = `_COLS`, a power of two) plus r < C leftover words; with rowsum/colsum of the matrix,
  s1 = sum(rowsum) + sum(leftover)
  s2 = C * sum_r r * rowsum_r + sum_c (c + 1) * colsum_c + sum_j leftover_j * (R*C + j + 1)
which is the same value mod 2**64 (every step is wrapping int64 arithmetic, on CPU and CUDA).
Scratch memory: R + 2*C words (~1.5 MiB for C = 2**16), never proportional to L.
"""
from __future__ import annotations

import torch

CHECKSUM_ALGO = "megarl-sum64-v1"
_M = (1 << 64) - 1
_COLS = 1 << 16  # columns of the word matrix (read at call time; tests shrink it)


def dtype_name(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "")


def dtype_from_name(name: str) -> torch.dtype:
    dt = getattr(torch, str(name).replace("torch.", ""), None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dt


def _as_bytes(flat: torch.Tensor) -> torch.Tensor:
    if not flat.is_contiguous():
        raise ValueError("checksum needs a contiguous tensor")
    return flat.reshape(-1).view(torch.uint8) if flat.dtype != torch.uint8 else flat.reshape(-1)


def checksum_parts(flat: torch.Tensor) -> torch.Tensor:
    """Device tensor [s1, s2, s3] (int64, wrapping) of a contiguous tensor's bytes; no host sync."""
    b = _as_bytes(flat)
    dev = b.device
    L = b.numel()
    nw = L // 8
    i64 = torch.int64
    s1 = torch.zeros((), dtype=i64, device=dev)
    s2 = torch.zeros((), dtype=i64, device=dev)
    if nw:
        words = b[: nw * 8].view(i64)
        C = _COLS
        R = nw // C
        if R:
            m = words[: R * C].view(R, C)
            rows = m.sum(1)
            cols = m.sum(0)
            s1 = rows.sum()
            s2 = (rows * torch.arange(R, dtype=i64, device=dev)).sum() * C \
                + (cols * torch.arange(1, C + 1, dtype=i64, device=dev)).sum()
        rest = words[R * C:]
        if rest.numel():
            s1 = s1 + rest.sum()
            s2 = s2 + (rest * torch.arange(R * C + 1, nw + 1, dtype=i64, device=dev)).sum()
    tail = b[nw * 8:]
    if tail.numel():
        s3 = (tail.to(i64) << (8 * torch.arange(tail.numel(), dtype=i64, device=dev))).sum()
    else:
        s3 = torch.zeros((), dtype=i64, device=dev)
    return torch.stack([s1, s2, s3])


def format_checksum(nbytes: int, parts) -> str:
    s1, s2, s3 = (int(v) for v in parts)
    return f"{nbytes:x}-{s1 & _M:016x}-{s2 & _M:016x}-{s3:x}"


def checksum(flat: torch.Tensor) -> str:
    """Checksum of a flat tensor's bytes (any dtype; contiguous).  See module doc."""
    return format_checksum(_as_bytes(flat).numel(), checksum_parts(flat).tolist())


def tensor_sha256(t: torch.Tensor) -> str:
    """SGLang's checksum of one LoRA adapter tensor (``expected_checksums`` of
    ``/load_lora_adapter_from_tensors``; ``tp_worker.py``): sha256 of its bytes, hex."""
    import hashlib

    return hashlib.sha256(t.detach().cpu().contiguous().flatten().view(torch.uint8).numpy().tobytes()).hexdigest()
