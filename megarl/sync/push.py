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

Pipelining and memory: tensors are copied into one of two flat buffers of `bucket_mb` each as they
arrive (double buffering: bucket i+1 is packed while the servers verify/apply bucket i; bucket i+1
is only sent once bucket i was answered, so a refusal still stops at the refused bucket); a tensor
larger than a bucket is sent as its own bucket without a copy.  Extra memory on this rank: the
2 buffers (1 for disk) plus at most one tensor held between buckets; `PushStats.peak_extra_bytes`
reports it.  A refused bucket raises `SyncError` (servers kept their old weights for that bucket;
buckets before it were applied: push again).

Timing: `PushStats.pack_s / checksum_s / send_s` are this thread's wall seconds per phase, summed
over buckets (send_s = posting a bucket plus waiting for the previous one's answers; with CUDA,
copies are asynchronous, so without `sync_timing=True` their GPU time shows up in the next phase
that waits); `server_s` sums the embedded servers' own `megarl_timings` (receive / verify / apply).
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

from .bucket import Bucket, BucketMeta, checksum, dtype_name, iter_buckets
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
    peak_extra_bytes: int = 0     # flat buffers + tensors held by the pusher between buckets
    bucket_bytes: int = 0
    pack_s: float = 0.0           # copying tensors into flat buffers
    checksum_s: float = 0.0       # trainer-side checksums (0 when not sent)
    send_s: float = 0.0           # posting buckets + waiting for the servers' answers
    server_s: dict = field(default_factory=dict)   # servers' megarl_timings, summed
    responses: List[dict] = field(default_factory=list)

    @property
    def bytes_per_s(self) -> float:
        return self.bytes / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict:
        return {"bytes": self.bytes, "tensors": self.tensors, "buckets": self.buckets, "seconds": self.seconds,
                "bytes_per_s": self.bytes_per_s, "peak_extra_bytes": self.peak_extra_bytes,
                "bucket_bytes": self.bucket_bytes, "pack_s": self.pack_s, "checksum_s": self.checksum_s,
                "send_s": self.send_s, **{f"server_{k}": v for k, v in self.server_s.items()}}


class WeightPusher:
    """Streams weights to rollout servers (see module doc).

    send_checksums: None (default) = on for the "distributed" and "disk" transports (the bytes cross
    a process group or a file) and OFF for "tensor": there the server reads this process's own
    buffer (CUDA IPC handle / shared memory), no byte is copied on the way, so a checksum would
    only re-read the same memory twice per bucket.  True/False force it either way.
    sync_timing: synchronize the device after each phase so the PushStats breakdown is exact
    (costs a sync per bucket; for benchmarks)."""

    def __init__(self, servers: Sequence[str], transport: str = "distributed", bucket_mb: float = 256,
                 backend: Optional[str] = None, master_address: str = "127.0.0.1", master_port: int = 0,
                 group_name: str = "megarl_weights", server_tp_sizes: Optional[Sequence[int]] = None,
                 disk_dir: Optional[str] = None, hf_config_dir: Optional[str] = None,
                 send_checksums: Optional[bool] = None, timeout_s: float = 600.0, sync_timing: bool = False):
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
        self.send_checksums = (transport != "tensor") if send_checksums is None else bool(send_checksums)
        self.sync_timing = sync_timing
        self._flat_format: Optional[bool] = None  # tensor transport: all servers embedded -> one flat tensor
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
        if self.transport == "tensor" and self._flat_format is None:
            infos = self._all(lambda c: c.get_model_info())
            self._flat_format = all(isinstance(d, dict) and d.get("megarl_engine") == "embedded" for d in infos)
        stats = PushStats(bucket_bytes=self.bucket_bytes)
        t0 = time.perf_counter()
        if self.transport == "disk":
            if os.path.isdir(self.disk_dir):
                shutil.rmtree(self.disk_dir)
            os.makedirs(self.disk_dir)
            self._disk_sums = {}
        send = {"distributed": self._send_dist, "tensor": self._send_tensor, "disk": self._send_disk}[self.transport]
        it = iter_buckets(named, self.bucket_bytes, buffers=1 if self.transport == "disk" else 2,
                          with_checksum=self.send_checksums,
                          alloc=self._alloc if self.transport == "tensor" else None, timing_sync=self.sync_timing)
        inflight = None
        try:
            for i, b in enumerate(it):
                stats.pack_s += b.pack_s
                stats.checksum_s += b.checksum_s
                stats.peak_extra_bytes = max(stats.peak_extra_bytes, b.held_bytes)
                ts = time.perf_counter()
                if inflight is not None:
                    prev, inflight = inflight, None
                    self._wait(prev, stats)          # bucket i-1 answered: its buffer is free again
                inflight = (send(b, weight_version, i), i)
                stats.send_s += time.perf_counter() - ts
                stats.bytes += b.meta.nbytes
                stats.tensors += len(b.meta.entries)
                stats.buckets += 1
            if inflight is not None:
                ts = time.perf_counter()
                last, inflight = inflight, None
                self._wait(last, stats)
                stats.send_s += time.perf_counter() - ts
        finally:
            if inflight is not None:
                # failing elsewhere (e.g. the source) with a bucket in flight: let the servers
                # finish reading it before its buffer is released
                for f in inflight[0]:
                    try:
                        f.result(self.timeout_s)
                    except Exception:
                        pass
            it.close()
        if self.transport == "disk" and stats.buckets:
            stats.responses.extend(self._finish_disk(weight_version))
        stats.seconds = time.perf_counter() - t0
        return stats

    def _wait(self, inflight, stats: PushStats) -> None:
        futs, i = inflight
        out = self._collect(futs, i)
        for r in out:
            for k, v in ((r.get("megarl_timings") or {}) if isinstance(r, dict) else {}).items():
                stats.server_s[k] = stats.server_s.get(k, 0.0) + float(v)
        stats.responses.extend(out)

    def _alloc(self, nbytes: int, dev: torch.device) -> torch.Tensor:
        if dev.type == "cpu":
            # born in shared memory: pickling for the server then moves no bytes
            import torch.multiprocessing as tmp
            tmp.set_sharing_strategy("file_system")
            return torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage._new_shared(nbytes))
        return torch.empty(nbytes, dtype=torch.uint8, device=dev)

    def _send_dist(self, b: Bucket, version, i) -> list:
        flat = b.flat if b.flat.device == self.device else b.flat.to(self.device)
        cs = [b.checksum] if self.send_checksums else None
        futs = [self._io.submit(c.update_weights_from_distributed(
            b.meta.names, b.meta.dtypes, b.meta.shapes, group_name=self.group_name, load_format=FLATTENED_BUCKET,
            weight_version=version, checksums=cs, flush_cache=True)) for c in self.clients]
        dist.broadcast(flat, src=0, group=self.pg)
        return futs

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

    def _send_tensor(self, b: Bucket, version, i) -> list:
        from multiprocessing.reduction import ForkingPickler

        import torch.multiprocessing  # noqa: F401  (registers tensor reductions)
        if b.flat.device.type == "cpu":
            torch.multiprocessing.set_sharing_strategy("file_system")
        if self._flat_format:
            # embedded servers: ONE tensor (one IPC handle / shm segment) + the layout
            obj, load_format = {"flattened_tensor": b.flat, "metadata": _flat_metadata(b.meta)}, FLATTENED_BUCKET
        else:
            # sglang's default format: a list of (name, tensor)
            obj, load_format = b.named_tensors(), None

        def payload() -> str:
            # one pickle per receiving process: sharing takes a reference (shm refcount / CUDA IPC
            # ref counter) that the receiver releases when it rebuilds the tensor, exactly once
            buf = io.BytesIO()
            ForkingPickler(buf).dump(obj)
            return base64.b64encode(buf.getvalue()).decode()
        cs = [b.checksum] if self.send_checksums else None
        return [self._io.submit(c.update_weights_from_tensor([payload() for _ in range(tp)], load_format=load_format,
                                                             weight_version=version, checksums=cs))
                for c, tp in zip(self.clients, self.server_tp)]

    def _send_disk(self, b: Bucket, version, i) -> list:
        from safetensors.torch import save_file
        tensors = {n: t.to("cpu").contiguous() for n, t in b.named_tensors()}
        fn = os.path.join(self.disk_dir, f"model-{i:05d}.safetensors")
        save_file(tensors, fn)
        if self.send_checksums:
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


def _flat_metadata(meta: BucketMeta) -> List[dict]:
    """sglang flattened_bucket metadata fields, as plain dicts (what the embedded server reads)."""
    dt = dtype_name(meta.dtype)
    return [{"name": e.name, "shape": list(e.shape), "dtype": dt, "start_idx": e.start, "end_idx": e.end,
             "numel": (e.end - e.start) // max(meta.dtype.itemsize, 1)} for e in meta.entries]


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
