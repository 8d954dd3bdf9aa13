"""CPU shim for megatron-core 0.16.1 (tests / CPU CI only; never applied when CUDA exists).

megatron-core calls CUDA APIs directly in many places. On a machine without a CUDA device
:func:`apply_cpu_shim` patches, in this process only, the eight things listed below
(checked against megatron-core 0.16.1's source):

1. RNG tracker: ``torch.cuda.get_rng_state / set_rng_state / manual_seed(_all)`` and
   ``megatron.core.tensor_parallel.random._get_cuda_rng_state/_set_cuda_rng_state`` -> CPU generator.
2. ``torch.cuda.current_device()`` -> ``"cpu"`` (used as ``device=`` in ~100 places).
3. hard-coded ``device="cuda"`` / ``.cuda()`` / ``.to("cuda")`` -> a global
   ``torch.overrides.TorchFunctionMode`` that rewrites cuda devices to cpu.
4. ``torch.cuda.synchronize`` (and ``empty_cache``) -> no-op.
5. ``torch.cuda.Stream / Event / current_stream / stream`` (MoE dispatcher, shared experts)
   -> inert stand-ins.
6. ``moe_utils.te_general_gemm`` missing without Transformer Engine -> defined as ``None``.
7. ``moe_utils.maybe_move_tensor_to_cpu(as_numpy=True)`` only converted CUDA tensors -> also
   converts CPU tensors to numpy (the alltoall split sizes must be lists, not tensors).
8. ``Tensor.type()`` without arguments names the CUDA type of a CPU tensor
   (``torch.cuda.FloatTensor``): the distributed and Float16 optimizers pick the fp32 main-param
   path by comparing these strings, so the distributed optimizer runs on CPU ranks too.

The shim is idempotent. Call it before building megatron models (``init_distributed`` does).
"""
from __future__ import annotations

import contextlib
import threading

import torch

_APPLIED = False
_LOCK = threading.Lock()
_MODE = None


def cuda_available() -> bool:
    try:
        return torch.cuda.is_available() and torch.cuda.device_count() > 0
    except Exception:  # pragma: no cover
        return False


def shim_applied() -> bool:
    return _APPLIED


def _is_cuda_device(d) -> bool:
    if isinstance(d, torch.device):
        return d.type == "cuda"
    if isinstance(d, str):
        return d.startswith("cuda")
    return False


def _fix_device(d):
    if _is_cuda_device(d):
        return torch.device("cpu")
    return d


class _CudaToCpuMode(torch.overrides.TorchFunctionMode):
    """Rewrite ``device='cuda'`` kwargs, ``.cuda()`` and ``.to('cuda')`` to CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.record_stream:
            return None
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if not name.startswith("torch.cuda.") else name
        if "device" in kwargs:
            kwargs["device"] = _fix_device(kwargs["device"])
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], torch.device("cpu")) + tuple(args[2:])
        if "non_blocking" in kwargs and func is torch.Tensor.to:
            kwargs["non_blocking"] = False
        if "pin_memory" in kwargs:
            kwargs["pin_memory"] = False
        return func(*args, **kwargs)


class _Stream:
    """Inert stand-in for torch.cuda.Stream."""

    def __init__(self, *a, **k):
        pass

    def wait_stream(self, *a, **k):
        pass

    def wait_event(self, *a, **k):
        pass

    def record_event(self, event=None):
        return event or _Event()

    def synchronize(self):
        pass

    def query(self):
        return True


class _Event:
    """Inert stand-in for torch.cuda.Event."""

    def __init__(self, *a, **k):
        pass

    def record(self, *a, **k):
        pass

    def wait(self, *a, **k):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


_DEFAULT_STREAM = _Stream()


def apply_cpu_shim(force: bool = False) -> bool:
    """Patch torch.cuda / megatron-core for CPU. Returns True when the shim is active.

    Idempotent; a no-op (returns False) when a CUDA device exists, unless ``force``.
    """
    global _APPLIED, _MODE
    with _LOCK:
        if _APPLIED:
            return True
        if cuda_available() and not force:
            return False

        # 1. RNG -> CPU generator.
        def _get_rng_state(device="cuda"):
            return torch.get_rng_state()

        def _set_rng_state(new_state, device="cuda"):
            torch.set_rng_state(new_state)

        def _manual_seed(seed):
            # not torch.manual_seed: that calls torch.cuda.manual_seed_all (recursion)
            torch.default_generator.manual_seed(int(seed))

        torch.cuda.get_rng_state = _get_rng_state
        torch.cuda.set_rng_state = _set_rng_state
        torch.cuda.random.get_rng_state = _get_rng_state
        torch.cuda.random.set_rng_state = _set_rng_state
        torch.cuda.manual_seed = _manual_seed
        torch.cuda.manual_seed_all = lambda seed: None  # called by torch.manual_seed
        torch.cuda.random.manual_seed = _manual_seed
        # 2. current_device -> "cpu".
        torch.cuda.current_device = lambda: "cpu"
        # 4. synchronize -> no-op.
        torch.cuda.synchronize = lambda *a, **k: None
        torch.cuda.empty_cache = lambda *a, **k: None
        # 5. streams / events.
        torch.cuda.Stream = _Stream
        torch.cuda.Event = _Event
        torch.cuda.current_stream = lambda *a, **k: _DEFAULT_STREAM
        torch.cuda.default_stream = lambda *a, **k: _DEFAULT_STREAM
        torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()

        # megatron-side patches (module attributes bound at import time).
        from megatron.core.tensor_parallel import random as mrandom

        def _get_cuda_rng_state(device="cuda", clone=False, graph_safe=False):
            return torch.get_rng_state()

        def _set_cuda_rng_state(new_state, device=-1, graph_safe=False):
            torch.set_rng_state(new_state)

        mrandom._get_cuda_rng_state = _get_cuda_rng_state
        mrandom._set_cuda_rng_state = _set_cuda_rng_state

        from megatron.core.transformer.moe import moe_utils, token_dispatcher

        # 6. te_general_gemm NameError without TE.
        if not hasattr(moe_utils, "te_general_gemm"):
            moe_utils.te_general_gemm = None
        # 7. split sizes to numpy on CPU too.
        _orig_move = moe_utils.maybe_move_tensor_to_cpu

        def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
            if torch.is_tensor(tensor) and not tensor.is_cuda:
                return tensor.numpy() if as_numpy else tensor
            return _orig_move(tensor, as_numpy=as_numpy, record_stream=record_stream)

        moe_utils.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
        token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu

        # 8. grad clipping asserts grads are 'torch.cuda.FloatTensor' -> same scaling, any device.
        from megatron.core.optimizer import clip_grads as _clip_grads, optimizer as _optimizer

        def clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
            params = [parameters] if torch.is_tensor(parameters) else list(parameters)
            attr = "decoupled_grad" if use_decoupled_grad else "grad"
            grads = [getattr(p, attr).detach() for p in params if getattr(p, attr, None) is not None]
            clip_coeff = max_norm / (total_norm + 1.0e-6)
            if clip_coeff < 1.0 and grads:
                torch._foreach_mul_(grads, clip_coeff)

        _clip_grads.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32
        _optimizer.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32

        # 3. global torch-function mode rewriting cuda devices.
        _MODE = _CudaToCpuMode()
        _MODE.__enter__()
        _APPLIED = True
        return True
