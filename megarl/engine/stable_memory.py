"""Device memory whose address survives a release: CUDA virtual memory management (VMM).

Why: a colocated engine gives its weights and KV cache back to the driver while the trainer runs
(`/release_memory_occupation`) and takes memory again afterwards. Reallocated through torch, both
come back at new addresses, and every captured decode graph -- which bakes in the addresses it
reads -- must be captured again, every RL step (~0.1 s a step for SmolLM2 on an H100;
benchmarks/RESULTS.md, GRPO loop on one GPU).
SGLang avoids this with torch_memory_saver, which keeps the virtual range and swaps only the
physical pages behind it. :class:`StableRegion` does the same for one byte range:

- ``cuMemAddressReserve`` reserves a virtual range once;
- ``cuMemCreate`` + ``cuMemMap`` + ``cuMemSetAccess`` put physical memory behind it (at creation
  and at every :meth:`StableRegion.restore`);
- ``cuMemUnmap`` + ``cuMemRelease`` give the physical memory back (:meth:`StableRegion.release`)
  while the range, and every tensor viewing it, keeps its address.

The driver API is reached through ``ctypes`` on ``libcuda`` (the driver torch itself runs on), so
nothing beyond torch is needed. Where VMM is unavailable (CPU, a driver without it, or
``MEGARL_STABLE_MEMORY=0``) callers fall back to ordinary torch allocations, and graphs are
captured again after a release as before.
"""
from __future__ import annotations

import ctypes
import os
import sys
from typing import Optional

import torch

_CU_MEM_ALLOCATION_TYPE_PINNED = 1
_CU_MEM_LOCATION_TYPE_DEVICE = 1
_CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3
_CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0
_CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 102
_CUDA_ERROR_OUT_OF_MEMORY = 2


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _AllocationProp(ctypes.Structure):
    """``CUmemAllocationProp`` (cuda.h)."""
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _Location),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", _AllocFlags)]


class _AccessDesc(ctypes.Structure):
    """``CUmemAccessDesc`` (cuda.h)."""
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


_driver: Optional[ctypes.CDLL] = None


def _cuda_driver() -> ctypes.CDLL:
    global _driver
    if _driver is None:
        _driver = ctypes.CDLL("libcuda.so.1")
    return _driver


def _check(result: int, call: str) -> None:
    if result != 0:
        text = ctypes.c_char_p()
        _cuda_driver().cuGetErrorString(result, ctypes.byref(text))
        raise RuntimeError(f"{call} failed: CUDA error {result} ({(text.value or b'?').decode()})")


def _device_props(index: int) -> _AllocationProp:
    prop = _AllocationProp()
    prop.type = _CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = _CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = index
    return prop


def stable_memory_available(device: torch.device) -> bool:
    """Whether :class:`StableRegion` can be made on ``device``: a CUDA device whose driver supports
    VMM, unless ``MEGARL_STABLE_MEMORY=0`` turns it off."""
    if device.type != "cuda" or os.environ.get("MEGARL_STABLE_MEMORY", "1") == "0":
        return False
    try:
        drv = _cuda_driver()
        torch.cuda.init()
        dev, supported = ctypes.c_int(), ctypes.c_int()
        index = device.index if device.index is not None else torch.cuda.current_device()
        _check(drv.cuDeviceGet(ctypes.byref(dev), index), "cuDeviceGet")
        _check(drv.cuDeviceGetAttribute(ctypes.byref(supported),
                                        _CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev),
               "cuDeviceGetAttribute")
        return bool(supported.value) and _probe(index)
    except (OSError, RuntimeError, AttributeError):
        return False


_probed: dict = {}


def _probe(index: int) -> bool:
    """One granule reserved, mapped, released and mapped again, once per device and process: a
    driver that reports VMM but refuses it (e.g. under some MPS or virtualised set-ups) makes the
    engine fall back to torch allocations with one line on stderr instead of failing at start."""
    if index not in _probed:
        try:
            region = StableRegion(1, torch.device("cuda", index))
            region.release()
            region.restore()
            region.close()
            _probed[index] = True
        except Exception as e:       # a refusal, a missing symbol, torch refusing the pointer
            print(f"megarl: CUDA virtual memory unusable on cuda:{index} ({e}); the engine's weights and "
                  f"cache use plain allocations (decode graphs are captured again after each release)",
                  file=sys.stderr, flush=True)
            _probed[index] = False
    return _probed[index]


class _DevicePointer:
    """An object exposing ``__cuda_array_interface__`` so torch can view raw device bytes."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 3, "strides": None}


class StableRegion:
    """``nbytes`` of device memory at a fixed virtual address: :attr:`tensor` (uint8) views it for
    the region's life; :meth:`release` frees the physical memory, :meth:`restore` maps fresh
    (uninitialised) physical memory at the same address. Reading :attr:`tensor` while released
    faults the device (a sticky error: the process's CUDA context is lost), so callers guard it
    (the model refuses any forward while its weights are released). Views of :attr:`tensor` do not
    keep the region alive: the owner drops them before :meth:`close`."""

    def __init__(self, nbytes: int, device: torch.device):
        self.device = torch.device(device)
        self.index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        self.nbytes = int(nbytes)
        drv = _cuda_driver()
        with torch.cuda.device(self.index):
            torch.cuda.synchronize()          # makes the device's primary context current here
            prop = _device_props(self.index)
            gran = ctypes.c_size_t()
            _check(drv.cuMemGetAllocationGranularity(ctypes.byref(gran), ctypes.byref(prop),
                                                     _CU_MEM_ALLOC_GRANULARITY_MINIMUM),
                   "cuMemGetAllocationGranularity")
            self.size = max(gran.value, -(-self.nbytes // gran.value) * gran.value)
            ptr = ctypes.c_uint64()
            _check(drv.cuMemAddressReserve(ctypes.byref(ptr), ctypes.c_size_t(self.size), ctypes.c_size_t(0),
                                           ctypes.c_uint64(0), ctypes.c_uint64(0)), "cuMemAddressReserve")
            self.ptr = ptr.value
        self._handle: Optional[int] = None
        self.restore()
        self.tensor = torch.as_tensor(_DevicePointer(self.ptr, self.nbytes), device=self.device)

    @property
    def mapped(self) -> bool:
        """Physical memory is behind the range."""
        return self._handle is not None

    def restore(self) -> None:
        """Physical memory behind the range again (contents undefined). No-op while mapped."""
        if self._handle is not None:
            return
        drv = _cuda_driver()
        with torch.cuda.device(self.index):
            torch.cuda.synchronize()
            handle = self._create()
            ptr, size = ctypes.c_uint64(self.ptr), ctypes.c_size_t(self.size)
            try:
                _check(drv.cuMemMap(ptr, size, ctypes.c_size_t(0), handle, ctypes.c_uint64(0)), "cuMemMap")
                access = _AccessDesc()
                access.location.type = _CU_MEM_LOCATION_TYPE_DEVICE
                access.location.id = self.index
                access.flags = _CU_MEM_ACCESS_FLAGS_PROT_READWRITE
                try:
                    _check(drv.cuMemSetAccess(ptr, size, ctypes.byref(access), ctypes.c_size_t(1)), "cuMemSetAccess")
                except RuntimeError:
                    drv.cuMemUnmap(ptr, size)
                    raise
            except RuntimeError:
                drv.cuMemRelease(handle)
                raise
        self._handle = handle.value

    def _create(self) -> ctypes.c_uint64:
        """Physical memory for the range. Torch's caching allocator may hold freed blocks this
        needs (weight-update buckets, activations): on out-of-memory they are returned to the driver
        and the allocation tried once more, as torch itself does before failing a cudaMalloc."""
        drv, prop, handle = _cuda_driver(), _device_props(self.index), ctypes.c_uint64()
        create = lambda: drv.cuMemCreate(ctypes.byref(handle), ctypes.c_size_t(self.size),  # noqa: E731
                                         ctypes.byref(prop), ctypes.c_uint64(0))
        result = create()
        if result == _CUDA_ERROR_OUT_OF_MEMORY:
            torch.cuda.empty_cache()
            result = create()
        if result == _CUDA_ERROR_OUT_OF_MEMORY:
            free, total = torch.cuda.mem_get_info(self.index)
            raise torch.OutOfMemoryError(f"cuMemCreate: {self.size / 2**30:.2f} GiB for the engine's weights or "
                                         f"cache do not fit on cuda:{self.index} ({free / 2**30:.2f} of "
                                         f"{total / 2**30:.2f} GiB free)")
        _check(result, "cuMemCreate")
        return handle

    def release(self) -> None:
        """The physical memory back to the driver once the device is idle; the address stays
        reserved. No-op while released."""
        if self._handle is None:
            return
        drv = _cuda_driver()
        with torch.cuda.device(self.index):
            torch.cuda.synchronize()          # no kernel may still read the pages
            _check(drv.cuMemUnmap(ctypes.c_uint64(self.ptr), ctypes.c_size_t(self.size)), "cuMemUnmap")
            handle, self._handle = self._handle, None     # unmapped now, whatever the release says
            _check(drv.cuMemRelease(ctypes.c_uint64(handle)), "cuMemRelease")

    def close(self) -> None:
        """Unmap, free and unreserve (the region is unusable afterwards)."""
        if getattr(self, "ptr", None) is None:
            return
        try:
            self.release()
            _check(_cuda_driver().cuMemAddressFree(ctypes.c_uint64(self.ptr), ctypes.c_size_t(self.size)),
                   "cuMemAddressFree")
        finally:
            self.ptr = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:       # interpreter teardown: the driver may already be gone
            pass
