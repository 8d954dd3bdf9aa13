"""Trainer side of weight sync: stream HF-named tensors to rollout servers bucket by bucket.

    pusher = WeightPusher(["http://127.0.0.1:30000", ...], transport="distributed", bucket_mb=256,
                          server_tp_sizes=[2, ...], api_key=key)
    pusher.connect()                       # /init_weights_update_group on every server + local join
    with pusher.session():                 # /begin_weight_update ... /end_weight_update on every server
        stats = pusher.push(named_tensors) # any iterable of (hf_name, full tensor)
    pusher.close()

A push must run inside a weight-update session (SGLang 0.5.23 refuses updates outside one). With
several sender ranks the driver opens the session once for all of them
(`megarl.sync.session.weight_update_session`); a lone pusher can use `pusher.session()`.

Transports
  distributed  one process group {this rank (0), server TP ranks}: server i's TP rank r is group
               rank `offset_i + r` with offset_0 = 1 and world `1 + sum(tp)` (SGLang's numbering).
               Per bucket, POST /update_weights_from_distributed (names/dtypes/shapes,
               load_format=flattened_bucket, megarl_checksums=[sum]) to all servers concurrently,
               broadcast the flat bucket ASYNCHRONOUSLY while watching the answers: a server that
               answers an error without joining (e.g. no session, unknown group) aborts the push at
               once instead of leaving this rank in a broadcast until the group timeout.  gloo on
               CPU, nccl on GPU.  `master_address` is the address the servers dial back: given by
               the caller, else this host's address on the route towards the first server.
  tensor       colocated: POST /update_weights_from_tensor, load_format=flattened_bucket, with ONE
               payload per server TP rank (SGLang's `deserialize_own_rank` reads entry tp_rank):
               {"flattened_tensor": the bucket, "metadata": [FlattenedTensorMetadata]} pickled by
               `megarl.wire.flattened` (CUDA IPC handle on GPU; shared memory, file_system strategy, on
               CPU) -- no bytes on the wire.
  disk         fallback: write one safetensors file per bucket (+ config.json, + per-tensor
               checksums) into `disk_dir`, then POST /update_weights_from_disk.

Several trainer ranks may push at once (one per pipeline stage, `megarl.sync.stage`): give each its
own `group_name` -- the embedded server receives different groups concurrently.  `push_megatron`
wires this to the stage's stream (`megarl.sync.stage.iter_stage_weights`).

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

import concurrent.futures
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Collection, ContextManager, Iterable, List, Optional, Sequence, Tuple
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from megarl.quant.served import BlockFp8Format
from megarl.rollout.client import LoopThread, RequestFailed, SGLangClient
from megarl.wire import flattened as wire
from megarl.wire.checksum import checksum
from megarl.wire.process_group import abandon_group, bound_store, destroy_group, init_custom_process_group, tcp
from megarl.wire.protocol import FLATTENED_BUCKET

from .bucket import Bucket, iter_buckets
from .session import SyncError, session_on

TRANSPORTS = ("distributed", "tensor", "disk")
__all__ = ["WeightPusher", "PushStats", "SyncError", "TRANSPORTS", "push_megatron", "is_sender_rank",
           "sender_group_name", "server_rank_offsets"]


def server_rank_offsets(server_tp_sizes: Sequence[int]) -> Tuple[List[int], int]:
    """SGLang's numbering of an update group: the trainer is rank 0, server i's TP rank r is
    `offsets[i] + r`; returns (offsets, world size)."""
    offsets, nxt = [], 1
    for tp in server_tp_sizes:
        if int(tp) < 1:
            raise ValueError(f"server TP size must be >= 1, got {tp}")
        offsets.append(nxt)
        nxt += int(tp)
    return offsets, nxt


def dial_back_address(server_urls: Sequence[str]) -> str:
    """The address of this host that the servers can dial back (the update group's master):
    `megarl.wire.addresses.node_address` towards the first server (Ray's node IP inside
    Ray; never gethostbyname(gethostname()), which is 127.0.1.1 on Debian-style hosts)."""
    from megarl.wire.addresses import node_address

    url = server_urls[0] if "://" in server_urls[0] else "http://" + server_urls[0]
    return node_address(peer=urlparse(url).hostname or "127.0.0.1")


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
                 backend: Optional[str] = None, master_address: Optional[str] = None, master_port: int = 0,
                 group_name: str = "megarl_weights", server_tp_sizes: Optional[Sequence[int]] = None,
                 disk_dir: Optional[str] = None, hf_config_dir: Optional[str] = None,
                 send_checksums: Optional[bool] = None, timeout_s: float = 600.0, sync_timing: bool = False,
                 api_key: Optional[str] = None, tensor_payloads: Optional["PayloadFn"] = None,
                 tensor_format: Optional[str] = FLATTENED_BUCKET, known_names: Optional[Collection[str]] = None,
                 served: Optional[BlockFp8Format] = None):
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
        self.master_port_used: Optional[int] = None   # the update group's port, once connected
        self.group_name = group_name
        self._group_base, self._generation = group_name, 0
        self.server_tp = [int(t) for t in (server_tp_sizes or [1] * len(self.servers))]
        if len(self.server_tp) != len(self.servers):
            raise ValueError(f"server_tp_sizes has {len(self.server_tp)} entries for {len(self.servers)} servers")
        self.rank_offsets, self.world_size = server_rank_offsets(self.server_tp)
        self.disk_dir = disk_dir
        self.hf_config_dir = hf_config_dir
        self.send_checksums = (transport != "tensor") if send_checksums is None else bool(send_checksums)
        self.sync_timing = sync_timing
        # tensor transport: how a bucket becomes one payload per TP rank of each server (default:
        # every rank of every server gets its own pickle of this process's buffer; colocated
        # TP>1 CUDA servers need a handle on each rank's own GPU: see `push_megatron`)
        self.tensor_payloads = tensor_payloads or local_payloads
        # flattened_bucket: one handle per bucket; None: SGLang's default list of (name, tensor)
        self.tensor_format = tensor_format
        # HF names the servers hold (their checkpoint's): a name outside them is refused HERE, before
        # any byte is sent -- SGLang 0.5.23 does not catch a load error on the tensor path and its
        # scheduler dies with it
        self.known_names = None if known_names is None else frozenset(known_names) | {"lm_head.weight"}
        # the served checkpoint's weight format (block FP8: quantized here, on the sending rank,
        # bucket by bucket; None: the trainer's tensors as they are)
        self.served = served
        self.timeout_s = timeout_s
        self.pg = None
        # a distributed push failed: the group may hold a half-done broadcast (gloo may even have
        # "completed" a small send to a server that never joined); the next push makes a new one
        self._poisoned: Optional[str] = None
        self._io = LoopThread()
        self._waiter = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="megarl-sync-wait")
        self.clients = [SGLangClient(u, timeout_s=timeout_s, retries=0, api_key=api_key) for u in self.servers]

    # ------------------------------------------------------------------ setup
    def _all(self, coro_fn) -> List[dict]:
        futs = [self._io.submit(coro_fn(c)) for c in self.clients]
        out, errs = [], []
        for c, f in zip(self.clients, futs):
            try:
                out.append(f.result(self.timeout_s))
            except RequestFailed as e:
                errs.append(f"{c.url}: {e.message}")
            except Exception as e:
                errs.append(f"{c.url}: {type(e).__name__}: {e}")
        if errs:
            raise SyncError("; ".join(errs))
        return out

    def connect(self) -> None:
        if self.transport != "distributed" or self.pg is not None:
            return
        backend = self.backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if self.master_address is None:
            self.master_address = dial_back_address(self.servers)
        store = None
        if self.master_port:
            port = self.master_port
        else:   # bound now, before the servers are told the port: nothing else can take it meanwhile
            store = bound_store(self.master_address, self.world_size, self.timeout_s)
            port = store.port
        self.master_port_used = port
        futs = [self._io.submit(c.init_weights_update_group(self.master_address, port, o, self.world_size,
                                                            self.group_name, backend))
                for c, o in zip(self.clients, self.rank_offsets)]
        # the rendezvous waits for every server rank; a server that refuses to join (bad group
        # args, unreachable master address) must fail this call, not hang it
        join = self._waiter.submit(
            init_custom_process_group, backend, tcp(self.master_address, port), self.world_size, 0,
            self.group_name, timedelta(seconds=self.timeout_s), store)
        errs = self._answers_while(join, futs)
        if errs:
            raise SyncError(f"init_weights_update_group (master {self.master_address}:{port}, world "
                            f"{self.world_size}) failed: " + "; ".join(errs))
        self.pg = join.result()
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")

    def session(self, timeout_s: float = 120.0) -> ContextManager[None]:
        """A weight-update session on this pusher's servers (for a lone sender rank)."""
        return session_on(self.clients, self._io, min(timeout_s, self.timeout_s))

    def _answers_while(self, pending: concurrent.futures.Future, answers: List[concurrent.futures.Future]) -> List[str]:
        """Wait for `pending` (a join or a broadcast) while watching the servers' HTTP answers:
        an error answer while `pending` is still running means a server will never join it.
        Returns the errors ([] once `pending` completed without one)."""
        deadline = time.monotonic() + self.timeout_s
        watch = {pending, *answers}
        while True:
            done, watch = concurrent.futures.wait(watch, timeout=max(deadline - time.monotonic(), 0),
                                                  return_when=concurrent.futures.FIRST_COMPLETED)
            errs = self._errors(answers)
            if errs:
                return errs
            if pending.done():
                e = pending.exception()
                return [f"this rank: {type(e).__name__}: {e}"] if e is not None else []
            if not done:
                return [f"no answer within {self.timeout_s:.0f}s"]

    def _errors(self, answers) -> List[str]:
        errs = []
        for c, f in zip(self.clients, answers):
            if not f.done() or f.exception() is None:
                continue
            e = f.exception()
            errs.append(f"{c.url}: {e.message if isinstance(e, RequestFailed) else f'{type(e).__name__}: {e}'}")
        return errs

    def _replace_group(self) -> None:
        """After a failed distributed push: leave the old group without destroying it locally (a
        destroy with an abandoned broadcast may hang), ask the servers to drop it (best effort), and
        connect a fresh one under a new name."""
        old = self.group_name
        abandon_group(self.pg)
        self.pg, self._poisoned = None, None
        futs = [self._io.submit(c.destroy_weights_update_group(old)) for c in self.clients]
        concurrent.futures.wait(futs, timeout=10)
        self._generation += 1
        self.group_name = f"{self._group_base}_g{self._generation}"

    def close(self) -> None:
        if self.pg is not None and self._poisoned:
            abandon_group(self.pg)   # a destroy with an abandoned broadcast in flight hangs: keep it aside
            self.pg = None
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
        self._waiter.shutdown(wait=False)

    # ------------------------------------------------------------------ push
    def push(self, named: Iterable[Tuple[str, torch.Tensor]], weight_version: Optional[str] = None) -> PushStats:
        if self._poisoned:
            self._replace_group()
        if self.transport == "distributed" and self.pg is None:
            self.connect()
        stats = PushStats(bucket_bytes=self.bucket_bytes)
        t0 = time.perf_counter()
        if self.transport == "disk":
            if os.path.isdir(self.disk_dir):
                shutil.rmtree(self.disk_dir)
            os.makedirs(self.disk_dir)
            self._disk_sums = {}
        if self.served is not None:
            named = self.served.stream(named)
        send = {"distributed": self._send_dist, "tensor": self._send_tensor, "disk": self._send_disk}[self.transport]
        it = iter_buckets(named, self.bucket_bytes, buffers=1 if self.transport == "disk" else 2,
                          with_checksum=self.send_checksums,
                          alloc=self._alloc if self.transport == "tensor" else None, timing_sync=self.sync_timing)
        inflight = None
        try:
            for i, b in enumerate(it):
                self._check_names(b, i)
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

    def _check_names(self, b: Bucket, i: int) -> None:
        if self.known_names is None:
            return
        unknown = [n for n in b.meta.names if n not in self.known_names]
        if unknown:
            more = f" (+{len(unknown) - 1} more)" if len(unknown) > 1 else ""
            raise SyncError(f"bucket {i}: {unknown[0]!r}{more} is not a weight of the served checkpoint; nothing of "
                            f"this bucket was sent to {', '.join(self.servers)}")

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
        done = self._completion(dist.broadcast(flat, src=0, group=self.pg, async_op=True))
        errs = self._answers_while(done, futs)
        if errs:
            first = b.meta.names[0] if b.meta.names else "?"
            # a server that received the bucket and then refused it answers about when the broadcast
            # completes here: only a broadcast still pending after a moment was really abandoned
            concurrent.futures.wait([done], timeout=min(2.0, self.timeout_s))
            when = "after receiving it"
            if not done.done():
                self._poisoned = f"bucket {i} ({first}, ...) abandoned mid-broadcast"
                when = "before the broadcast completed"
            raise SyncError(f"bucket {i} (first tensor {first}, {len(b.meta.names)} tensors) refused {when}: "
                            + "; ".join(errs))
        return futs

    def _completion(self, work) -> concurrent.futures.Future:
        """A future that completes when the broadcast `work` has really finished on this rank
        (for NCCL: when the device reached it, via an event recorded after it)."""
        if self.device.type == "cuda":
            work.wait()  # orders the current stream after the broadcast (does not block the host)
            event = torch.cuda.Event()
            event.record()
            return self._waiter.submit(event.synchronize)
        return self._waiter.submit(work.wait)

    def _collect(self, futs, i) -> List[dict]:
        out, errs = [], []
        for c, f in zip(self.clients, futs):
            try:
                out.append(f.result(self.timeout_s))
            except RequestFailed as e:
                errs.append(f"{c.url}: {e.message}")
            except Exception as e:
                errs.append(f"{c.url}: {type(e).__name__}: {e}")
        if errs:
            if self.transport == "distributed":
                self._poisoned = f"bucket {i} refused"
            raise SyncError(f"bucket {i} refused/failed: " + "; ".join(errs))
        return out

    def _send_tensor(self, b: Bucket, version, i) -> list:
        if b.flat.device.type == "cpu":
            import torch.multiprocessing

            torch.multiprocessing.set_sharing_strategy("file_system")
        payloads = self.tensor_payloads(b, self.server_tp, self.tensor_format)
        cs = [b.checksum] if self.send_checksums else None
        return [self._io.submit(c.update_weights_from_tensor(p, load_format=self.tensor_format, weight_version=version,
                                                             checksums=cs))
                for c, p in zip(self.clients, payloads)]

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
        # load_format explicitly: SGLang otherwise reuses the server's own launch format, and megarl
        # launches with --load-format dummy (tokenizer_manager.update_weights_from_disk)
        return self._all(lambda c: c.update_weights_from_disk(self.disk_dir, load_format="auto", weight_version=version))


PayloadFn = Callable[[Bucket, Sequence[int], Optional[str]], List[List[str]]]


def bucket_object(b: Bucket, tensor_format: Optional[str] = FLATTENED_BUCKET) -> Any:
    """What SGLang unpickles for one bucket: with flattened_bucket the flat uint8 tensor and its
    layout (one handle); with the default format (None) a list of (name, view) pairs."""
    if tensor_format == FLATTENED_BUCKET:
        return {"flattened_tensor": b.flat, "metadata": wire.flat_metadata(b.meta.entries, b.meta.dtype)}
    if tensor_format is None:
        return b.named_tensors()
    raise ValueError(f"tensor_format must be {FLATTENED_BUCKET!r} or None, got {tensor_format!r}")


def local_payloads(b: Bucket, server_tp: Sequence[int], tensor_format: Optional[str] = FLATTENED_BUCKET
                   ) -> List[List[str]]:
    """One payload per TP rank of every server, each a separate pickle of this process's buffer:
    sharing takes one reference (shm refcount / CUDA IPC ref counter) that exactly one receiving
    process releases when it rebuilds the tensor."""
    obj = bucket_object(b, tensor_format)
    return [[wire.dumps_b64(obj) for _ in range(tp)] for tp in server_tp]


def is_sender_rank(expert_senders: bool = False) -> bool:
    """Whether this megatron rank sends weights: its pipeline stage's sender (tp = dp = cp = 0 of
    the stage; `megarl.sync.stage`), one per stage, experts of the stage's EP ranks included; with
    ``expert_senders`` also each other EP rank's ETP0/EDP0 rank (its own experts)."""
    from .stage import is_expert_sender, is_stage_sender

    return is_stage_sender() or (expert_senders and is_expert_sender())


def sender_group_name(prefix: str = "megarl_weights", expert_senders: bool = False) -> str:
    """The update group of this rank's pipeline stage (at most one group per stage; with
    ``expert_senders`` one per stage and expert-parallel rank)."""
    from .stage import stage_group_name

    return stage_group_name(prefix, expert_senders)


def push_megatron(chunks, hf_config, pusher: Optional[WeightPusher], weight_version: Optional[str] = None,
                  bucket_mb: Optional[float] = None, expert_senders: bool = False) -> PushStats:
    """Collective over the trainer's ranks: every rank iterates its stage's stream
    (`megarl.sync.stage.iter_stage_weights`: TP/EP all-gathers and expert transfers in lockstep);
    the stage sender (the rank with a pusher) sends what it yields, the others yield nothing.
    `bucket_mb` (ranks without a pusher) sizes the expert transfer units like the sender's.
    ``expert_senders``: every EP rank's ETP0/EDP0 rank has a pusher and sends its own experts."""
    from .stage import iter_stage_weights

    bucket_bytes = pusher.bucket_bytes if pusher is not None else int((bucket_mb or 256) * (1 << 20))
    it = iter_stage_weights(chunks, bucket_bytes, expert_senders=expert_senders)
    if pusher is None:
        for _ in it:
            pass
        return PushStats()
    return pusher.push(it, weight_version=weight_version)
