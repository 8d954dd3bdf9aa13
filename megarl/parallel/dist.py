"""torch.distributed + megatron ``parallel_state`` setup with deadlines that name the group."""
from __future__ import annotations

import contextlib
import datetime
import logging
import os
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from .cpu_shim import apply_cpu_shim, cuda_available

from megarl.wire.process_group import bind_gloo_towards, has_abandoned_groups

log = logging.getLogger("megarl.parallel")

DEFAULT_TIMEOUT_S = float(os.environ.get("MEGARL_DIST_TIMEOUT_S", 600))

_GROUP_NAMES: dict = {}  # id(process group) -> short name ("tp", "pp", ...)
_TIMEOUT_S: float = DEFAULT_TIMEOUT_S


class CollectiveTimeout(RuntimeError):
    """A collective or process-group setup failed / timed out; the message names the group."""


def default_backend() -> str:
    return "nccl" if cuda_available() else "gloo"


AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"   # "True": a launcher (torchelastic, spawn) hosts the store


def hosts_rendezvous_store(rank: int) -> bool:
    """Does this rank bind the rendezvous store? Rank 0, unless a launcher holds it already
    (``TORCHELASTIC_USE_AGENT_STORE=True``, torch's own convention, which env:// honours too)."""
    return rank == 0 and os.environ.get(AGENT_STORE) != "True"


def init_distributed(backend: Optional[str] = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                     rank: Optional[int] = None, world_size: Optional[int] = None,
                     init_method: Optional[str] = None, store: Optional[dist.Store] = None) -> None:
    """Initialise the default process group (idempotent).

    Backend: ``nccl`` when a CUDA device exists, else ``gloo`` (and the CPU shim is applied).
    Rank / world size / address come from the usual env vars (RANK, WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT, LOCAL_RANK) unless given; ``store`` (a store rank 0 already holds) replaces the
    env rendezvous. ``timeout_s`` bounds every collective on the
    default group (gloo honours it; NCCL through its watchdog).
    """
    global _TIMEOUT_S
    apply_cpu_shim()  # no-op with CUDA
    if dist.is_initialized():
        return
    backend = backend or default_backend()
    rank = int(os.environ.get("RANK", 0)) if rank is None else rank
    world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
    if store is None and init_method is None:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
        init_method = "env://"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank % max(1, torch.cuda.device_count()))))
    elif world_size > 1 and (store is not None or init_method == "env://"):
        bind_gloo_towards(os.environ["MASTER_ADDR"])
    _TIMEOUT_S = float(timeout_s)
    dist.init_process_group(backend=backend, init_method=None if store is not None else init_method,
                            store=store, rank=rank,
                            world_size=world_size,
                            timeout=datetime.timedelta(seconds=float(timeout_s)))
    _GROUP_NAMES[id(dist.group.WORLD)] = "world"


def _mpu():
    from megatron.core import parallel_state as mpu
    return mpu


def init_model_parallel(tp: int = 1, pp: int = 1, vpp: Optional[int] = None, ep: int = 1,
                        etp: Optional[int] = 1, cp: int = 1,
                        timeout_s: Optional[float] = None, seed: int = 1234,
                        check: bool = True) -> None:
    """Create megatron's parallel_state groups (dp is implied by world size).

    Every megatron group gets ``timeout_s`` (default: the one given to ``init_distributed``).
    With ``check`` each group does one tiny all-reduce under :func:`collective_deadline`, so a
    mis-wired launch fails at start-up with the group's name instead of hanging later.
    Also seeds megatron's RNG tracker (``model_parallel_cuda_manual_seed``).
    """
    if not dist.is_initialized():
        init_distributed(timeout_s=timeout_s or DEFAULT_TIMEOUT_S)
    timeout_s = float(timeout_s or _TIMEOUT_S)
    mpu = _mpu()
    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()
    ws = dist.get_world_size()
    if ws % (tp * pp * cp) != 0:
        raise ValueError(f"world size {ws} is not divisible by tp*pp*cp={tp * pp * cp}")
    mpu.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        distributed_timeout_minutes=timeout_s / 60.0,  # megatron builds timedelta(minutes=...)
    )
    _register_group_names()
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    model_parallel_cuda_manual_seed(seed)
    if check:
        for name, group in groups().items():
            with collective_deadline(name, group=group):
                t = torch.ones(1, device="cuda" if cuda_available() else "cpu")
                dist.all_reduce(t, group=group)


def groups() -> dict:
    """Short name -> process group for this rank (tp, pp, dp, cp, ep, etp, edp, mp, dp_cp)."""
    mpu = _mpu()
    getters = {
        "tp": mpu.get_tensor_model_parallel_group,
        "pp": mpu.get_pipeline_model_parallel_group,
        "dp": mpu.get_data_parallel_group,
        "cp": mpu.get_context_parallel_group,
        "mp": mpu.get_model_parallel_group,
        "ep": mpu.get_expert_model_parallel_group,
        "etp": mpu.get_expert_tensor_parallel_group,
        "edp": mpu.get_expert_data_parallel_group,
    }
    out = {}
    for name, get in getters.items():
        try:
            g = get()
        except Exception:
            continue
        if g is not None:
            out[name] = g
    return out


def _register_group_names():
    for name, g in groups().items():
        _GROUP_NAMES.setdefault(id(g), name)


def group_name(group) -> str:
    if group is None:
        return "world"
    return _GROUP_NAMES.get(id(group), getattr(group, "group_desc", None) or "unnamed")


@contextlib.contextmanager
def collective_deadline(name: Optional[str] = None, group=None,
                        timeout_s: Optional[float] = None) -> Iterator[None]:
    """Run collectives; a failure (gloo/NCCL timeout, peer gone) becomes :class:`CollectiveTimeout`
    whose message names the group and its ranks. The deadline itself is the group's timeout
    (set at creation from ``timeout_s``)."""
    name = name or group_name(group)
    try:
        yield
    except CollectiveTimeout:
        raise
    except (RuntimeError, dist.DistError) as e:  # DistBackendError subclasses RuntimeError
        try:
            ranks = dist.get_process_group_ranks(group) if group is not None else list(
                range(dist.get_world_size()))
        except Exception:
            ranks = "?"
        raise CollectiveTimeout(
            f"collective on process group '{name}' (global ranks {ranks}) failed after at most "
            f"{timeout_s or _TIMEOUT_S:g}s on rank {dist.get_rank() if dist.is_initialized() else '?'}: "
            f"{type(e).__name__}: {e}") from e


def destroy_model_parallel() -> None:
    """Destroy megatron groups (keeps the default process group)."""
    mpu = _mpu()
    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()
    _GROUP_NAMES.clear()
    if dist.is_initialized():
        _GROUP_NAMES[id(dist.group.WORLD)] = "world"


def destroy_distributed() -> None:
    """Destroy megatron's groups and the default process group -- unless a weight-update group
    with an abandoned broadcast lives in this process (a refused push): destroying every group
    would wait for that broadcast, so the default group stays (idempotent `init_distributed`
    reuses it; process exit releases both)."""
    destroy_model_parallel()
    if dist.is_initialized():
        if has_abandoned_groups():
            log.warning("torch.distributed left initialized: a weight-update group abandoned by a refused "
                        "push would make its destroy wait for the abandoned broadcast")
            return
        dist.destroy_process_group()
