"""The unpickler for `/update_weights_from_tensor` payloads: an exact allowlist of globals.

A payload is a pickle that the trainer made with torch's multiprocessing reductions (tensors
become shared-memory / CUDA-IPC handles). Unpickling calls whatever globals the stream names, so
the allowlist IS the attack surface: any module prefix (`torch.*`) or `builtins.getattr` lets a
crafted payload reach `torch.os.system` (pickle protocol 4 resolves dotted names such as
`("torch", "os.system")`). So the set below is exact (module, name) pairs, every one of them also
in SGLang 0.5.23's `SafeUnpickler.ALLOWED_GLOBALS` (`sglang/srt/utils/common.py`; a test checks
the subset), and only what these payloads need:

* CPU tensors shared with the `file_system` strategy (what megarl's tensor transport uses on CPU):
  `rebuild_tensor`, `rebuild_typed_storage`, `rebuild_storage_filename` (+ `rebuild_storage_empty`
  for zero-size storages), `torch.storage.UntypedStorage`, `torch.Tensor`, `torch.Size`, dtypes.
  Seen by pickling real payloads (tests/test_server_security.py lists them again).
* CUDA tensors (`torch/multiprocessing/reductions.py::reduce_tensor`): `rebuild_cuda_tensor`
  with `type(tensor)` and `type(tensor._typed_storage())` = `torch.storage.TypedStorage`.
* `torch.nn.parameter.Parameter` (a parameter pickles as its own class), plain containers and
  `copyreg.__newobj__` (objects pickled with protocol < 4 or by `__reduce_ex__`).
* SGLang's `FlattenedTensorMetadata`, mapped to megarl's field-for-field twin
  (`megarl.wire.flattened`): the `flattened_bucket` format's metadata.

Deliberately left out although SGLang allows them: the file-descriptor sharing strategy
(`rebuild_storage_fd`, `multiprocessing.resource_sharer.DupFd`: it only works between a parent and
its children, never for an HTTP server), `functools.partial`, `_codecs.encode`, itertools, sparse /
nested / quantized tensors, SGLang's request classes and patched rebuild functions.
"""
from __future__ import annotations

import base64
import binascii
import io
import pickle
from typing import Any, FrozenSet, Tuple, Union

from megarl.wire.flattened import SGLANG_FLAT_META_GLOBAL, FlattenedTensorMetadata

_REDUCTIONS = "torch.multiprocessing.reductions"

# dtypes as torch pickles them (`torch.dtype.__reduce__` gives the canonical name)
_DTYPES = ("float32", "float16", "bfloat16", "float64", "float8_e4m3fn", "float8_e5m2", "uint8", "int8",
           "int16", "int32", "int64", "bool")

ALLOWED_GLOBALS: FrozenSet[Tuple[str, str]] = frozenset({
    # plain containers / scalars
    ("builtins", "list"), ("builtins", "dict"), ("builtins", "tuple"), ("builtins", "set"),
    ("builtins", "frozenset"), ("builtins", "bytes"), ("builtins", "bytearray"), ("builtins", "str"),
    ("builtins", "int"), ("builtins", "float"), ("builtins", "bool"),
    ("collections", "OrderedDict"),
    ("copyreg", "__newobj__"),
    # tensors, storages and their rebuild functions (CPU file_system sharing, CUDA IPC)
    ("torch", "Tensor"), ("torch.nn.parameter", "Parameter"), ("torch", "Size"),
    ("torch.storage", "UntypedStorage"), ("torch.storage", "TypedStorage"),
    (_REDUCTIONS, "rebuild_tensor"), (_REDUCTIONS, "rebuild_typed_storage"),
    (_REDUCTIONS, "rebuild_storage_filename"), (_REDUCTIONS, "rebuild_storage_empty"),
    (_REDUCTIONS, "rebuild_cuda_tensor"),
    *(("torch", d) for d in _DTYPES),
    # SGLang's flattened_bucket metadata (resolved to megarl's twin below)
    SGLANG_FLAT_META_GLOBAL,
})


class UnsafePayload(pickle.UnpicklingError):
    """The payload names a global outside the allowlist (nothing it names was called)."""


class SafeUnpickler(pickle.Unpickler):
    """`pickle.Unpickler` that resolves only `ALLOWED_GLOBALS` (exact pairs, no prefixes)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == SGLANG_FLAT_META_GLOBAL:
            return FlattenedTensorMetadata
        if (module, name) in ALLOWED_GLOBALS:
            if module.startswith("torch"):
                # registers torch's storage/tensor reductions, as the sender's pickler had them
                import torch.multiprocessing  # noqa: F401
            return super().find_class(module, name)
        hint = ""
        if (module, name) == (_REDUCTIONS, "rebuild_storage_fd"):
            hint = ("; CPU tensors must be shared with torch.multiprocessing.set_sharing_strategy('file_system'): "
                    "a file descriptor cannot reach an unrelated process")
        raise UnsafePayload(f"refusing to unpickle global {module}.{name} (not in the weight-payload allowlist){hint}")

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafePayload("refusing a pickle with persistent ids")


def payload_bytes(payload: Union[str, bytes, bytearray]) -> bytes:
    """A `serialized_named_tensors` entry as raw pickle bytes: base64 text over HTTP (SGLang's
    `Base64Bytes`, validated), raw bytes from in-process callers."""
    if isinstance(payload, str):
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as e:
            raise UnsafePayload(f"serialized_named_tensors entry is not valid base64: {e}") from None
    if isinstance(payload, (bytes, bytearray)):
        return bytes(payload)
    raise UnsafePayload(f"serialized_named_tensors entries must be base64 strings, got {type(payload).__name__}")


def loads(payload: Union[str, bytes, bytearray]) -> Any:
    """Unpickle one payload with the allowlist."""
    return SafeUnpickler(io.BytesIO(payload_bytes(payload))).load()
