"""megarl.parallel: CPU shim, launcher, megatron parallel_state setup, named collective deadlines.

Everything that patches torch runs in a forked worker so the pytest process stays untouched.
"""
import time

import pytest
import torch

from megarl.parallel import SpawnError, spawn


def _shim_checks(rank, world):
    import numpy as np
    from megarl.parallel import apply_cpu_shim, shim_applied
    assert not shim_applied()
    assert apply_cpu_shim() is True
    assert apply_cpu_shim() is True  # idempotent
    # 1. RNG
    s = torch.cuda.get_rng_state()
    a = torch.rand(3)
    torch.cuda.set_rng_state(s)
    assert torch.equal(a, torch.rand(3))
    torch.cuda.manual_seed(7)
    torch.manual_seed(7)  # must not recurse through torch.cuda.manual_seed_all
    from megatron.core.tensor_parallel import random as mrandom
    mrandom._set_cuda_rng_state(mrandom._get_cuda_rng_state())
    # 2. current_device
    assert torch.cuda.current_device() == "cpu"
    # 3. hard-coded cuda devices
    assert torch.empty(2, device="cuda").device.type == "cpu"
    assert torch.zeros(2, device=torch.device("cuda", 0)).device.type == "cpu"
    assert torch.ones(2).cuda().device.type == "cpu"
    assert torch.ones(2).to("cuda").device.type == "cpu"
    # 4. synchronize
    torch.cuda.synchronize()
    # 5. streams/events
    st = torch.cuda.Stream()
    st.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(st):
        pass
    torch.cuda.Event().record()
    # 6./7. moe utils
    from megatron.core.transformer.moe import moe_utils, token_dispatcher
    assert moe_utils.te_general_gemm is None
    out = token_dispatcher.maybe_move_tensor_to_cpu(torch.tensor([1, 2]), as_numpy=True)
    assert isinstance(out, np.ndarray)
    return "ok"


def test_cpu_shim_covers_the_seven_fixes_and_is_idempotent():
    assert spawn(_shim_checks, 1, init=False) == ["ok"]


def _shim_noop_with_cuda(rank, world):
    from megarl.parallel import cpu_shim
    cpu_shim.cuda_available = lambda: True
    assert cpu_shim.apply_cpu_shim() is False
    assert not cpu_shim.shim_applied()
    assert torch.cuda.current_device is not None and torch.cuda.synchronize.__module__ != cpu_shim.__name__
    return "ok"


def test_cpu_shim_is_noop_when_cuda_exists():
    assert spawn(_shim_noop_with_cuda, 1, init=False) == ["ok"]


def _fails_on_rank1(rank, world):
    if rank == 1:
        raise ValueError("boom from rank one")
    return rank


def test_spawn_propagates_rank_traceback():
    with pytest.raises(SpawnError) as ei:
        spawn(_fails_on_rank1, 2)
    assert ei.value.rank == 1
    assert "boom from rank one" in str(ei.value) and "_fails_on_rank1" in str(ei.value)


def _groups(rank, world):
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu
    from megarl.parallel import destroy_model_parallel, groups, init_model_parallel
    assert dist.get_backend() == "gloo"
    init_model_parallel(tp=2)
    tp = mpu.get_tensor_model_parallel_world_size()
    dp = mpu.get_data_parallel_world_size()
    names = sorted(groups())
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t, group=groups()["tp"])
    destroy_model_parallel()
    init_model_parallel(pp=2)
    pp = mpu.get_pipeline_model_parallel_world_size()
    return tp, dp, pp, t.item(), names


def test_init_model_parallel_tp_then_pp():
    res = spawn(_groups, 2)
    for tp, dp, pp, s, names in res:
        assert (tp, dp, pp, s) == (2, 1, 2, 3.0)
        assert {"tp", "pp", "dp", "ep"} <= set(names)


def _hang_on_tp(rank, world):
    import torch.distributed as dist
    from megarl.parallel import collective_deadline, groups, init_model_parallel
    init_model_parallel(tp=2, timeout_s=2.0)
    if rank == 0:
        with collective_deadline(group=groups()["tp"]):
            dist.all_reduce(torch.ones(1), group=groups()["tp"])
    else:
        time.sleep(600)  # rank 1 never joins the collective (spawn terminates it once rank 0 fails)
    return rank


def test_collective_timeout_names_the_group():
    t0 = time.time()
    with pytest.raises(SpawnError) as ei:
        spawn(_hang_on_tp, 2, collective_timeout_s=2.0)
    msg = str(ei.value)
    assert "CollectiveTimeout" in msg and "process group 'tp'" in msg, msg
    assert time.time() - t0 < 240   # a hang guard (two ranks starting on a loaded box), below spawn's 300 s
