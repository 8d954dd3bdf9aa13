"""Server side of weight updates: receive, verify, then swap -- or refuse and keep the old weights.

Receiving and verifying run on a per-group worker thread (so decoding goes on while a bucket
arrives, and several trainer senders -- one group each, e.g. one per PP stage / EP rank -- can
stream at once without waiting on each other); only `apply` (the copy into the live parameters)
runs on the engine thread between decode steps (`Engine.control`).
Verification happens before a single parameter is touched:
  * every name must be a weight of the served model (tied `lm_head.weight` is skipped, as sglang
    does), every shape must match, the dtype must be a float dtype (cast to the model dtype);
  * the bucket checksum (megarl extension field `megarl_checksums`) must match the received bytes;
  * every value must be finite: ONE fp32-accumulated sum over the whole bucket (one host sync),
    and only when that is not finite a per-tensor pass to name the offending tensors.
`from_*` return (pairs, message, timings): receive_s / verify_s wall seconds, for the answer's
`megarl_timings`; `apply` synchronizes the device, so once the answer is sent the trainer may
overwrite the memory it shared (CUDA IPC) with the next bucket.
"""
from __future__ import annotations

import base64
import io
import logging
import os
import pickle
import time
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megarl.sync.bucket import BucketMeta, checksum, dtype_from_name
from megarl.sync.groups import destroy_group, init_custom_process_group, tcp

from .model import DecoderModel

log = logging.getLogger("megarl.rollout.weights")

# what a from_* receive returns: verified (destination, source) pairs, a message, timings
Received = Tuple[List[Tuple[torch.Tensor, torch.Tensor]], str, Dict[str, float]]


class WeightRefused(ValueError):
    """A weight update that failed verification; the served weights are unchanged."""


class WeightReceiver:
    def __init__(self, model: DecoderModel, weights_dir: Optional[str] = None):
        self.model = model
        # /update_weights_from_disk reads only below this folder (a path from the network must not
        # pick any file on the host)
        self.weights_dir = os.path.realpath(weights_dir) if weights_dir else None
        self.groups: Dict[str, object] = {}
        self.num_updates = 0

    # ------------------------------------------------------------------ groups
    def init_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                   group_name: str = "weight_update_group", backend: str = "nccl") -> str:
        if backend == "nccl" and self.model.device.type != "cuda":
            backend = "gloo"  # embedded server on CPU: the trainer must use gloo too
        if group_name in self.groups:
            destroy_group(self.groups.pop(group_name))
        self.groups[group_name] = init_custom_process_group(
            backend, tcp(master_address, int(master_port)), int(world_size), int(rank_offset), group_name)
        return f"joined group {group_name} as rank {rank_offset} of {world_size} ({backend})"

    def destroy_group(self, group_name: str) -> str:
        if group_name not in self.groups:
            raise KeyError(f"no group {group_name}")
        destroy_group(self.groups.pop(group_name))
        return f"destroyed {group_name}"

    # ------------------------------------------------------------------ verify + swap
    def _check(self, named: Sequence[Tuple[str, torch.Tensor]],
               flat: Optional[torch.Tensor] = None) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        """Verify names/shapes/dtypes/finiteness; `flat` = the uint8 bucket all tensors are views of
        (lets the finiteness check run as one reduction over the whole bucket)."""
        pairs = []
        checked = []
        errors = []
        for name, t in named:
            if self.model.is_ignored(name):
                continue
            dst = self.model.target(name)
            if dst is None:
                errors.append(f"unknown weight name {name!r}")
                continue
            if tuple(dst.shape) != tuple(t.shape):
                errors.append(f"shape mismatch for {name}: got {tuple(t.shape)}, model has {tuple(dst.shape)}")
                continue
            if not t.dtype.is_floating_point:
                errors.append(f"non-float dtype {t.dtype} for {name}")
                continue
            pairs.append((dst, t))
            checked.append((name, t))
        if not errors and not _all_finite([t for _, t in named], flat):
            # something in the bucket is not finite: name it (an ignored tensor, e.g. a tied
            # lm_head, may hold it: then nothing we apply is affected)
            errors = [f"non-finite values in {n}" for n, t in checked if t.numel() and not torch.isfinite(t).all()]
        if errors:
            raise WeightRefused("; ".join(errors[:5]) + (f" (+{len(errors) - 5} more)" if len(errors) > 5 else ""))
        return pairs

    def apply(self, pairs) -> int:
        """Engine thread: copy verified tensors into the live parameters (cast on the way), then
        wait for the copies: the sender may reuse the source memory once we answer."""
        devs = set()
        for dst, t in pairs:
            dst.copy_(t)
            devs.add(dst.device)
            devs.add(t.device)
        for d in devs:
            if d.type == "cuda":
                torch.cuda.synchronize(d)
        self.num_updates += 1
        return len(pairs)

    def _verify_sum(self, flat: torch.Tensor, expected: Optional[str]):
        if expected is None:
            return
        got = checksum(flat)
        if got != expected:
            raise WeightRefused(f"bucket checksum mismatch: got {got}, trainer sent {expected}")

    # ------------------------------------------------------------------ transports
    def from_distributed(self, names: List[str], dtypes: List[str], shapes: List[List[int]],
                         group_name: str = "weight_update_group", load_format: Optional[str] = None,
                         checksums: Optional[List[str]] = None) -> Received:
        if group_name not in self.groups:
            raise KeyError(f"group {group_name!r} not initialised; call /init_weights_update_group first")
        pg = self.groups[group_name]
        t0 = time.perf_counter()
        meta = BucketMeta.from_fields(names, dtypes, shapes)  # one dtype -> aligned views
        flat = torch.empty(meta.nbytes, dtype=torch.uint8, device=self.model.device)
        if load_format == "flattened_bucket":
            dist.broadcast(flat, src=0, group=pg)
        else:
            # sglang's default wire format: one broadcast per tensor, in order
            handles = [dist.broadcast(t, src=0, group=pg, async_op=True) for _, t in meta.views(flat)]
            for h in handles:
                h.wait()
        # Always receive first (the trainer is mid-broadcast), then judge.
        if flat.device.type == "cuda":
            torch.cuda.synchronize(flat.device)
        t1 = time.perf_counter()
        self._verify_sum(flat, (checksums or [None])[0])
        pairs = self._check(meta.views(flat), flat)
        return pairs, f"updated {len(names)} tensors ({meta.nbytes} bytes)", _timings(t0, t1)

    def from_tensor(self, serialized_named_tensors: List[str], load_format: Optional[str] = None,
                    checksums: Optional[List[str]] = None, tp_rank: int = 0) -> Received:
        t0 = time.perf_counter()
        payload = serialized_named_tensors[tp_rank]
        data = base64.b64decode(payload) if isinstance(payload, str) else payload
        obj = _SafeUnpickler(io.BytesIO(data)).load()
        t1 = time.perf_counter()
        if load_format == "flattened_bucket" or isinstance(obj, dict):
            flat = obj["flattened_tensor"]
            named = [(m["name"] if isinstance(m, dict) else m.name,
                      flat[(m["start_idx"] if isinstance(m, dict) else m.start_idx):(m["end_idx"] if isinstance(m, dict) else m.end_idx)]
                      .view(dtype_from_name(str(m["dtype"] if isinstance(m, dict) else m.dtype)))
                      .view(list(m["shape"] if isinstance(m, dict) else m.shape)))
                     for m in obj["metadata"]]
            self._verify_sum(flat, (checksums or [None])[0])
        else:
            named = [(n, t) for n, t in obj]
            flat = _covering_bytes([t for _, t in named])
            if checksums:
                # a view list of one flat bucket (what megarl sends): checksum the bytes they cover
                if flat is None:
                    raise WeightRefused("megarl_checksums given but the tensors are not views of one bucket")
                self._verify_sum(flat, checksums[0])
        pairs = self._check(named, flat)
        return pairs, f"updated {len(named)} tensors from tensor handles", _timings(t0, t1)

    def from_disk(self, model_path: str) -> Received:
        from safetensors import safe_open
        t0 = time.perf_counter()
        if self.weights_dir is None:
            raise WeightRefused("update_weights_from_disk is disabled: start the server with --weights-dir DIR")
        real = os.path.realpath(model_path)
        if os.path.commonpath([real, self.weights_dir]) != self.weights_dir:
            raise WeightRefused(f"model_path {model_path} is outside the server's --weights-dir {self.weights_dir}")
        if not os.path.isdir(model_path):
            raise WeightRefused(f"{model_path} is not a directory")
        files = sorted(f for f in os.listdir(model_path) if f.endswith(".safetensors"))
        if not files:
            raise WeightRefused(f"no *.safetensors in {model_path}")
        named = []
        sums = {}
        sums_path = os.path.join(model_path, "megarl_checksums.json")
        if os.path.exists(sums_path):
            import json
            with open(sums_path) as f:
                sums = json.load(f)
        for fn in files:
            with safe_open(os.path.join(model_path, fn), framework="pt") as fh:
                for k in fh.keys():
                    named.append((k, fh.get_tensor(k)))
        t1 = time.perf_counter()
        for k, t in named:
            if k in sums:
                self._verify_sum(t.contiguous(), sums[k])
        pairs = self._check(named)
        missing = set(self.model.hf_names()) - {n for n, _ in named}
        if missing:
            raise WeightRefused(f"{model_path} lacks {len(missing)} weights, e.g. {sorted(missing)[:3]}")
        return pairs, f"loaded {len(pairs)} tensors from {model_path}", _timings(t0, t1)


def _timings(t0: float, t1: float) -> Dict[str, float]:
    return {"receive_s": t1 - t0, "verify_s": time.perf_counter() - t1}


def _all_finite(tensors: Sequence[torch.Tensor], flat: Optional[torch.Tensor] = None) -> bool:
    """Whether every float value is finite, with one host sync: one fp32-accumulated sum over `flat`
    viewed as the (single) dtype of `tensors` when given, else one per tensor. A NaN or an inf
    anywhere makes the sum non-finite; no temporaries of the tensors' size (on an H200 the server's
    whole verify step, this included, took ~0.8 ms per GB, the same as with min/max). A false alarm
    would need |sum| > 3e38 from finite weights; the caller's per-tensor pass then finds nothing to
    refuse."""
    ts = [t for t in tensors if t.numel() and t.dtype.is_floating_point]
    if not ts:
        return True
    dt = ts[0].dtype
    try:
        if (flat is not None and flat.dtype == torch.uint8 and all(t.dtype == dt for t in tensors)
                and flat.numel() % ts[0].element_size() == 0):
            sums = torch.sum(flat.view(dt), dtype=torch.float32).reshape(1)
        else:
            sums = torch.stack([torch.sum(t, dtype=torch.float32).to(ts[0].device) for t in ts])
        return bool(torch.isfinite(sums).all())
    except (RuntimeError, TypeError, NotImplementedError):   # a dtype without a sum kernel (e.g. float8)
        return all(bool(torch.isfinite(t.float() if t.element_size() == 1 else t).all()) for t in ts)


def _covering_bytes(ts: Sequence[torch.Tensor]) -> Optional[torch.Tensor]:
    """The uint8 bytes exactly covered by contiguous, back-to-back views of one storage (a megarl
    bucket sent as a list of (name, view)); None when the tensors are anything else."""
    if not ts or not all(t.is_contiguous() for t in ts):
        return None
    base = ts[0].untyped_storage()
    if any(t.untyped_storage().data_ptr() != base.data_ptr() or t.device != ts[0].device for t in ts):
        return None
    spans = sorted((t.storage_offset() * t.element_size(), t.numel() * t.element_size()) for t in ts)
    start, end = spans[0][0], spans[0][0]
    for s, n in spans:
        if s != end:
            return None
        end = s + n
    return torch.empty(0, dtype=torch.uint8, device=ts[0].device).set_(base, start, (end - start,))


class _SafeUnpickler(pickle.Unpickler):
    """Only torch tensor/storage rebuild paths and plain containers (payloads come from a trainer
    over loopback, but we still refuse arbitrary globals)."""

    _ALLOWED_PREFIX = ("torch", "collections", "megarl.sync", "sglang.srt.weight_sync")
    _ALLOWED_BUILTINS = {"list", "dict", "tuple", "set", "frozenset", "int", "float", "str", "bytes", "slice", "getattr"}

    def find_class(self, module, name):
        from megarl.sync.wire import SGLANG_FLAT_META_GLOBAL, FlattenedTensorMetadata
        if (module, name) == SGLANG_FLAT_META_GLOBAL:
            return FlattenedTensorMetadata  # SGLang's class, rebuilt as megarl's field-for-field twin
        if module == "builtins" and name in self._ALLOWED_BUILTINS:
            return super().find_class(module, name)
        if module.split(".")[0] in ("torch",) or module.startswith(self._ALLOWED_PREFIX) or module.startswith("multiprocessing.reduction"):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to unpickle {module}.{name}")
