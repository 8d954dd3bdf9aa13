"""Save / load megatron model chunks in megatron ``dist_checkpointing`` torch_dist format.

Layout of a checkpoint directory::

    DIR/                      torch_dist files (*.distcp, .metadata, common.pt, metadata.json)
    DIR/megarl.json           family, HF config, parallelism at save time, extra_state
    DIR/megarl_manifest.json  per-tensor sha256 of every full HF-named tensor (see manifest.py)
    DIR/hf/                   config.json + tokenizer files (for export back to HF)

torch_dist is resharding-agnostic: a checkpoint saved at one tp/pp/ep/vpp loads at any other.
Saves are atomic: everything is written to ``DIR.tmp-XXXX`` and renamed to ``DIR`` at the end.
"""
from __future__ import annotations

import json
import pathlib
import shutil
import time
import uuid
from typing import Optional

import torch
import torch.distributed as dist

from . import manifest as mf
from .atomic import replace_dir

META_NAME = "megarl.json"


def _chunks(chunks):
    from megarl.models.builder import unwrap
    chunks = list(chunks) if isinstance(chunks, (list, tuple)) else [chunks]
    return [unwrap(c) for c in chunks]


def sharded_state_dict(chunks) -> dict:
    chunks = _chunks(chunks)
    if len(chunks) == 1:
        return {"model": chunks[0].sharded_state_dict()}
    return {f"model{i}": c.sharded_state_dict() for i, c in enumerate(chunks)}


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier():
    if dist.is_initialized():
        dist.barrier()


def _broadcast_obj(obj):
    if not dist.is_initialized():
        return obj
    lst = [obj]
    dist.broadcast_object_list(lst, src=0)
    return lst[0]


def model_manifest(chunks) -> dict:
    """Manifest of the model's full HF tensors, gathered on every rank (collective)."""
    from megarl.models.naming import iter_hf_weights
    local = mf.build(iter_hf_weights(_chunks(chunks)))
    if not dist.is_initialized():
        return local
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local)
    merged: dict = {}
    for p in parts:
        for k, v in p.items():
            if k in merged:
                raise ValueError(f"tensor {k!r} yielded by more than one rank")
            merged[k] = v
    return merged


def verify_model(chunks, expected: dict, where: str = "", ignore_dtype: bool = False) -> None:
    """Collective: raise ``CheckpointVerificationError`` on every rank if the model's tensors
    differ from ``expected`` (missing / extra / checksum), naming the tensors."""
    actual = model_manifest(chunks)
    err = None
    if _rank() == 0:
        try:
            mf.compare(expected, actual, where=where, ignore_dtype=ignore_dtype)
        except mf.CheckpointVerificationError as e:
            err = (e.missing, e.extra, e.mismatched)
    err = _broadcast_obj(err)
    if err is not None:
        raise mf.CheckpointVerificationError(*err, where=where)


def _write_buckets_in_process(transform_list, use_msc, rank, write_buckets, global_results_queue):
    """Replacement for ``FileSystemWriterAsync.write_preloaded_data_multiproc`` that writes the
    buckets in this process. megatron's version forks one writer per bucket; forking from a
    process that is itself a fork (our launcher) with live queue-feeder threads hung
    intermittently in megatron-core 0.16.1 (the joinable queue never drained)."""
    import queue
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    results: dict = {}
    try:
        for i, bucket in enumerate(write_buckets):
            lq, cq = queue.Queue(), queue.Queue()
            cq.put(i)
            kw = {"use_msc": use_msc} if use_msc else {}
            FileSystemWriterAsync.write_preloaded_data(transform_list, i, bucket, lq, cq, True, **kw)
            idx, res = lq.get()
            if isinstance(res, Exception):
                raise res
            results[idx] = res
        global_results_queue.put(results)
    except Exception as e:  # reported like megatron's multiproc writer does
        global_results_queue.put(e)


class _InProcessWrites:
    """megatron-core 0.16's forked bucket writers replaced by in-process writes while saving;
    later versions (0.19) write with threads and have no forked writer: nothing to replace."""

    def __enter__(self):
        from megatron.core.dist_checkpointing.strategies import filesystem_async as fa
        self.fa, self.orig = fa, fa.FileSystemWriterAsync.__dict__.get("write_preloaded_data_multiproc")
        if self.orig is not None:
            fa.FileSystemWriterAsync.write_preloaded_data_multiproc = staticmethod(_write_buckets_in_process)

    def __exit__(self, *exc):
        if self.orig is not None:
            self.fa.FileSystemWriterAsync.write_preloaded_data_multiproc = self.orig


def _save_strategy():
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
    return TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=1)


def save_megatron(chunks, ckpt_dir, extra_state: Optional[dict] = None, *,
                  manifest: Optional[dict] = None, hf_files_from=None, verbose: bool = True) -> pathlib.Path:
    """Collective save (all ranks). ``manifest`` defaults to one computed from the model.
    ``hf_files_from``: an HF folder whose config.json / tokenizer files are copied to ``DIR/hf``.
    ``extra_state`` (JSON-serialisable) is stored in ``megarl.json`` and returned by load."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as mpu

    chunks = _chunks(chunks)
    ckpt_dir = pathlib.Path(ckpt_dir).absolute()
    t0 = time.time()
    tmp = _broadcast_obj(str(ckpt_dir.parent / f".{ckpt_dir.name}.tmp-{uuid.uuid4().hex[:8]}")
                         if _rank() == 0 else None)
    tmp = pathlib.Path(tmp)
    if _rank() == 0:
        tmp.mkdir(parents=True)
    _barrier()
    if manifest is None:
        manifest = model_manifest(chunks)
    with _InProcessWrites():
        dist_checkpointing.save(sharded_state_dict(chunks), str(tmp), sharded_strategy=_save_strategy())
    _barrier()
    if _rank() == 0:
        c = chunks[0]
        meta = {
            "format": "megarl-megatron-v1",
            "family": c.family,
            "value_head": bool(getattr(c, "value_head", False)),
            "hf_config": c.hf_config.to_dict(),
            "saved_with": {"tp": mpu.get_tensor_model_parallel_world_size(),
                           "pp": mpu.get_pipeline_model_parallel_world_size(),
                           "ep": mpu.get_expert_model_parallel_world_size(),
                           "vpp": len(chunks),
                           "dtype": str(next(c.parameters()).dtype).replace("torch.", "")},
            "extra_state": extra_state or {},
        }
        with open(tmp / META_NAME, "w") as f:
            json.dump(meta, f, indent=1, default=str)
        mf.write(tmp / mf.MANIFEST_NAME, manifest)
        hf_dst = tmp / "hf"
        hf_dst.mkdir()
        if hf_files_from is not None:
            copy_hf_side_files(hf_files_from, hf_dst)
        else:
            c.hf_config.save_pretrained(str(hf_dst))
        replace_dir(tmp, ckpt_dir)
        if verbose:
            print(f"[megarl.checkpoint] saved {len(manifest)} tensors to {ckpt_dir} "
                  f"in {time.time() - t0:.1f}s", flush=True)
    _barrier()
    return ckpt_dir


HF_SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt",
                 "chat_template.jinja", "chat_template.json", "added_tokens.json")


def copy_hf_side_files(src, dst) -> None:
    src, dst = pathlib.Path(src), pathlib.Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for n in HF_SIDE_FILES:
        if (src / n).exists():
            shutil.copy2(src / n, dst / n)


def read_meta(ckpt_dir) -> dict:
    with open(pathlib.Path(ckpt_dir) / META_NAME) as f:
        return json.load(f)


def load_megatron(chunks, ckpt_dir, *, verify: bool = True, verbose: bool = False) -> dict:
    """Collective load into already-built chunks (any tp/pp/ep/vpp); returns ``extra_state``.

    With ``verify`` every full HF tensor of the loaded model is checksummed and compared to the
    manifest: a missing, extra or corrupted tensor raises ``CheckpointVerificationError`` with its
    name. A tensor missing from the torch_dist files themselves raises the same error type.
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    chunks = _chunks(chunks)
    ckpt_dir = pathlib.Path(ckpt_dir)
    if not (ckpt_dir / META_NAME).exists():
        raise FileNotFoundError(f"{ckpt_dir} is not a megarl megatron checkpoint (no {META_NAME})")
    t0 = time.time()
    ssd = sharded_state_dict(chunks)
    try:
        state = dist_checkpointing.load(ssd, str(ckpt_dir), strict=StrictHandling.RAISE_ALL)
    except Exception as e:  # name the missing / unexpected megatron keys
        missing, extra = _keys_from_error(str(e), ssd)
        if missing or extra:
            raise mf.CheckpointVerificationError(missing=missing, extra=extra,
                                                 where=str(ckpt_dir)) from e
        raise
    for i, c in enumerate(chunks):
        key = "model" if len(chunks) == 1 else f"model{i}"
        c.load_state_dict(state[key], strict=True)
    if verify:
        verify_model(chunks, mf.read(ckpt_dir / mf.MANIFEST_NAME), where=str(ckpt_dir))
    if verbose and _rank() == 0:
        print(f"[megarl.checkpoint] loaded {ckpt_dir} in {time.time() - t0:.1f}s"
              f"{' (manifest verified)' if verify else ''}", flush=True)
    return read_meta(ckpt_dir).get("extra_state", {})


def _keys_from_error(msg: str, ssd):
    """megatron's strict-load error lists key sets; split them into keys the model needs but the
    checkpoint lacks (missing) and keys the checkpoint has but the model does not (extra)."""
    import re
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedBase
    model_keys = {v.key for v in nested_values(ssd) if isinstance(v, ShardedBase)}
    named = set(re.findall(r"'([A-Za-z0-9_./]+)'", msg))
    missing = sorted(k for k in named if k in model_keys)
    extra = sorted(k for k in named if k not in model_keys and "." in k)
    return missing, extra
