"""Raw-HTTP weight updates for the embedded-server tests, the way SGLang's API takes them.

The tests of the server speak its HTTP contract directly (urllib, no megarl client), so they
check the server rather than megarl's pusher: sessions, one tensor payload per TP rank, a
trainer-side rank 0 of a distributed update group.
"""
from __future__ import annotations

import concurrent.futures
import json
import urllib.error
import urllib.request
from typing import Any, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megarl.sync.bucket import pack
from megarl.wire.process_group import destroy_group, init_custom_process_group, tcp
from megarl.wire.flattened import dumps_b64, flat_metadata


def call(url: str, path: str, body: Optional[dict] = None, key: Optional[str] = None, method: Optional[str] = None,
         timeout: float = 120.0, headers: Optional[dict] = None) -> Tuple[int, Any]:
    """(status, parsed JSON body or text) of one request."""
    data = None if body is None else json.dumps(body).encode()
    h = {"Content-Type": "application/json"} if data is not None else {}
    if key is not None:
        h["Authorization"] = f"Bearer {key}"
    h.update(headers or {})
    req = urllib.request.Request(url + path, data=data, headers=h, method=method or ("POST" if data is not None else "GET"))
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    try:
        return status, json.loads(raw) if raw else None
    except ValueError:
        return status, raw.decode(errors="replace")


def ok(url: str, path: str, body: Optional[dict] = None, key: Optional[str] = None) -> Any:
    status, out = call(url, path, body if body is not None else {}, key)
    assert status == 200, (path, status, out)
    return out


def generate(url: str, prompt: List[int], n: int = 8, key: Optional[str] = None) -> dict:
    return ok(url, "/generate", {"input_ids": prompt, "return_logprob": True,
                                 "sampling_params": {"max_new_tokens": n, "temperature": 0}}, key)


def shm_flat(named: Sequence[Tuple[str, torch.Tensor]]):
    """A megarl bucket packed into shared memory (file_system strategy: what the tensor transport
    sends on CPU)."""
    import torch.multiprocessing as tmp
    tmp.set_sharing_strategy("file_system")
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    out = torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage._new_shared(nbytes))
    return pack(list(named), out=out, with_checksum=False)


def flattened_payload(named: Sequence[Tuple[str, torch.Tensor]]) -> str:
    """One `flattened_bucket` payload (SGLang's format: FlattenedTensorMetadata objects)."""
    b = shm_flat(named)
    return dumps_b64({"flattened_tensor": b.flat, "metadata": flat_metadata(b.meta.entries, b.meta.dtype)})


def list_payload(named: Sequence[Tuple[str, torch.Tensor]]) -> str:
    """One payload in SGLang's default format: a list of (name, tensor)."""
    b = shm_flat(named)
    return dumps_b64(b.named_tensors())


class DistributedSender:
    """Trainer-side rank 0 of one update group towards servers of the given TP sizes (SGLang's
    numbering: server i's TP rank r is rank 1 + sum(tp[:i]) + r of world 1 + sum(tp))."""

    def __init__(self, urls: Sequence[str], tp_sizes: Sequence[int], port: int, group: str = "g",
                 key: Optional[str] = None, world_size: Optional[int] = None):
        self.urls, self.group, self.key = list(urls), group, key
        world = world_size or 1 + sum(tp_sizes)
        offsets, off = [], 1
        for tp in tp_sizes:
            offsets.append(off)
            off += tp
        self.pool = concurrent.futures.ThreadPoolExecutor(len(self.urls))
        futs = [self.pool.submit(call, u, "/init_weights_update_group",
                                 {"master_address": "127.0.0.1", "master_port": port, "rank_offset": o,
                                  "world_size": world, "group_name": group, "backend": "gloo"}, key)
                for u, o in zip(self.urls, offsets)]
        self.pg = init_custom_process_group("gloo", tcp("127.0.0.1", port), world, 0, group)
        self.init_answers = [f.result(120) for f in futs]

    def post(self, named: Sequence[Tuple[str, torch.Tensor]], **extra) -> List[concurrent.futures.Future]:
        """POST the bucket's request to every server (does not broadcast)."""
        b = pack(list(named), with_checksum=False)
        body = {"names": b.meta.names, "dtypes": b.meta.dtypes, "shapes": b.meta.shapes, "group_name": self.group,
                "load_format": "flattened_bucket", **extra}
        self._flat = b.flat
        return [self.pool.submit(call, u, "/update_weights_from_distributed", body, self.key) for u in self.urls]

    def push(self, named: Sequence[Tuple[str, torch.Tensor]], **extra) -> List[Tuple[int, Any]]:
        futs = self.post(named, **extra)
        dist.broadcast(self._flat, src=0, group=self.pg)
        return [f.result(120) for f in futs]

    def close(self) -> None:
        for u in self.urls:
            call(u, "/destroy_weights_update_group", {"group_name": self.group}, self.key)
        destroy_group(self.pg)
        self.pool.shutdown()
