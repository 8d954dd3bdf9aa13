"""Colocated weight push (megarl/sync/colocated.py): every trainer rank sees every HF tensor (TP,
PP and EP layouts, against the sender-only stream), and a TP2 server's rank r receives its handle
from the trainer rank on its own device (payload r's shared memory was made by trainer rank r)."""
from __future__ import annotations

import asyncio
import hashlib

import pytest
import torch

from megarl.rollout.client import SGLangClient, sampling_params
from tests.helpers.servers import ServerProcess, make_tiny_hf_model

PROMPT = [3, 14, 15, 92, 65, 35]


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def _streams(rank, world, hf_dir, tp, pp, ep):
    import torch.distributed as dist
    from transformers import AutoConfig

    from megarl.models import build_model, iter_hf_weights, load_hf_weights
    from megarl.parallel import apply_cpu_shim, init_model_parallel
    from megarl.sync.colocated import iter_hf_weights_everywhere

    apply_cpu_shim()
    init_model_parallel(tp=tp, pp=pp, ep=ep)
    cfg = AutoConfig.from_pretrained(hf_dir)
    chunks = build_model(cfg)
    load_hf_weights(chunks, hf_dir)
    everywhere = [(n, _digest(t)) for n, t in iter_hf_weights_everywhere(chunks, cfg)]
    senders = {n: _digest(t) for n, t in iter_hf_weights(chunks, cfg)}  # the sender-only contract
    union = [None] * world
    dist.all_gather_object(union, senders)
    return {"everywhere": everywhere, "union": {k: v for part in union for k, v in part.items()}}


@pytest.mark.parametrize("family,tp,pp,ep", [("qwen2", 2, 1, 1), ("llama", 1, 2, 1), ("qwen3_moe", 1, 1, 2)])
def test_every_rank_streams_the_whole_model_in_one_order(tmp_path, family, tp, pp, ep):
    from megarl.parallel import spawn

    d = str(tmp_path / family)
    make_tiny_hf_model(d, family, std=0.1, vocab_size=160, tie_word_embeddings=False)
    res = spawn(_streams, 2, d, tp, pp, ep, timeout_s=300)
    union = res[0]["union"]
    assert len(union) > 10
    for r in res:
        assert r["everywhere"] == res[0]["everywhere"], "same tensors in the same order on every rank"
        assert dict(r["everywhere"]) == union, "every rank holds exactly the senders' tensors"


def _colocated_rank(rank, world, hf_dir, url):
    import os

    import torch.distributed as dist
    from transformers import AutoConfig

    from megarl.models import build_model, forward_logits, load_hf_weights
    from megarl.parallel import apply_cpu_shim, init_model_parallel
    from megarl.sync.colocated import ipc_groups
    from megarl.sync.rank import PushTarget, RankSender
    from megarl.sync.session import weight_update_session

    apply_cpu_shim()
    init_model_parallel(tp=2)
    cfg = AutoConfig.from_pretrained(hf_dir)
    chunks = build_model(cfg)
    load_hf_weights(chunks, hf_dir)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in chunks[0].parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)

    sender = RankSender()   # what a MegatronWorker holds for its pushes
    target = PushTarget(urls=(url,), server_tp_sizes=(2,), transport="tensor", backend="gloo", bucket_mb=0.05,
                        verify_checksum=None, disk_dir=None, api_key=None, ipc_groups=ipc_groups(1, 2))
    origins = []
    if rank == 0:  # record where each posted payload's shared memory was made (its creator's pid)
        import megarl.sync.colocated as colocated

        real = colocated.IpcFanIn.payloads

        def recording(self, bucket, server_tp, fmt):
            out = real(self, bucket, server_tp, fmt)
            origins.extend([_shm_pids(p) for p in out[0]] if out else [])
            return out
        colocated.IpcFanIn.payloads = recording
    with weight_update_session([url]) if rank == 0 else _nothing():
        dist.barrier()
        stats = sender.push(chunks, target, "colocated1")
        dist.barrier()
    sender.close()
    pids = [None] * world
    dist.all_gather_object(pids, os.getpid())

    def sample():
        async def go():
            async with SGLangClient(url) as c:
                return (await c.generate(PROMPT, sampling_params(max_new_tokens=8, temperature=1.0, sampling_seed=5)))[0]
        return asyncio.run(go())
    out = [sample() if rank == 0 else None]
    dist.broadcast_object_list(out, src=0)
    logits = forward_logits(chunks, torch.tensor([PROMPT + out[0].output_ids]))
    lp = torch.log_softmax(logits[0].float(), -1)
    ref = torch.stack([lp[len(PROMPT) - 1 + i, t] for i, t in enumerate(out[0].output_ids)])
    return {"diff": (ref - torch.tensor(out[0].logprobs)).abs().max().item(), "pids": pids, "origins": origins,
            "stats": stats, "version": out[0].weight_version}


def _shm_pids(payload: str) -> set:
    from tests.helpers.ipc import shm_creator_pids

    return shm_creator_pids(payload)


def _nothing():
    import contextlib

    return contextlib.nullcontext()


def test_tp2_trainer_hands_each_server_tp_rank_its_own_copy(tmp_path):
    from megarl.parallel import spawn

    d = str(tmp_path / "m")
    make_tiny_hf_model(d, "qwen2", std=0.1, vocab_size=160, tie_word_embeddings=False)
    with ServerProcess(d, extra=["--tp-size", "2"]) as server:
        res = spawn(_colocated_rank, 2, d, server.url, timeout_s=400)
    r0 = res[0]
    assert r0["version"] == "colocated1" and r0["stats"]["buckets"] > 1
    assert r0["diff"] < 1e-4, f"the TP2 server serves the trainer's weights (max |diff| {r0['diff']})"
    assert r0["origins"], "the leader posted payloads"
    for per_rank in zip(*[iter(r0["origins"])] * 2):   # (payload for TP rank 0, for TP rank 1) per bucket
        assert per_rank[0] == {r0["pids"][0]} and per_rank[1] == {r0["pids"][1]}, per_rank
    assert res[1]["stats"] == {}, "only each server's first rank reports"
