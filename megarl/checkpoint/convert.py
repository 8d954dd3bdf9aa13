"""HF safetensors <-> megatron torch_dist conversion.

``convert_hf_to_megatron(hf_dir, out_dir, tp=, pp=, ep=)`` launches ``world = pp * lcm(tp, ep*etp)``
local processes (gloo on CPU; see ``megarl.parallel.spawn``); each builds only its model shard,
streams the safetensors files and reads only the tensors it needs, so no rank ever holds the
whole model (with tp=pp=ep=1 the single rank holds it, once). Steps, printed as they go:

1. rank 0 checksums every tensor of the HF folder, file by file (the manifest);
2. every rank builds its megatron shard and loads its HF tensors; all HF names consumed across
   ranks must equal all HF names in the folder: an unused one (e.g. an expert the config does not
   have) or a missing one is an error naming it;
3. the loaded model is re-exported in memory through ``iter_hf_weights`` and compared with the
   manifest (catches transform bugs), then saved in torch_dist format with the manifest.

``convert_megatron_to_hf(ckpt_dir, out_dir, hf_config_dir=None)`` loads the checkpoint (manifest
verified), iterates full HF tensors and writes safetensors shards (each writing rank streams its
own shard files, ``max_shard_gb`` each) + index, config.json and tokenizer files.
"""
from __future__ import annotations

import json
import math
import os
import pathlib
import resource
import shutil
import time
import uuid
from typing import Optional

import torch

from . import manifest as mf
from .atomic import replace_dir
from .megatron_io import (copy_hf_side_files, load_megatron, read_meta, save_megatron,
                          verify_model)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _world(tp, pp, ep, etp):
    return pp * math.lcm(tp, ep * (etp or 1))


def _log(msg):
    print(f"[megarl.convert] {msg}", flush=True)


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _source_dtype(hf_dir, cfg) -> torch.dtype:
    from megarl.models.naming import SafetensorsSource
    src = SafetensorsSource(hf_dir)
    name = "model.embed_tokens.weight" if "model.embed_tokens.weight" in src.weight_map else src.names()[0]
    for _, t in src.read([name]):
        return t.dtype
    return torch.float32


def _hf_to_megatron_worker(rank, world, hf_dir, out_dir, tp, pp, ep, etp, vpp, dtype, verbose):
    import torch.distributed as dist
    from megarl.models import build_model, load_hf_config, load_hf_weights
    from megarl.models.naming import SafetensorsSource
    from megarl.parallel import init_model_parallel

    t0 = time.time()
    say = (lambda m: _log(m)) if (rank == 0 and verbose) else (lambda m: None)
    init_model_parallel(tp=tp, pp=pp, ep=ep, etp=etp, vpp=vpp)
    cfg = load_hf_config(hf_dir)
    src = SafetensorsSource(hf_dir)
    expected = None
    if rank == 0:
        say(f"checksumming {len(src.names())} HF tensors in {len(set(src.weight_map.values()))} file(s)")
        expected = mf.hf_folder_manifest(hf_dir)
    params_dtype = _DTYPES[dtype] if isinstance(dtype, str) else (dtype or _source_dtype(hf_dir, cfg))
    say(f"building megatron model tp={tp} pp={pp} ep={ep} vpp={vpp} dtype={params_dtype} on {world} rank(s)")
    chunks = build_model(cfg, params_dtype=params_dtype, vpp=vpp, perform_initialization=False)
    say("loading HF tensors (streaming)")
    consumed = set(load_hf_weights(chunks, src, progress=verbose and rank == 0))
    parts = [None] * world
    dist.all_gather_object(parts, consumed)
    unused = sorted(set(src.names()) - set().union(*parts))
    if unused:  # e.g. experts beyond the config's num_experts, or an unknown tensor
        raise mf.CheckpointVerificationError(
            extra=unused, where=f"{hf_dir} (HF tensors the megatron model has no parameter for)")
    say("verifying the loaded model against the HF checksums")
    box = [expected]
    dist.broadcast_object_list(box, src=0)
    # tensors megatron keeps in another dtype (e.g. the fp32 router expert bias) compare by shape
    verify_model(chunks, box[0], where=f"{hf_dir} -> megatron", ignore_dtype=True)
    say(f"saving torch_dist checkpoint to {out_dir}")
    save_megatron(chunks, out_dir, manifest=None, hf_files_from=hf_dir, verbose=verbose)
    return {"rank": rank, "seconds": time.time() - t0, "peak_rss_mb": _peak_rss_mb()}


def convert_hf_to_megatron(hf_dir, out_dir, *, tp: int = 1, pp: int = 1, ep: int = 1,
                           etp: int = 1, vpp: Optional[int] = None, dtype=None,
                           verbose: bool = True, timeout_s: float = 3600.0) -> dict:
    """Convert an HF folder to a megatron torch_dist checkpoint (see module doc).

    ``dtype``: params dtype (default: the HF tensors' dtype, so the round trip is bit-exact).
    Returns ``{"seconds", "peak_rss_mb" (max over ranks), "ranks": [...]}``.
    """
    from megarl.parallel import spawn
    t0 = time.time()
    world = _world(tp, pp, ep, etp)
    res = spawn(_hf_to_megatron_worker, world, str(hf_dir), str(out_dir), tp, pp, ep, etp, vpp,
                dtype, verbose, timeout_s=timeout_s, collective_timeout_s=min(timeout_s, 1800))
    out = {"seconds": time.time() - t0, "peak_rss_mb": max(r["peak_rss_mb"] for r in res), "ranks": res}
    if verbose:
        _log(f"done in {out['seconds']:.1f}s, peak RSS per rank {out['peak_rss_mb']:.0f} MB")
    return out


class _ShardWriter:
    """Streams (name, tensor) into safetensors files of at most ``max_bytes`` each."""

    def __init__(self, out_dir: pathlib.Path, prefix: str, max_bytes: int):
        self.out_dir, self.prefix, self.max_bytes = out_dir, prefix, max_bytes
        self.buf, self.size, self.files, self.weight_map = {}, 0, [], {}

    def add(self, name, t):
        nbytes = t.numel() * t.element_size()
        if self.buf and self.size + nbytes > self.max_bytes:
            self.flush()
        self.buf[name] = t.contiguous()
        self.size += nbytes

    def flush(self):
        if not self.buf:
            return
        from safetensors.torch import save_file
        fn = f"{self.prefix}-{len(self.files):05d}.safetensors"
        save_file(self.buf, str(self.out_dir / fn), metadata={"format": "pt"})
        for n in self.buf:
            self.weight_map[n] = fn
        self.files.append(fn)
        self.buf, self.size = {}, 0


def _megatron_to_hf_worker(rank, world, ckpt_dir, tmp_dir, tp, pp, ep, etp, max_shard_bytes, verbose):
    import torch.distributed as dist
    from megarl.models import build_model, load_hf_config
    from megarl.models.naming import iter_hf_weights
    from megarl.parallel import init_model_parallel

    t0 = time.time()
    say = (lambda m: _log(m)) if (rank == 0 and verbose) else (lambda m: None)
    meta = read_meta(ckpt_dir)
    init_model_parallel(tp=tp, pp=pp, ep=ep, etp=etp)
    cfg = load_hf_config(dict(meta["hf_config"]))
    dtype = _DTYPES[meta["saved_with"]["dtype"]]
    say(f"building megatron model tp={tp} pp={pp} ep={ep} on {world} rank(s)")
    chunks = build_model(cfg, params_dtype=dtype, perform_initialization=False,
                         value_head=meta.get("value_head", False))
    say(f"loading {ckpt_dir} (checksums verified)")
    load_megatron(chunks, ckpt_dir, verify=True)
    say("writing safetensors")
    w = _ShardWriter(pathlib.Path(tmp_dir), f"model-r{rank:04d}", max_shard_bytes)
    n = 0
    for name, t in iter_hf_weights(chunks):
        w.add(name, t)
        n += 1
    w.flush()
    parts = [None] * world
    dist.all_gather_object(parts, w.weight_map)
    return {"rank": rank, "weight_map": w.weight_map, "n": n, "seconds": time.time() - t0,
            "peak_rss_mb": _peak_rss_mb()}


def convert_megatron_to_hf(ckpt_dir, out_dir, hf_config_dir=None, *, tp: int = 1, pp: int = 1,
                           ep: int = 1, etp: int = 1, max_shard_gb: float = 4.0,
                           verbose: bool = True, timeout_s: float = 3600.0) -> dict:
    """Export a megarl megatron checkpoint to an HF folder loadable by ``from_pretrained``.

    ``hf_config_dir``: where config.json / tokenizer files come from (default: the copies stored
    in the checkpoint's ``hf/`` folder at conversion time).
    """
    from megarl.parallel import spawn
    t0 = time.time()
    ckpt_dir, out_dir = pathlib.Path(ckpt_dir).absolute(), pathlib.Path(out_dir).absolute()
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    try:
        world = _world(tp, pp, ep, etp)
        res = spawn(_megatron_to_hf_worker, world, str(ckpt_dir), str(tmp), tp, pp, ep, etp,
                    int(max_shard_gb * 2 ** 30), verbose, timeout_s=timeout_s,
                    collective_timeout_s=min(timeout_s, 1800))
        weight_map = {}
        for r in res:
            weight_map.update(r["weight_map"])
        files = sorted(set(weight_map.values()))
        if len(files) == 1:
            os.replace(tmp / files[0], tmp / "model.safetensors")
        else:
            total = 0
            for f in files:
                from safetensors import safe_open
                with safe_open(str(tmp / f), "pt") as sf:
                    for k in sf.keys():
                        sl = sf.get_slice(k)
                        total += math.prod(sl.get_shape()) * _dtype_size(sl.get_dtype())
            with open(tmp / "model.safetensors.index.json", "w") as f:
                json.dump({"metadata": {"total_size": total},
                           "weight_map": dict(sorted(weight_map.items()))}, f, indent=1)
        side = pathlib.Path(hf_config_dir) if hf_config_dir else ckpt_dir / "hf"
        copy_hf_side_files(side, tmp)
        if not (tmp / "config.json").exists():
            from megarl.models import load_hf_config
            load_hf_config(dict(read_meta(ckpt_dir)["hf_config"])).save_pretrained(str(tmp))
        replace_dir(tmp, out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    out = {"seconds": time.time() - t0, "peak_rss_mb": max(r["peak_rss_mb"] for r in res),
           "tensors": len(weight_map), "ranks": res}
    if verbose:
        _log(f"exported {len(weight_map)} tensors to {out_dir} in {out['seconds']:.1f}s")
    return out


def _dtype_size(s: str) -> int:
    return {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
            "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}.get(s, 4)
