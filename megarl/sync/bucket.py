"""Flat weight buckets: layout, packing, checksum.

A bucket is ONE contiguous uint8 tensor holding HF-named tensors of a single dtype back to back
(no padding), in order.  That byte layout is exactly sglang's `load_format="flattened_bucket"`
(`sglang/srt/weight_sync/tensor_bucket.py`: tensor i occupies bytes
[start_idx, end_idx) of the flat tensor), so the same broadcast feeds a real sglang server and the
embedded one.  One dtype per bucket keeps every offset aligned to the element size, so each entry
is a zero-copy `flat[start:end].view(dtype).view(shape)`.

Checksum ("megarl-sum64-v1", device-side, deterministic, no host copy):
  words = the first floor(L/8)*8 bytes viewed as int64 (little endian), tail = the last L%8 bytes
  s1 = sum(words)            (wrapping int64 arithmetic)
  s2 = sum(words * (i + 1))  (wrapping; i = word index, makes reordering visible)
  s3 = sum(tail[j] << (8*j))
  checksum = f"{L:x}-{s1 & M:016x}-{s2 & M:016x}-{s3:x}"   (M = 2**64 - 1)
Any single corrupted byte changes s1 (or s3), so a flipped bit is always detected.  Computed in
chunks of 1 MiB, so it needs ~2 MiB of scratch memory.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Iterator, List, Optional, Sequence, Tuple

import torch

CHECKSUM_ALGO = "megarl-sum64-v1"
_M = (1 << 64) - 1
_CHUNK_WORDS = 1 << 17  # 1 MiB of int64 words


def dtype_name(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "")


def dtype_from_name(name: str) -> torch.dtype:
    dt = getattr(torch, str(name).replace("torch.", ""), None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dt


def checksum(flat: torch.Tensor) -> str:
    """Checksum of a flat tensor's bytes (any dtype; contiguous).  See module doc."""
    if not flat.is_contiguous():
        raise ValueError("checksum needs a contiguous tensor")
    b = flat.reshape(-1).view(torch.uint8) if flat.dtype != torch.uint8 else flat.reshape(-1)
    L = b.numel()
    nw = L // 8
    s1 = 0
    s2 = 0
    if nw:
        words = b[: nw * 8].view(torch.int64)
        acc1 = torch.zeros((), dtype=torch.int64, device=b.device)
        acc2 = torch.zeros((), dtype=torch.int64, device=b.device)
        for start in range(0, nw, _CHUNK_WORDS):
            w = words[start: start + _CHUNK_WORDS]
            idx = torch.arange(start + 1, start + 1 + w.numel(), dtype=torch.int64, device=b.device)
            acc1 += w.sum()
            acc2 += (w * idx).sum()
        s1, s2 = int(acc1.item()), int(acc2.item())
    s3 = 0
    for j, v in enumerate(b[nw * 8:].tolist()):
        s3 |= int(v) << (8 * j)
    return f"{L:x}-{s1 & _M:016x}-{s2 & _M:016x}-{s3:x}"


@dataclass
class Entry:
    name: str
    shape: Tuple[int, ...]
    start: int   # byte offset
    end: int     # byte offset (exclusive)


@dataclass
class BucketMeta:
    dtype: torch.dtype
    entries: List[Entry] = field(default_factory=list)
    nbytes: int = 0

    @property
    def names(self) -> List[str]:
        return [e.name for e in self.entries]

    @property
    def shapes(self) -> List[List[int]]:
        return [list(e.shape) for e in self.entries]

    @property
    def dtypes(self) -> List[str]:
        return [dtype_name(self.dtype)] * len(self.entries)

    @classmethod
    def from_fields(cls, names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]]) -> "BucketMeta":
        """Layout from sglang request fields (names/dtypes/shapes), entries back to back."""
        if not (len(names) == len(dtypes) == len(shapes)):
            raise ValueError("names, dtypes and shapes differ in length")
        dts = {dtype_name(dtype_from_name(d)) for d in dtypes}
        if len(dts) > 1:
            raise ValueError(f"a megarl bucket holds one dtype, got {sorted(dts)}")
        dt = dtype_from_name(dtypes[0]) if dtypes else torch.float32
        meta = cls(dtype=dt)
        esz = torch.empty((), dtype=dt).element_size()
        off = 0
        for n, s in zip(names, shapes):
            numel = 1
            for d in s:
                if int(d) < 0:
                    raise ValueError(f"negative dim in shape of {n}: {s}")
                numel *= int(d)
            meta.entries.append(Entry(n, tuple(int(d) for d in s), off, off + numel * esz))
            off += numel * esz
        meta.nbytes = off
        return meta

    def views(self, flat: torch.Tensor) -> List[Tuple[str, torch.Tensor]]:
        if flat.numel() != self.nbytes or flat.dtype != torch.uint8:
            raise ValueError(f"flat bucket has {flat.numel()} bytes ({flat.dtype}), layout needs {self.nbytes} uint8")
        return [(e.name, flat[e.start:e.end].view(self.dtype).view(e.shape)) for e in self.entries]


@dataclass
class Bucket:
    meta: BucketMeta
    flat: torch.Tensor   # uint8, contiguous
    checksum: str

    def named_tensors(self) -> List[Tuple[str, torch.Tensor]]:
        return self.meta.views(self.flat)


def pack(named: Sequence[Tuple[str, torch.Tensor]], out: Optional[torch.Tensor] = None) -> Bucket:
    """Copy same-dtype tensors into one flat uint8 buffer (reusing `out` when big enough)."""
    if not named:
        raise ValueError("empty bucket")
    dt = named[0][1].dtype
    meta = BucketMeta.from_fields([n for n, _ in named], [dtype_name(t.dtype) for _, t in named],
                                  [list(t.shape) for _, t in named])
    dev = named[0][1].device
    if out is not None and out.numel() >= meta.nbytes and out.device == dev:
        flat = out[: meta.nbytes]
    else:
        flat = torch.empty(meta.nbytes, dtype=torch.uint8, device=dev)
    for e, (_, t) in zip(meta.entries, named):
        flat[e.start:e.end].view(dt).view(e.shape).copy_(t)
    return Bucket(meta, flat, checksum(flat))


def iter_buckets(named: Iterable[Tuple[str, torch.Tensor]], bucket_bytes: int,
                 reuse: bool = True) -> Iterator[Bucket]:
    """Group a stream of (hf_name, tensor) into buckets of at most `bucket_bytes` (a tensor larger
    than that gets a bucket of its own), one dtype per bucket, in stream order.

    Memory: holds the tensors of at most one pending bucket plus one flat buffer (reused across
    buckets when `reuse`; the caller must be done with a yielded bucket before advancing)."""
    pending: List[Tuple[str, torch.Tensor]] = []
    size = 0
    buf: Optional[torch.Tensor] = None

    def flush():
        nonlocal pending, size, buf
        b = pack(pending, out=buf if reuse else None)
        if reuse and (buf is None or b.flat.numel() > buf.numel()) and b.meta.nbytes <= bucket_bytes:
            buf = b.flat if buf is None or b.flat.numel() > buf.numel() else buf
        pending, size = [], 0
        return b

    for name, t in named:
        t = t.detach()
        if not t.is_contiguous():
            t = t.contiguous()
        nb = t.numel() * t.element_size()
        if pending and (size + nb > bucket_bytes or t.dtype != pending[0][1].dtype or t.device != pending[0][1].device):
            yield flush()
        pending.append((name, t))
        size += nb
    if pending:
        yield flush()
