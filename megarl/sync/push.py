"""Trainer side of weight sync: stream HF-named tensors to rollout servers bucket by bucket.

    pusher = WeightPusher(["http://127.0.0.1:30000", ...], transport="distributed", bucket_mb=256)
    pusher.connect()                       # /init_weights_update_group on every server + local join
    stats = pusher.push(named_tensors)     # any iterable of (hf_name, full tensor)
    pusher.close()

Transports
  distributed  one process group {this rank (0), server ranks 1..}: per bucket, POST
               /update_weights_from_distributed (names/dtypes/shapes, load_format=flattened_bucket,
               megarl_checksums=[sum]) to all servers concurrently, broadcast the flat bucket, wait
               for every answer.  gloo on CPU, nccl on GPU.  Works with real sglang (>= 0.5.x).
  tensor       colocated: POST /update_weights_from_tensor with the bucket's tensors pickled by
               torch's multiprocessing reductions (CUDA IPC handles on GPU; shared memory,
               file_system strategy, on CPU) -- no bytes on the wire.
  disk         fallback: write one safetensors file per bucket (+ config.json, + per-tensor
               checksums) into `disk_dir`, then POST /update_weights_from_disk.

Several trainer ranks may push at once (one PP stage each, one EP rank each): give each its own
`group_name` -- the embedded server receives different groups concurrently.  `push_megatron`
wires this to `megarl.models.iter_hf_weights`.

Memory: the bucket iterator holds at most one bucket of pending full tensors plus one flat
buffer (reused), i.e. ~2 buckets; `PushStats.peak_extra_bytes` reports what this rank held.
A refused bucket raises `SyncError` (servers kept their old weights for that bucket; buckets
before it were applied: push again).
"""
from __future__ import annotations

import base64
import io
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from typing import Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megarl.rollout.client import LoopThread, RequestFailed, SGLangClient
from megarl.rollout.protocol import FLATTENED_BUCKET

from .bucket import Bucket, checksum, iter_buckets
from .groups import destroy_group, init_custom_process_group, tcp

TRANSPORTS = ("distributed", "tensor", "disk")


class SyncError(RuntimeError):
    pass


@dataclass
class PushStats:
    bytes: int = 0
    tensors: int = 0
    buckets: int = 0
    seconds: float = 0.0
    peak_extra_bytes: int = 0     # bytes of pending tensors + flat buffer held by the pusher
    bucket_bytes: int = 0
    responses: List[dict] = field(default_factory=list)

    @property
    def bytes_per_s(self) -> float:
        return self.bytes / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict:
        return {"bytes": self.bytes, "tensors": self.tensors, "buckets": self.buckets, "seconds": self.seconds,
                "bytes_per_s": self.bytes_per_s, "peak_extra_bytes": self.peak_extra_bytes,
                "bucket_bytes": self.bucket_bytes}



class _Tracked:
    """Wraps the (name, tensor) stream to account bytes held by the pusher (pending + buffer)."""

    def __init__(self, it, stats: PushStats):
        self.it, self.stats, self.pending = it, stats, 0

    def __iter__(self):
        for name, t in self.it:
            self.pending += t.numel() * t.element_size()
            yield name, t


class WeightPusher:
    def __init__(self, servers: Sequence[str], transport: str = "distributed", bucket_mb: float = 256,
                 backend: Optional[str] = None, master_address: str = "127.0.0.1", master_port: int = 0,
                 group_name: str = "megarl_weights", server_tp_sizes: Optional[Sequence[int]] = None,
                 disk_dir: Optional[str] = None, hf_config_dir: Optional[str] = None,
                 send_checksums: bool = True, timeout_s: float = 600.0):
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        if transport == "disk" and not disk_dir:
            raise ValueError("transport 'disk' needs disk_dir")
        self.servers = list(servers)
        self.transport = transport
        self.bucket_bytes = int(bucket_mb * (1 << 20))
        self.backend = backend
        self.master_address = master_address
        self.master_port = master_port
        self.group_name = group_name
        self.server_tp = list(server_tp_sizes or [1] * len(self.servers))
        self.disk_dir = disk_dir
        self.hf_config_dir = hf_config_dir
        self.send_checksums = send_checksums
        self.timeout_s = timeout_s
        self.pg = None
        self._io = LoopThread()
        self.clients = [SGLangClient(u, timeout_s=timeout_s, retries=0) for u in self.servers]

    # ------------------------------------------------------------------ setup
    def _all(self, coro_fn) -> List[dict]:
        futs = [self._io.submit(coro_fn(c)) for c in self.clients]
        out, errs = [], []
        for c, f in zip(self.clients, futs):
            try:
                out.append(f.result(self.timeout_s))
            except RequestFailed as e:
                errs.append(f"{c.url}: {e.body if isinstance(e.body, str) else e.body.get('message', e.body)}")
            except Exception as e:
                errs.append(f"{c.url}: {type(e).__name__}: {e}")
        if errs:
            raise SyncError("; ".join(errs))
        return out

    def connect(self) -> None:
        if self.transport != "distributed" or self.pg is not None:
            return
        backend = self.backend or ("nccl" if torch.cuda.is_available() else "gloo")
        from megarl.parallel.launcher import free_port

        port = self.master_port or free_port("")
        world = 1 + sum(self.server_tp)
        offsets, off = [], 1
        for tp in self.server_tp:
            offsets.append(off)
            off += tp
        futs = [self._io.submit(c.init_weights_update_group(self.master_address, port, o, world, self.group_name, backend))
                for c, o in zip(self.clients, offsets)]
        self.pg = init_custom_process_group(backend, tcp(self.master_address, port), world, 0, self.group_name)
        errs = []
        for c, f in zip(self.clients, futs):
            try:
                f.result(self.timeout_s)
            except Exception as e:
                errs.append(f"{c.url}: {e}")
        if errs:
            raise SyncError("init_weights_update_group failed: " + "; ".join(errs))
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")

    def close(self) -> None:
        if self.pg is not None:
            try:
                self._all(lambda c: c.destroy_weights_update_group(self.group_name))
            except Exception:
                pass
            destroy_group(self.pg)
            self.pg = None
        for c in self.clients:
            try:
                self._io.run(c.close(), timeout=5)
            except Exception:
                pass
        self._io.close()

    # ------------------------------------------------------------------ push
    def push(self, named: Iterable[Tuple[str, torch.Tensor]], weight_version: Optional[str] = None) -> PushStats:
        if self.transport == "distributed" and self.pg is None:
            self.connect()
        stats = PushStats(bucket_bytes=self.bucket_bytes)
        t0 = time.perf_counter()
        tracked = _Tracked(named, stats)
        buf_bytes = 0
        if self.transport == "disk":
            if os.path.isdir(self.disk_dir):
                shutil.rmtree(self.disk_dir)
            os.makedirs(self.disk_dir)
            self._disk_sums = {}
        for i, b in enumerate(iter_buckets(tracked, self.bucket_bytes, reuse=self.transport != "tensor")):
            buf_bytes = max(buf_bytes, b.meta.nbytes)
            stats.peak_extra_bytes = max(stats.peak_extra_bytes, tracked.pending + buf_bytes)
            tracked.pending = 0
            send = {"distributed": self._send_dist, "tensor": self._send_tensor, "disk": self._send_disk}[self.transport]
            stats.responses.extend(send(b, weight_version, i))
            stats.bytes += b.meta.nbytes
            stats.tensors += len(b.meta.entries)
            stats.buckets += 1
        if self.transport == "disk" and stats.buckets:
            stats.responses.extend(self._finish_disk(weight_version))
        stats.seconds = time.perf_counter() - t0
        return stats

    def _send_dist(self, b: Bucket, version, i) -> List[dict]:
        flat = b.flat if b.flat.device == self.device else b.flat.to(self.device)
        cs = [b.checksum] if self.send_checksums else None
        futs = [self._io.submit(c.update_weights_from_distributed(
            b.meta.names, b.meta.dtypes, b.meta.shapes, group_name=self.group_name, load_format=FLATTENED_BUCKET,
            weight_version=version, checksums=cs, flush_cache=True)) for c in self.clients]
        dist.broadcast(flat, src=0, group=self.pg)
        return self._collect(futs, i)

    def _collect(self, futs, i) -> List[dict]:
        out, errs = [], []
        for c, f in zip(self.clients, futs):
            try:
                out.append(f.result(self.timeout_s))
            except RequestFailed as e:
                msg = e.body.get("message", e.body) if isinstance(e.body, dict) else e.body
                errs.append(f"{c.url}: {msg}")
            except Exception as e:
                errs.append(f"{c.url}: {type(e).__name__}: {e}")
        if errs:
            raise SyncError(f"bucket {i} refused/failed: " + "; ".join(errs))
        return out

    def _send_tensor(self, b: Bucket, version, i) -> List[dict]:
        from multiprocessing.reduction import ForkingPickler

        import torch.multiprocessing  # noqa: F401  (registers tensor reductions)
        if b.flat.device.type == "cpu":
            torch.multiprocessing.set_sharing_strategy("file_system")
        buf = io.BytesIO()
        ForkingPickler(buf).dump(b.named_tensors())
        payload = base64.b64encode(buf.getvalue()).decode()
        cs = [b.checksum] if self.send_checksums else None
        futs = [self._io.submit(c.update_weights_from_tensor([payload] * tp, weight_version=version, checksums=cs))
                for c, tp in zip(self.clients, self.server_tp)]
        return self._collect(futs, i)

    def _send_disk(self, b: Bucket, version, i) -> List[dict]:
        from safetensors.torch import save_file
        tensors = {n: t.to("cpu").contiguous() for n, t in b.named_tensors()}
        fn = os.path.join(self.disk_dir, f"model-{i:05d}.safetensors")
        save_file(tensors, fn)
        for n, t in tensors.items():
            self._disk_sums[n] = checksum(t)
        return []

    def _finish_disk(self, version) -> List[dict]:
        with open(os.path.join(self.disk_dir, "megarl_checksums.json"), "w") as f:
            json.dump(self._disk_sums, f)
        if self.hf_config_dir:
            for fn in ("config.json", "generation_config.json"):
                src = os.path.join(self.hf_config_dir, fn)
                if os.path.exists(src):
                    shutil.copy(src, self.disk_dir)
        return self._all(lambda c: c.update_weights_from_disk(self.disk_dir, weight_version=version))


def is_sender_rank() -> bool:
    """Whether this megatron rank yields tensors from `iter_hf_weights` (see its docstring)."""
    from megatron.core import parallel_state as mpu
    dense = mpu.get_tensor_model_parallel_rank() == 0 and mpu.get_data_parallel_rank(with_context_parallel=True) == 0
    try:
        expert = mpu.get_expert_tensor_parallel_rank() == 0 and mpu.get_expert_data_parallel_rank() == 0
    except Exception:
        expert = False
    return dense or expert


def sender_group_name(prefix: str = "megarl_weights") -> str:
    """One update group per sender rank: distinct names so senders stream concurrently."""
    return f"{prefix}_r{dist.get_rank() if dist.is_initialized() else 0}"


def push_megatron(chunks, hf_config, pusher: Optional[WeightPusher], weight_version: Optional[str] = None) -> PushStats:
    """Collective over the trainer's model-parallel ranks: every rank iterates
    `megarl.models.iter_hf_weights` (TP/EP all-gathers run in lockstep); ranks with a pusher send
    what they yield, the others discard it (they yield nothing anyway)."""
    from megarl.models import iter_hf_weights
    it = iter_hf_weights(chunks, hf_config)
    if pusher is None:
        for _ in it:
            pass
        return PushStats()
    return pusher.push(it, weight_version=weight_version)
