"""torch.profiler around chosen phases of chosen steps (``logging.profile_steps``/``profile_phases``).

Phase times say *which* phase is slow; only a kernel-level profile says *why* (host-bound gaps,
one kernel, a sync per micro-batch). The profiler runs in the trainer process: with
``cluster.backend: local`` the actor's ranks run there, so its whole forward, backward and
optimizer step are in it; with Ray the workers are other processes and only the driver's share is
recorded. Rollout servers are always processes of their own: the rollout phase shows the client.

Each profiled phase writes two files under ``logging.profile_dir`` (default OUTPUT_DIR/profile):
``step_<N>_<phase>.txt``, the top operations by device time (by host time on CPU), and
``step_<N>_<phase>.json.gz``, a Chrome/Perfetto trace.
"""
from __future__ import annotations

import collections
import contextlib
import gzip
import shutil
from pathlib import Path
from typing import Iterator, Optional, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROWS = 40   # operations in the text table


class PhaseProfiler:
    """Decides per (step, phase) whether to profile and writes the result where it said it would."""

    def __init__(self, steps: Sequence[int], phases: Sequence[str], out_dir: Path) -> None:
        self.steps = set(int(s) for s in steps)
        self.phases = set(phases)
        self.out_dir = Path(out_dir)

    def wanted(self, step: int, phase: str) -> bool:
        """``step`` is 1-based, as the console and the metric sinks number steps."""
        return step in self.steps and (not self.phases or phase in self.phases)

    @contextlib.contextmanager
    def phase(self, step: int, phase: str) -> Iterator[None]:
        if not self.wanted(step, phase):
            yield
            return
        from torch.profiler import ProfilerActivity, profile

        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            yield
            if cuda:
                torch.cuda.synchronize()   # the phase's kernels belong to the phase
        self.write(prof, f"step_{step}_{phase}", cuda)

    def write(self, prof: "torch.profiler.profile", stem: str, cuda: bool) -> Path:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=sort, row_limit=ROWS)
        text = self.out_dir / f"{stem}.txt"
        text.write_text(table + "\n")
        raw = self.out_dir / f"{stem}.json"
        prof.export_chrome_trace(str(raw))
        with raw.open("rb") as src, gzip.open(f"{raw}.gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        raw.unlink()
        return text


def host_reads(prof: "torch.profiler.profile", outside: str = "Optimizer.step#") -> int:
    """Host reads of device values (``aten::_local_scalar_dense``: on a GPU, a sync each) in a
    profile, except under a ``record_function`` whose name starts with ``outside`` (default: torch
    optimizers' own steps, whose CPU step counters are read on the CPU, not the device)."""
    def excluded(e) -> bool:
        while e is not None:
            if e.name.startswith(outside):
                return True
            e = e.cpu_parent
        return False
    return sum(1 for e in prof.events() if e.name == "aten::_local_scalar_dense" and not excluded(e))


# ops that dispatch but launch no kernel: allocations and shape-only results (views are told apart
# by their schema, ``OpOverload.is_view``)
_NO_KERNEL = frozenset({"aten._unsafe_view", "aten.empty", "aten.empty_like", "aten.empty_strided",
                        "aten.new_empty", "aten.new_empty_strided", "aten.resize_", "aten.set_",
                        "aten.record_stream", "aten.is_same_size", "aten._reshape_alias",
                        "aten._has_compatible_shallow_copy_type"})


class OpCounter(TorchDispatchMode):
    """Inside ``with OpCounter() as c``: ``c.ops`` counts the compute ops dispatched, by aten name
    (views and allocations left out), ``c.host_reads`` the reads of tensor values by the host.

    Why: where a phase is bound by launching kernels, each op costs host time whatever its size,
    and this count is the same on any machine, unlike a timing; one eager compute op is about one
    kernel on CUDA. Compiled regions (torch.compile) do not run under a dispatch mode: count with
    the compiled fusions off (``MEGARL_FUSIONS=0``)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.host_reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        if name == "aten._local_scalar_dense":
            self.host_reads += 1
        elif not func.is_view and name not in _NO_KERNEL:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.ops.values())


def phase_profiler(steps: Sequence[int], phases: Sequence[str], out_dir: Path) -> Optional[PhaseProfiler]:
    """None when nothing is to be profiled (the common case costs one ``if``)."""
    return PhaseProfiler(steps, phases, out_dir) if steps else None
