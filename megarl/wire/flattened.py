"""Objects that cross the trainer -> rollout-server boundary inside pickles, in SGLang's own types.

SGLang 0.5.23 unpickles `/update_weights_from_tensor` payloads with an exact allowlist
(`sglang.srt.utils.common.SafeUnpickler.ALLOWED_GLOBALS`) and, for `load_format="flattened_bucket"`,
reads each metadata entry by attribute (`meta.name`, `meta.start_idx`, ...:
`model_runner_components/weight_updater.py::_update_weights_from_flattened_bucket`), so the
metadata must arrive as `sglang.srt.weight_sync.tensor_bucket.FlattenedTensorMetadata` objects --
plain dicts raise AttributeError there.

The trainer does not import SGLang (its wheel pulls a CUDA stack), so megarl keeps a field-for-
field twin of that dataclass and pickles it *under SGLang's global name*: the receiving SGLang
process rebuilds its own class; the embedded server maps the same global back to this twin.
Field meanings are SGLang's: `shape` a torch.Size, `dtype` a torch.dtype, `start_idx`/`end_idx`
byte offsets into the flat uint8 tensor, `numel` the entry's size in BYTES (SGLang computes it
as `tensor.flatten().view(torch.uint8).numel()`).
"""
from __future__ import annotations

import base64
import copyreg
import io
import pickle
from dataclasses import dataclass
from typing import Any, List, Sequence

import torch

SGLANG_FLAT_META_GLOBAL = ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata")


@dataclass
class FlattenedTensorMetadata:
    """Twin of SGLang's dataclass of the same name (same fields, same order, same meaning)."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


def flat_metadata(entries: Sequence[Any], dtype: torch.dtype) -> List[FlattenedTensorMetadata]:
    """Metadata for bucket entries (objects with name/shape/start/end, byte offsets)."""
    return [FlattenedTensorMetadata(name=e.name, shape=torch.Size(e.shape), dtype=dtype, start_idx=int(e.start),
                                    end_idx=int(e.end), numel=int(e.end - e.start)) for e in entries]


class _WirePickler(pickle._Pickler):  # type: ignore[name-defined]  # pure-Python pickler: save_global is overridable
    """ForkingPickler's reductions (tensors become shared-memory / CUDA-IPC handles, no bytes
    copied) plus one rule: the metadata twin is written as SGLang's global."""

    def __init__(self, file, protocol=None):
        super().__init__(file, protocol)
        from multiprocessing.reduction import ForkingPickler

        import torch.multiprocessing  # noqa: F401  (registers torch's tensor/storage reductions)

        self.dispatch_table = copyreg.dispatch_table.copy()
        self.dispatch_table.update(ForkingPickler._extra_reducers)
        self.dispatch_table[FlattenedTensorMetadata] = _metadata_by_fields

    def save_global(self, obj, name=None):
        if obj is FlattenedTensorMetadata:
            module, qualname = SGLANG_FLAT_META_GLOBAL
            self.save(module)
            self.save(qualname)
            self.write(pickle.STACK_GLOBAL)
            self.memoize(obj)
            return
        super().save_global(obj, name)


def _metadata_by_fields(meta: FlattenedTensorMetadata) -> tuple:
    """The class called with its fields in order (one REDUCE), instead of the default ``__newobj__``
    plus a state dict of six named fields: the same object after unpickling, at a third of the
    pure-Python pickler's work per tensor (a bucket's metadata is pickled entry by entry)."""
    return FlattenedTensorMetadata, (meta.name, meta.shape, meta.dtype, meta.start_idx, meta.end_idx, meta.numel)


def dumps(obj: Any) -> bytes:
    """Pickle `obj` as SGLang's `MultiprocessingSerializer.serialize` would (protocol 4+)."""
    buf = io.BytesIO()
    _WirePickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buf.getvalue()


def dumps_b64(obj: Any) -> str:
    """`dumps` as the base64 text SGLang's HTTP endpoint takes in `serialized_named_tensors`."""
    return base64.b64encode(dumps(obj)).decode()
