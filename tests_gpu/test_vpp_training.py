"""GPU only, two GPUs (``benchmarks/run_gpu.sh vpp``): virtual pipeline *training* runs over NCCL.

On CPU validation refuses VPP for a trained role (megatron's interleaved schedule over gloo's
untagged p2p gave wrong gradients or hung). Here one optimizer step of the actor at pp 2 x vpp 2
(four model chunks, megatron's interleaved schedule over NCCL) must equal the same step on one GPU
at pp 1: the loss sums and the gradient norm, packed and padded, and the interleaved run must
really be interleaved (two chunks on each rank)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

DEVICE = os.environ.get("MEGARL_VPP_TEST_DEVICE", "cuda")   # "cpu": the pp 1 path alone, to check the harness


def _train_step(rank, world, hf_dir, batch, layout, packing):
    """One rank: its own GPU (set before CUDA starts in this fresh process), the worker built as a
    role's rank builds it, one forward and one optimizer step over the batch as one mini-batch."""
    os.environ["CUDA_VISIBLE_DEVICES"] = str(rank)
    from megatron.core import parallel_state as mpu

    from megarl.data.packing import plan_shards
    from megarl.workers import MegatronWorker, WorkerSpec
    from megarl.workers.dispatch import make_shards
    from megarl.workers.group import token_budget
    from test_packing import ALGO, _cfg

    cfg, role = _cfg(hf_dir, world, layout, packing)
    cfg.cluster.device = DEVICE
    worker = MegatronWorker(WorkerSpec(role=role, cfg=cfg, rank=rank, world_size=world, master_addr="127.0.0.1",
                                       master_port=int(os.environ["MASTER_PORT"]), trainable=True, value_head=False))
    worker.setup()
    r = getattr(cfg, role)
    dp, dp_rank = mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()
    plan = plan_shards(batch.seq_lens.tolist(), [list(range(len(batch)))], dp, packed=packing,
                       max_tokens=token_budget(cfg, role), micro_batch_size=r.micro_batch_size,
                       micro_multiple=r.parallel.pp if r.parallel.vpp > 1 else 1)
    mask = batch.response_mask()
    dens = [{"num_tokens": float(mask.sum()), "num_seqs": float(len(batch))}]
    fields = ("old_logprobs", "advantages", "rollout_logprobs")
    metrics = worker.train_batch(make_shards(batch, plan, fields, dens)[dp_rank], ALGO)
    return {"chunks": len(worker.chunks), "metrics": metrics}


@pytest.mark.parametrize("packing", [True, False])
def test_interleaved_pipeline_step_equals_one_gpu(packing, tmp_path):
    from dist_utils import make_tiny_hf
    from megarl.parallel import spawn
    from test_packing import random_batch

    assert torch.cuda.device_count() >= 2, "this test needs two GPUs (run_gpu.sh vpp on a two-GPU machine)"
    make_tiny_hf("llama", tmp_path, num_hidden_layers=4)
    batch = random_batch(12, seed=5)
    one = spawn(_train_step, 1, str(tmp_path), batch, {}, packing, init=False, method="spawn", timeout_s=600)
    two = spawn(_train_step, 2, str(tmp_path), batch, {"pp": 2, "vpp": 2}, packing, init=False, method="spawn",
                timeout_s=600)
    assert [r["chunks"] for r in two] == [2, 2]
    ref = one[0]["metrics"]
    got = [r["metrics"] for r in two if r["metrics"]]
    assert got, "no rank of the last pipeline stage reported metrics"
    keys = [k for k in ref if k.endswith("_sum")] + ["grad_norm"]
    assert ref["grad_norm"] > 0 and len(keys) >= 2
    for key in keys:
        assert abs(got[-1][key] - ref[key]) < 1e-4 * max(1.0, abs(ref[key])), (key, got[-1][key], ref[key])
