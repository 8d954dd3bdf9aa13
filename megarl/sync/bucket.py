"""Flat weight buckets: layout, packing, checksum.

A bucket is ONE contiguous uint8 tensor holding HF-named tensors of a single dtype back to back
(no padding), in order.  That byte layout is exactly sglang's `load_format="flattened_bucket"`
(`sglang/srt/weight_sync/tensor_bucket.py`: tensor i occupies bytes
[start_idx, end_idx) of the flat tensor), so the same broadcast feeds a real sglang server and the
embedded one.  One dtype per bucket keeps every offset aligned to the element size, so each entry
is a zero-copy `flat[start:end].view(dtype).view(shape)`.

Checksum: `megarl.wire.checksum` (both ends compute it).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch

from megarl.wire.checksum import checksum, dtype_from_name, dtype_name


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
    checksum: Optional[str]          # None when packed with with_checksum=False
    pack_s: float = 0.0              # wall seconds copying tensors into `flat`
    checksum_s: float = 0.0          # wall seconds computing the checksum (incl. its host sync)
    held_bytes: int = 0              # bytes the iterator held when yielding (buffers + tensors)

    def named_tensors(self) -> List[Tuple[str, torch.Tensor]]:
        return self.meta.views(self.flat)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _finish(meta: BucketMeta, flat: torch.Tensor, with_checksum: bool, pack_s: float, timing_sync: bool,
            held: int) -> Bucket:
    t = time.perf_counter()
    if timing_sync:
        _sync(flat.device)
        pack_s += time.perf_counter() - t
        t = time.perf_counter()
    cs = checksum(flat) if with_checksum else None
    return Bucket(meta, flat, cs, pack_s=pack_s, checksum_s=time.perf_counter() - t if with_checksum else 0.0,
                  held_bytes=held)


def pack(named: Sequence[Tuple[str, torch.Tensor]], out: Optional[torch.Tensor] = None,
         with_checksum: bool = True) -> Bucket:
    """Copy same-dtype tensors into one flat uint8 buffer (reusing `out` when big enough)."""
    if not named:
        raise ValueError("empty bucket")
    t0 = time.perf_counter()
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
    return _finish(meta, flat, with_checksum, time.perf_counter() - t0, False, meta.nbytes)


Alloc = Callable[[int, torch.device], torch.Tensor]


def _default_alloc(nbytes: int, dev: torch.device) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, device=dev)


def iter_buckets(named: Iterable[Tuple[str, torch.Tensor]], bucket_bytes: int, reuse: bool = True,
                 buffers: Optional[int] = None, with_checksum: bool = True, alloc: Optional[Alloc] = None,
                 timing_sync: bool = False) -> Iterator[Bucket]:
    """Group a stream of (hf_name, tensor) into buckets of at most `bucket_bytes`, one dtype (and
    device) per bucket, in stream order.  Each tensor is copied into the open bucket's flat buffer
    as soon as it arrives (offsets are back to back, so the layout is known incrementally); a
    tensor larger than `bucket_bytes` becomes a bucket of its own WITHOUT a copy (its own bytes).

    Buffers: `buffers` flat buffers of `bucket_bytes` each, used in turn (default 1 when `reuse`,
    else 0 = an exact-size copy per bucket that the caller may keep, packed through one scratch
    buffer).  With n buffers, bucket k's buffer is written
    again when the caller advances past bucket k+n-1: the caller must be done with bucket k by then
    (n=1: done with a bucket before advancing; n=2: bucket k+1 is packed while bucket k is still
    in use -- double buffering).  `alloc(nbytes, device)` makes a buffer (e.g. in shared memory).

    Memory: the buffers plus at most one tensor held between buckets (the one that did not fit,
    or a big tensor sent as its own bucket); `Bucket.held_bytes` reports it at each yield.
    `timing_sync` synchronizes the device after packing so `Bucket.pack_s` is the real copy time
    (CUDA copies are asynchronous otherwise)."""
    nbuf = (1 if reuse else 0) if buffers is None else int(buffers)
    alloc = alloc or _default_alloc
    # nbuf == 0 packs through one scratch buffer and hands out an exact-size copy per bucket
    ring: List[Optional[torch.Tensor]] = [None] * max(nbuf, 1)
    turn = 0
    cap = int(bucket_bytes)
    # the open bucket
    buf: Optional[torch.Tensor] = None
    entries: List[Entry] = []
    dtype = None
    device = None
    off = 0
    pack_s = 0.0

    def ring_bytes() -> int:
        return sum(b.numel() for b in ring if b is not None)

    def close(held: int) -> Bucket:
        nonlocal buf, entries, off, pack_s
        meta = BucketMeta(dtype=dtype, entries=entries, nbytes=off)
        flat = buf[:off]
        if not nbuf:  # independent buckets: the caller may keep every one
            t0 = time.perf_counter()
            flat = flat.clone()
            pack_s += time.perf_counter() - t0
        out = _finish(meta, flat, with_checksum, pack_s, timing_sync,
                      held + ring_bytes() + (0 if nbuf else off))
        buf, entries, off, pack_s = None, [], 0, 0.0
        return out

    for name, t in named:
        t = t.detach()
        if not t.is_contiguous():
            t = t.contiguous()
        nb = t.numel() * t.element_size()
        if entries and (off + nb > cap or t.dtype != dtype or t.device != device):
            yield close(nb)
        if not entries and nb > cap:
            # a bucket of its own, zero copy: the tensor's own bytes are the flat bucket
            meta = BucketMeta(dtype=t.dtype, entries=[Entry(name, tuple(t.shape), 0, nb)], nbytes=nb)
            yield _finish(meta, t.reshape(-1).view(torch.uint8), with_checksum, 0.0, False,
                          nb + (ring_bytes() if nbuf else 0))
            continue
        if not entries:
            dtype, device = t.dtype, t.device
            b = ring[turn]
            if b is None or b.device != device or b.numel() < cap:
                ring[turn] = None
                b = ring[turn] = alloc(cap, device)
            buf = b
            turn = (turn + 1) % len(ring)
        entries.append(Entry(name, tuple(t.shape), off, off + nb))
        t0 = time.perf_counter()
        buf[off:off + nb].view(t.dtype).view(t.shape).copy_(t)
        pack_s += time.perf_counter() - t0
        off += nb
    if entries:
        yield close(0)
