"""Move a Megatron role's state off the device between phases, and back, bit for bit.

Why by storage: megatron keeps parameters, gradients and optimizer shards as *views* into a few
large buffers (DDP's ``_ParamAndGradBuffer.param_data`` / ``grad_data``, the distributed
optimizer's shard views, ``param.main_grad``). Moving each tensor with ``.to()`` would break
every view. Instead each underlying storage is copied to host memory and then resized to zero
bytes: the storage object, and every view on it, stays valid; resizing it back re-allocates
device memory and the bytes are copied in. This is the mechanism verl and slime use with
megatron; here it is one small class for every kind of state.

Kinds (each switched on per role, ``ROLE.offload.{params,grads,optimizer}``):
- ``params``: the model's weights (the role's forward needs them back);
- ``grads``: DDP's gradient buffers. They are zeroed before every mini-batch, so nothing is
  copied: the memory is released and comes back zero-filled;
- ``optimizer``: the fp32 main parameters and Adam moments (whatever tensors the optimizer
  holds on the device; a CPU optimizer's host-side state is left alone).

On CUDA the host side is one page-locked buffer per kind (cudaHostRegister at its exact size),
allocated on the first offload and reused (pinning is slow and the same sizes come back every
step), and the copies run on a side stream; the caller's stream waits for an onload before it
uses the tensors.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

import torch

KINDS = ("params", "grads", "optimizer")


@dataclass
class _Slot:
    """One device storage and its host copy."""

    storage: Any                 # torch.UntypedStorage on the device (resized to 0 while offloaded)
    nbytes: int
    copy_back: bool              # False: gradients (zero-filled on onload)
    host: torch.Tensor | None = None


@dataclass
class MoveReport:
    kinds: tuple[str, ...]
    bytes_copied: int = 0
    bytes_freed: int = 0
    seconds: float = 0.0

    def metrics(self, direction: str) -> dict[str, float]:
        gbps = self.bytes_copied / self.seconds / 1e9 if self.seconds > 0 and self.bytes_copied else 0.0
        return {f"memory/{direction}_bytes": float(self.bytes_copied), f"memory/{direction}_s": self.seconds,
                f"memory/{direction}_GBps": gbps}


@dataclass
class StateOffloader:
    """The offloadable state of one rank, by kind; ``offload``/``onload`` move whole kinds.

    The storages are collected at each offload (the optimizer creates its Adam moments at its
    first step); host buffers are kept per kind and position and reused while sizes match."""

    chunks: list[torch.nn.Module]
    optimizer: Any
    device: torch.device
    slots: dict[str, list[_Slot]] = field(default_factory=dict)
    resident: set[str] = field(default_factory=lambda: set(KINDS))
    _hosts: dict[str, torch.Tensor] = field(default_factory=dict)   # kind -> host buffer
    _stream: Any = None

    def collect(self) -> dict[str, list[_Slot]]:
        """The device storages of the model chunks (DDP-wrapped or not) and the optimizer, by
        kind. A storage appears under one kind only (an fp32 model's optimizer updates the
        parameters in place: they count as params); offloaded (empty) storages are skipped."""
        seen: set[int] = set()
        found: dict[str, list[_Slot]] = {k: [] for k in KINDS}

        def add(kind: str, tensors: Iterable[torch.Tensor], copy_back: bool = True) -> None:
            for t in tensors:
                if t is None or t.device.type != self.device.type:
                    continue
                st = t.untyped_storage()
                if st.nbytes() == 0 or st.data_ptr() in seen:
                    continue
                seen.add(st.data_ptr())
                found[kind].append(_Slot(st, st.nbytes(), copy_back))

        add("params", (p for c in self.chunks for p in c.parameters()))
        add("params", _param_buffers(self.chunks))
        add("grads", _grad_buffers(self.chunks), copy_back=False)
        if self.optimizer is not None:
            add("optimizer", _optimizer_tensors(self.optimizer))
        return found

    def nbytes(self, kind: str) -> int:
        slots = self.slots.get(kind) if kind not in self.resident else self.collect()[kind]
        return sum(s.nbytes for s in slots or ())

    # ------------------------------------------------------------------ moves
    def offload(self, kinds: Iterable[str]) -> MoveReport:
        todo = [k for k in kinds if k in self.resident]
        report = MoveReport(tuple(todo))
        if not todo:
            return report
        start = time.perf_counter()
        found = self.collect()
        for k in todo:
            self.slots[k] = found[k]
            self._assign_host(k, [s for s in found[k] if s.copy_back])
        slots = [s for k in todo for s in self.slots[k]]
        with self._side_stream():
            for s in slots:
                if s.copy_back:
                    s.host.copy_(_bytes_view(s.storage, self.device), non_blocking=self._pinned())
                    report.bytes_copied += s.nbytes
        self._sync()
        for s in slots:
            if not s.storage.resizable():   # e.g. shared with a numpy array (tensor.numpy() on CPU)
                raise RuntimeError(f"offload: a {s.nbytes}-byte storage cannot be released (not resizable: "
                                   f"memory shared outside torch)")
            s.storage.resize_(0)
            report.bytes_freed += s.nbytes
        self.resident.difference_update(todo)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()   # give the memory back to the colocated rollout server
        report.seconds = time.perf_counter() - start
        return report

    def onload(self, kinds: Iterable[str]) -> MoveReport:
        todo = [k for k in kinds if k in self.slots and k not in self.resident]
        report = MoveReport(tuple(todo))
        if not todo:
            return report
        start = time.perf_counter()
        slots = [s for k in todo for s in self.slots[k]]
        for s in slots:
            s.storage.resize_(s.nbytes)
        if self.device.type == "cuda":
            self._stream_obj().wait_stream(torch.cuda.current_stream())   # allocations happen first
        with self._side_stream():
            for s in slots:
                view = _bytes_view(s.storage, self.device)
                if s.copy_back:
                    view.copy_(s.host, non_blocking=self._pinned())
                    report.bytes_copied += s.nbytes
                else:
                    view.zero_()
        self._sync()
        self.resident.update(todo)
        report.seconds = time.perf_counter() - start
        return report

    @contextmanager
    def resident_for(self, kinds: Iterable[str]) -> Iterator[None]:
        """These kinds on the device for the duration (a checkpoint, an export, a push to a
        restarted server mid-rollout), then back where they were."""
        back = [k for k in kinds if k in self.slots and k not in self.resident]
        self.onload(back)
        try:
            yield
        finally:
            self.offload(back)

    def _assign_host(self, kind: str, slots: list[_Slot]) -> None:
        """One host buffer per kind, each storage a 512-byte aligned slice of it. On CUDA it is
        page-locked with cudaHostRegister at its exact size (torch's pinned allocator rounds every
        block up to a power of two, up to twice the host memory), allocated on the first offload
        and kept while the sizes stay the same."""
        offsets, total = [], 0
        for s in slots:
            offsets.append(total)
            total += -(-s.nbytes // 512) * 512
        buf = self._hosts.get(kind)
        if buf is None or buf.numel() != total:
            if buf is not None:
                self._unregister(buf)
            buf = torch.zeros(total, dtype=torch.uint8)   # zeros: pages faulted in by torch's parallel fill
            if self._pinned() and total:
                err = torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), total, 0)
                if int(err) != 0:
                    raise RuntimeError(f"offload: cudaHostRegister of {total} bytes of host memory failed ({err})")
            self._hosts[kind] = buf
        for s, off in zip(slots, offsets):
            s.host = buf[off:off + s.nbytes]

    def _unregister(self, buf: torch.Tensor) -> None:
        if self._pinned() and buf.numel():
            torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())

    def close(self) -> None:
        """Unpin and drop the host buffers (the state must be resident)."""
        for buf in self._hosts.values():
            self._unregister(buf)
        self._hosts.clear()

    def host_bytes(self) -> int:
        """Host memory this rank holds for offloaded state (pinned on CUDA)."""
        return sum(h.numel() for h in self._hosts.values())

    # ------------------------------------------------------------------ streams
    def _pinned(self) -> bool:
        return self.device.type == "cuda"

    def _stream_obj(self) -> Any:
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=self.device)
        return self._stream

    def _side_stream(self) -> Any:
        if self.device.type == "cuda":
            return torch.cuda.stream(self._stream_obj())
        return _NullContext()

    def _sync(self) -> None:
        """Copies finished before the storages are freed (offload) or used (onload)."""
        if self.device.type == "cuda":
            self._stream_obj().synchronize()


class _NullContext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def _bytes_view(storage: Any, device: torch.device) -> torch.Tensor:
    """The whole storage as a flat uint8 tensor (shares memory)."""
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


def _buffers(chunks: list[torch.nn.Module]) -> Iterator[Any]:
    """megatron DDP's ``_ParamAndGradBuffer`` lists (a plain module's ``buffers`` is nn.Module's method)."""
    for c in chunks:
        for name in ("buffers", "expert_parallel_buffers"):
            found = getattr(c, name, None)
            if isinstance(found, (list, tuple)):
                yield from found


def _param_buffers(chunks: list[torch.nn.Module]) -> Iterator[torch.Tensor]:
    """DDP's contiguous parameter buffers (distributed optimizer): the parameters are views."""
    for b in _buffers(chunks):
        if getattr(b, "param_data", None) is not None:
            yield b.param_data


def _grad_buffers(chunks: list[torch.nn.Module]) -> Iterator[torch.Tensor]:
    for b in _buffers(chunks):
        if getattr(b, "grad_data", None) is not None:
            yield b.grad_data


def own_optimizer_state(optimizer: Any) -> int:
    """Give torch its own copy of every optimizer-state tensor whose storage it cannot resize, and
    return how many were copied.

    Why: ``torch.load`` on the CPU returns tensors whose storage is the file's bytes (not
    resizable), and torch's optimizers keep loaded state as it comes when device and dtype already
    match (Adam's ``step``, ``exp_avg``, ``exp_avg_sq``). Offload releases storages by resizing them,
    so a resumed run with ``offload.optimizer`` would stop at its first offload. The state dict
    entries are plain references (no views into them), so replacing them is safe."""
    copied = 0
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", opt)
        for state in getattr(inner, "state", {}).values():
            for key, value in list(state.items()):
                if isinstance(value, torch.Tensor) and not value.untyped_storage().resizable():
                    state[key] = value.clone()
                    copied += 1
    return copied


def _optimizer_tensors(optimizer: Any) -> Iterator[torch.Tensor]:
    """Every tensor a megatron optimizer holds: main parameters (fp32 copies or shards) and the
    inner torch optimizer's state, for each optimizer of a chain."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        for attr in ("fp32_from_float16_groups", "shard_fp32_from_float16_groups", "shard_fp32_groups"):
            for group in getattr(opt, attr, None) or ():
                yield from group
        inner = getattr(opt, "optimizer", None)
        if inner is None:
            continue
        for group in inner.param_groups:
            yield from group["params"]
        for state in inner.state.values():
            yield from (v for v in state.values() if isinstance(v, torch.Tensor))
